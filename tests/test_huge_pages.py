"""A CPU engine's weights and KV cache on 2 MiB pages (engine/runtime/huge_pages.py): moved without a
value changed or a tie broken, held once, and on huge pages where the kernel gives them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.runtime import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP setting ("always", "madvise", "never"), None where it has none."""
    if not THP.exists():
        return None
    return THP.read_text().split("[")[1].split("]")[0]


needs_thp = pytest.mark.skipif(
    thp_mode() not in ("always", "madvise") or not huge_pages.enabled(),
    reason="the kernel gives no huge pages here, or KVTOP_HUGE_PAGES=0",
)


needs_placement = pytest.mark.skipif(
    not huge_pages.enabled(), reason="huge pages are off here (KVTOP_HUGE_PAGES=0, or no MADV_HUGEPAGE)"
)


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 1000, bias=True)
        self.embedding = nn.Embedding(1000, 64)
        self.embedding.weight = self.head.weight  # one tensor, two holders
        self.register_buffer("table", torch.arange(4096, dtype=torch.int32).view(64, 64))
        self.register_buffer("rows", self.table[8:16])  # a view of another buffer's storage


@needs_placement
def test_weights_move_with_their_values_ties_and_views_kept():
    model = Tied()
    before = {name: t.clone() for name, t in (*model.named_parameters(), *model.named_buffers())}
    storages = (model.head.weight, model.head.bias, model.table)  # the view's and the tie's are these
    nbytes = sum(t.untyped_storage().nbytes() for t in storages)
    moved = huge_pages.place_weights(model)
    assert nbytes <= moved < nbytes + len(storages) * huge_pages.SLOT_ALIGN  # each storage once
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        assert torch.equal(t, before[name]), name
    assert model.embedding.weight is model.head.weight
    assert model.rows.data_ptr() == model.table.data_ptr() + 8 * 64 * 4
    model.table[8, 0] = -1  # still a view: a write shows through it
    assert model.rows[0, 0] == -1
    assert model.head.weight.data_ptr() % huge_pages.SLOT_ALIGN == 0
    assert torch.equal(model.embedding(torch.tensor([3])), before["head.weight"][3:4])


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@needs_placement
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc")
def test_the_moved_weights_are_held_once():
    model = nn.Linear(4096, 4096, bias=False)  # 64 MiB: freed to the OS as soon as nothing holds it
    before = resident_bytes()
    assert huge_pages.place_weights(model) >= 64 << 20
    assert resident_bytes() - before < 16 << 20  # the old copy went; it would be 64 MiB more


def test_kv_cache_zeros_are_zeros_of_the_shape_and_dtype():
    data = huge_pages.zeros((2, 3, 5, 7), torch.bfloat16)
    assert data.shape == (2, 3, 5, 7) and data.dtype == torch.bfloat16 and data.is_contiguous()
    assert not data.any()


@needs_thp
def test_an_engine_holds_its_weights_and_kv_cache_on_huge_pages(smollm2_dir):
    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory="64MiB", quiet=True)
    model, kv = llm.engine.model, llm.engine.kv
    head = model.logits_head.blocks
    assert model.embed_tokens.blocks is head  # the tied embedding still reads the head's blocks: held once
    assert huge_bytes_at(head.data_ptr()) >= 2 << 20
    assert huge_bytes_at(kv.data.data_ptr()) >= 2 << 20
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert "Paris" in out.text
