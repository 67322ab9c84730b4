#!/usr/bin/env bash
# GPU check, for a CUDA machine (a fresh one is fine): the Triton kernel tests compiled (no
# interpreter: attention, store, and the element-wise kernels), the engine end to end against
# transformers on the GPU (benchmarks/gpu_engine.py: tokens, speed at SmolLM2-135M's shape with
# random weights, where a decode step's time goes and how many launches it makes, with the Triton
# element-wise kernels and with torch's), then the kernel benchmark.
# Logs and JSON go to $OUT when it is set, else to out/gpu_check/. At most 8 minutes (each step
# has its own time limit: 200 + 200 + 70 s); exits non-zero when a step fails.
#
#     benchmarks/gpu_check.sh            # PYTHON=/path/to/python to pick the interpreter
#     MODEL_DIR=DIR benchmarks/gpu_check.sh   # SmolLM2-135M's tokenizer + config.json, when the
#                                             # machine has no ~/.cache/kvtop/models/smollm2-135m
set -uo pipefail
cd "$(dirname "$0")/.."

out="${OUT:-out/gpu_check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && py=.venv/bin/python
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1
# the source tree wins over any stale install, and works when the install below cannot
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: $py sees no CUDA GPU (or no torch); nothing to check" >&2
    exit 2
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1 || true

# Install what is missing, quietly. The project itself without its dependencies (the kernels need
# only torch and triton, and a machine without a network cannot fetch the rest); pytest if absent.
{
    if ! "$py" -m pip show -q kvtop >/dev/null 2>&1; then
        "$py" -m pip install -q --no-deps --no-build-isolation -e . ||
            echo "gpu_check: 'pip install -e .' failed; using the source tree on PYTHONPATH"
    fi
    for mod in pytest triton; do
        "$py" -c "import $mod" 2>/dev/null || "$py" -m pip install -q --retries 1 --timeout 20 "$mod"
    done
} >"$out/install.log" 2>&1
if ! "$py" -c 'import pytest, triton, engine.kernels.triton' 2>>"$out/install.log"; then
    echo "gpu_check: pytest, triton or engine.kernels.triton cannot be imported; see $out/install.log" >&2
    exit 3
fi

status=0
echo "== pytest tests/test_triton_fused.py tests/test_triton_kernels.py (compiled)"
timeout 200 "$py" -m pytest -q -p no:cacheprovider tests/test_triton_fused.py tests/test_triton_kernels.py \
    --junitxml="$out/pytest.xml" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "gpu_check: kernel tests failed (exit $rc)"; status=1; }

echo "== python benchmarks/gpu_engine.py"
timeout 200 "$py" benchmarks/gpu_engine.py ${MODEL_DIR:+--model-dir "$MODEL_DIR"} --json "$out/engine.json" 2>&1 |
    grep -v -e "Loading weights" -e "Writing model shards" | tee "$out/engine.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "gpu_check: engine check failed (exit $rc)"; status=1; }

echo "== python benchmarks/triton_kernels.py"
timeout 70 "$py" benchmarks/triton_kernels.py --time-budget 40 --json "$out/kernels.json" 2>&1 | tee "$out/kernels.log"
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "gpu_check: kernel benchmark failed (exit $rc)"; status=1; }

echo "gpu_check: $([ $status -eq 0 ] && echo ok || echo FAILED); logs in $out"
exit $status
