"""fp8 KV keeps one scale per tensor: fit it to what this model's K and V look like (with 2x
headroom) on a short calibration text, so small values do not fall into subnormals."""

from __future__ import annotations

from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

CALIBRATION_TEXT = (
    "The key and value cache holds, for every past token, what attention needs to look back. "
    "Its size grows with layers, heads, head size, context length and the number of requests."
)


def calibrate_fp8(runner: ModelRunner, tokenizer) -> None:
    """One forward over the calibration text sets every layer's scales; the cache is zeroed after."""
    kv = runner.kv
    ids = tokenizer.encode(CALIBRATION_TEXT)[: kv.num_blocks * kv.block_size - 1]
    seq = Sequence("calibration", ids, SamplingParams(max_tokens=1))
    seq.block_table = list(range(-(-len(ids) // kv.block_size)))
    for layer in kv.layers:
        layer.calibrating = True
    try:
        runner.execute(ScheduledBatch(seqs=[seq], num_new_tokens=[len(ids)]))
    finally:
        for layer in kv.layers:
            layer.calibrating = False
    kv.data.zero_()
