"""schemathesis (a tool nobody here wrote) against the served /openapi.json: requests generated
from the document, valid and invalid, must never get a 5xx, and every answer must match the
document's response schema (issue #14). Bounded: a few dozen examples per operation."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_harness import API_KEY, start_server

pytest.importorskip("schemathesis")  # a dev dependency (pyproject's dev extras)
EXAMPLES = 30  # per operation; ~1-2 minutes on 2 cores


@pytest.fixture(scope="module")
def server(tiny_dir):
    # short contexts and a small capacity keep generated requests (n up to 128, big max_tokens) quick
    s = start_server(tiny_dir, "--max-model-len", "128", "--max-num-seqs", "2", "--max-queue", "2", api_key=API_KEY)
    yield s
    s.cleanup()


def test_no_5xx_and_no_response_schema_violation(server, tmp_path):
    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    cmd = [st, "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error,response_schema_conformance",
           "--phases", "examples,fuzzing", "--max-examples", str(EXAMPLES), "--seed", "14", "--workers", "1",
           "--header", f"Authorization: Bearer {API_KEY}", "--request-timeout", "60",
           "--report", "junit", "--report-dir", str(tmp_path)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    # it really ran: every operation of the document, and dozens of requests
    assert "7 selected / 7 total" in r.stdout, r.stdout[-3000:]
    generated = next(line for line in r.stdout.splitlines() if "generated" in line)
    assert int(generated.split()[0]) >= 50, generated
    assert "Traceback" not in server.log  # no 500 handler or failed step logged one
