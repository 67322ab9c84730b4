"""The scheduler on hand-made sequences: admission, the token budget, chunked prefill and
preemption order, with a real BlockManager and no model (each step "computes" what it was given
and, like the engine, appends one token to a sequence whose prompt is done)."""

from __future__ import annotations

from engine.kv.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceState


def seq(name: str, num_tokens: int, first: int = 1000) -> Sequence:
    return Sequence(name, list(range(first, first + num_tokens)), SamplingParams(max_tokens=100))


def make(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64, **kw) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_num_seqs, budget, **kw)


def run(sched: Scheduler) -> ScheduledBatch:
    """One step as the engine does it: schedule, compute the tokens, sample one where due."""
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed_tokens += n
        sched.bm.commit_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
    return batch


def names(seqs: list[Sequence]) -> list[str]:
    return [s.seq_id for s in seqs]


def test_admits_in_arrival_order_up_to_max_num_seqs():
    sched = make(max_num_seqs=2)
    for name in "abcde":
        sched.add(seq(name, 5))
    batch = run(sched)
    assert names(batch.admitted) == ["a", "b"]
    assert names(sched.waiting) == ["c", "d", "e"]
    assert all(s.state is SequenceState.WAITING for s in sched.waiting)


def test_token_budget_chunks_the_prompt_that_does_not_fit():
    sched = make(budget=10)
    a, b = seq("a", 8), seq("b", 8)
    sched.add(a)
    sched.add(b)
    first = run(sched)
    assert names(first.seqs) == ["a", "b"] and first.num_new_tokens == [8, 2]
    assert first.num_tokens == 10
    second = run(sched)  # a decodes one token, b continues its prompt with what is left
    assert names(second.seqs) == ["a", "b"] and second.num_new_tokens == [1, 6]


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks_then_decodes():
    sched = make(budget=10)
    s = seq("long", 25)
    sched.add(s)
    chunks = [run(sched).num_new_tokens for _ in range(5)]
    assert chunks == [[10], [10], [5], [1], [1]]
    assert s.num_output_tokens == 3


def test_running_sequences_are_served_before_new_ones_join():
    sched = make(budget=4)
    a = seq("a", 4)
    sched.add(a)
    run(sched)  # a's whole prompt
    sched.add(seq("b", 8))
    batch = run(sched)
    assert names(batch.seqs) == ["a", "b"] and batch.num_new_tokens == [1, 3]


def test_a_prompt_without_free_blocks_waits_and_a_smaller_one_does_not_jump_it():
    sched = make(num_blocks=4, block_size=4)
    sched.add(seq("holder", 8))  # 2 blocks, 3 once it has an output token
    run(sched)
    sched.add(seq("big", 8))  # needs 2 blocks, 1 is free
    sched.add(seq("small", 2))  # would fit, but fcfs keeps arrival order
    batch = run(sched)
    assert names(batch.seqs) == ["holder"] and not batch.admitted
    assert names(sched.waiting) == ["big", "small"]


def test_the_newest_running_sequence_is_preempted_first_and_comes_back_first():
    sched = make(num_blocks=4, block_size=4)
    a, b, c = seq("a", 4, 100), seq("b", 4, 200), seq("c", 4, 300)
    for s in (a, b, c):
        sched.add(s)
    assert names(run(sched).admitted) == ["a", "b", "c"]  # one block each, one left
    sched.add(seq("d", 2, 400))
    batch = run(sched)  # each needs a second block for its output token: only one is free
    assert names(batch.preempted) == ["c"]
    assert names(batch.seqs) == ["a", "b"] and not batch.admitted  # nobody joins while the cache is full
    assert c.state is SequenceState.WAITING and c.block_table == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.preemptions_total == 1
    assert names(sched.waiting) == ["c", "d"]  # the preempted sequence is first in line again
    assert batch.peak_held_blocks == 4
    sched.finish(a)
    a.state = SequenceState.FINISHED
    back = run(sched)
    assert names(back.admitted)[0] == "c"
    assert back.num_new_tokens[-len(back.admitted) :][0] == 5  # recomputed: its prompt and its output token


def test_preemption_takes_the_sequence_itself_when_it_is_the_newest():
    sched = make(num_blocks=2, block_size=4)
    a, b = seq("a", 4, 100), seq("b", 4, 200)
    sched.add(a)
    sched.add(b)
    run(sched)
    batch = run(sched)  # a takes the last block; b has none left and is the newest: it steps aside
    assert names(batch.seqs) == ["a"] and names(batch.preempted) == ["b"]
    assert sched.bm.num_free == 0 and b.block_table == []


def test_postprocess_appends_checks_stop_and_frees_what_stopped():
    """After a step the scheduler finishes what it scheduled: KV committed, each sampled sequence
    its token, one that stopped ended with its reason and its blocks back; one aborted while the
    model ran gets nothing."""
    sched = make(num_blocks=8)
    a, b, c = seq("a", 4), seq("b", 4), seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    free_before = sched.bm.num_free
    sched.end(c, "abort", "aborted")  # while the model ran
    stops = {11: ("stop", "eos")}
    got = sched.postprocess(batch, [a, b, c], [10, 11, 12], [-0.5, -0.25, -0.125], lambda s, t: stops.get(t))
    assert got == [a, b]
    assert a.num_computed_tokens == 4 and a.output_token_ids == [10] and a.output_logprobs == [-0.5]
    assert a.state is SequenceState.RUNNING and names(sched.running) == ["a"]
    assert b.state is SequenceState.FINISHED and (b.finish_reason, b.finish_detail) == ("stop", "eos")
    assert (
        b.block_table == [] and c.output_token_ids == [] and (c.finish_reason, c.finish_detail) == ("abort", "aborted")
    )
    assert sched.bm.num_free == free_before + 2  # b's block, then c's
