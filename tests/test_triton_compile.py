"""The Triton kernels compile for a Hopper GPU (sm_90) on a machine without one.

The other Triton tests run the kernels in Triton's interpreter when there is no GPU; the
interpreter never lowers them, so a kernel that the compiler would refuse (a type it cannot
lower, a shape an MMA does not take) passes there. Here a child process without
TRITON_INTERPRET calls the real host wrappers on CPU tensors, with a stand-in driver that names
sm_90 as the target and turns each launch into a compile-only warmup: every kernel, as the
engine would launch it for bf16 and fp32 queries and each KV dtype, and the element-wise ops in
bf16, fp16 and fp32, must compile to PTX.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
ELEMENTWISE_KERNELS = ("_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel")

CHILD = r"""
import json, sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class Sm90:  # a driver with no device behind it: enough to pick the target and compile
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


driver.set_active(Sm90())
built = []
JITFunction.__getitem__ = lambda fn, grid: (
    lambda *a, **kw: built.append(
        (fn.fn.__name__, kw.get("QUANT"), kw.get("RESIDUAL"), fn.warmup(*a, grid=grid, **kw).asm["ptx"])
    )
)
from engine.kernels import triton as tk

for q_dtype in (torch.bfloat16, torch.float32):
    for kv in ("auto", "int8", "fp8"):
        shape = (8, 16, 2, 64)
        if kv == "int8":
            kc, ks, vs = torch.zeros(shape, dtype=torch.int8), torch.ones(shape[:3]), torch.ones(shape[:3])
        elif kv == "fp8":
            kc, ks, vs = torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.ones(1), torch.ones(1)
        else:
            kc, ks, vs = torch.zeros(shape, dtype=q_dtype), None, None
        vc = kc.clone()
        tables, lens = torch.zeros(2, 8, dtype=torch.int32), torch.tensor([100, 7], dtype=torch.int32)
        long_table = torch.zeros(1, 64, dtype=torch.int32)  # a context long enough to split, and merge
        tk.paged_decode_attention(torch.zeros(2, 6, 64, dtype=q_dtype), kc, vc, tables, lens, 0.1, ks, vs)
        tk.paged_decode_attention(torch.zeros(1, 6, 64, dtype=q_dtype), kc, vc, long_table,
                                  torch.tensor([900], dtype=torch.int32), 0.1, ks, vs)
        cu = torch.tensor([0, 30, 37], dtype=torch.int32)
        tk.paged_prefill_attention(torch.zeros(37, 6, 64, dtype=q_dtype), kc, vc, tables, cu, lens, 0.1, ks, vs)
        if q_dtype == torch.bfloat16:
            rows = torch.zeros(5, 2, 64, dtype=q_dtype)
            tk.store_kv(rows, rows.clone(), kc, vc, torch.arange(5), ks, vs)
# the element-wise ops as the model calls them (odd sizes; q and k as views of the qkv output)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x, w = torch.zeros(5, 67, dtype=dtype), torch.ones(67, dtype=dtype)
    tk.rms_norm(x, w, 1e-6)
    tk.fused_add_rms_norm(x, x.clone(), w, 1e-6)
    qkv = torch.zeros(5, (9 + 2 * 3) * 64, dtype=dtype)
    q, k = qkv[:, : 9 * 64].view(5, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64)
    tk.rms_norm(q, torch.ones(64, dtype=dtype), 1e-6)
    tk.rotary_embedding(q, k, torch.zeros(5, 64, dtype=dtype), torch.zeros(5, 64, dtype=dtype))
    tk.silu_and_mul(torch.zeros(5, 2 * 1539, dtype=dtype))
json.dump([{"name": name, "quant": quant, "residual": residual, "sm90": ".target sm_90" in ptx,
            "lines": ptx.count("\n"), "fma": "fma.rn.f32" in ptx} for name, quant, residual, ptx in built], sys.stdout)
"""


@pytest.mark.integration  # a kvctl or Python process: start-up seconds each
def test_every_triton_kernel_compiles_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout)
    kinds = {(k["name"], k["quant"]) for k in built}
    for quant in (0, 1, 2):  # unquantized, int8, fp8
        for kernel in ("_decode_kernel", "_prefill_kernel", "_store_kv_kernel"):
            assert (kernel, quant) in kinds, f"{kernel} with QUANT={quant} was not built"
    assert ("_decode_merge_kernel", None) in kinds  # flash-decoding's second pass
    elementwise = [(k["name"], k["residual"]) for k in built if k["name"] in ELEMENTWISE_KERNELS]
    assert len(elementwise) == 3 * 5  # five calls, each in bf16, fp16 and fp32
    assert set(elementwise) == {
        ("_rms_norm_kernel", False), ("_rms_norm_kernel", True), ("_rotary_kernel", None), ("_silu_and_mul_kernel", None)
    }  # fmt: skip
    assert all(k["sm90"] and k["lines"] > 100 for k in built), built
    # RoPE rounds each product on its own, as torch does: no product contracted into an fma
    assert not any(k["fma"] for k in built if k["name"] == "_rotary_kernel")
