"""Scheduler: token budget, chunked prefill, FCFS admission, preemption. No torch.

A fake "model" samples token 1000 + step for every sampling chunk, so the tests drive
the scheduler exactly as the engine does, without tensors.
"""

from __future__ import annotations

from workers.engine.params import SamplingParams, SchedulerConfig
from workers.engine.scheduler import Scheduler, SchedulerOutput
from workers.engine.sequence import SequenceStatus

BS = 4
NO_EOS: frozenset[int] = frozenset()


def make(num_blocks: int = 64, budget: int = 32, max_seqs: int = 8, **kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS,
                                     max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                     max_model_len=min(256, num_blocks * BS), model_id="m", **kw))  # type: ignore[arg-type]


def step(s: Scheduler, n: int = 0) -> SchedulerOutput:
    out = s.schedule()
    sampled = {c.seq.seq_id: 1000 + n for c in out.chunks if c.samples}
    s.update(out, sampled, NO_EOS)
    return out


def run_all(s: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while s.num_unfinished:
        step(s, steps)
        steps += 1
        assert steps < limit, "scheduler made no progress"
    return steps


def assert_empty(s: Scheduler) -> None:
    bm = s.block_manager
    assert not s.running and not s.waiting and s.num_unfinished == 0
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_budget_is_respected_and_prefill_is_chunked() -> None:
    s = make(budget=10)
    s.add("a", list(range(25)), SamplingParams(max_tokens=2))
    chunks = [step(s, i).chunks for i in range(3)]
    assert [(c[0].start, c[0].num_tokens) for c in chunks] == [(0, 10), (10, 10), (20, 5)]
    assert not chunks[0][0].samples and chunks[2][0].samples
    assert s.get("a").output_token_ids == [1002]
    run_all(s)
    assert_empty(s)


def test_decodes_are_scheduled_before_prefill_chunks() -> None:
    s = make(budget=8)
    s.add("a", [1, 2, 3], SamplingParams(max_tokens=5))
    step(s)  # a prefilled, now decoding
    s.add("b", list(range(20)), SamplingParams(max_tokens=1))
    out = step(s, 1)
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]
    run_all(s)
    assert_empty(s)


def test_admission_is_first_come_first_served() -> None:
    s = make(num_blocks=6, budget=64)
    s.add("big", list(range(20)), SamplingParams(max_tokens=1))  # 5 blocks + 1 to grow
    s.add("small", [1], SamplingParams(max_tokens=1))
    s.add("later", [2], SamplingParams(max_tokens=1))
    out = s.schedule()
    # big takes 5 of 6 blocks; small fits in the last one and later waits behind it.
    assert [c.seq.seq_id for c in out.chunks] == ["big", "small"]
    s.update(out, {"big": 7, "small": 7}, NO_EOS)
    run_all(s)
    assert_empty(s)


def test_head_of_line_blocks_later_requests() -> None:
    s = make(num_blocks=4, budget=64)
    s.add("a", list(range(8)), SamplingParams(max_tokens=20))  # grows to 7 blocks' worth
    step(s)
    s.add("huge", list(range(50, 62)), SamplingParams(max_tokens=1))  # needs 3, 1 free
    s.add("tiny", [5], SamplingParams(max_tokens=1))  # would fit, but must not overtake
    out = step(s, 1)
    assert [c.seq.seq_id for c in out.chunks] == ["a"]
    assert [q.seq_id for q in s.waiting] == ["huge", "tiny"]
    run_all(s)
    assert_empty(s)


def test_max_num_seqs_caps_the_running_batch() -> None:
    s = make(max_seqs=2)
    for i in range(4):
        s.add(str(i), [i + 1], SamplingParams(max_tokens=3))
    out = s.schedule()
    assert len(out.chunks) == 2
    s.update(out, {c.seq.seq_id: 9 for c in out.chunks}, NO_EOS)
    run_all(s)
    assert_empty(s)


def test_newest_request_is_preempted_and_recomputed_when_blocks_run_out() -> None:
    s = make(num_blocks=4, budget=64)
    s.add("old", [1, 2, 3], SamplingParams(max_tokens=8))
    s.add("new", [4, 5, 6], SamplingParams(max_tokens=8))
    step(s)  # both prefilled: one block each
    preempted = []
    for i in range(1, 40):
        out = step(s, i)
        preempted += [p.seq_id for p in out.preempted]
        if not s.num_unfinished:
            break
    assert preempted and set(preempted) == {"new"}
    assert_empty(s)


def test_preempted_request_resumes_with_its_generated_tokens() -> None:
    s = make(num_blocks=4, budget=64)
    s.add("old", [1, 2, 3], SamplingParams(max_tokens=8))
    new = s.add("new", [4, 5, 6], SamplingParams(max_tokens=8))
    produced: list[int] = []
    for i in range(60):
        out = step(s, i)
        if out.preempted:
            produced = list(new.output_token_ids)
            assert new.status is SequenceStatus.WAITING and new.block_table == []
            assert new.num_computed_tokens == 0
            break
    assert produced, "expected a preemption"
    run_all(s)
    assert new.output_token_ids[: len(produced)] == produced
    assert new.num_output_tokens == 8 and new.num_preemptions >= 1
    assert_empty(s)


def test_prefix_cache_hit_skips_computed_tokens() -> None:
    s = make(budget=64)
    s.add("a", list(range(10)), SamplingParams(max_tokens=1))
    run_all(s)
    b = s.add("b", list(range(8)) + [77, 78], SamplingParams(max_tokens=1))
    out = s.schedule()
    assert out.chunks[0].start == 8 and out.chunks[0].num_tokens == 2
    assert b.num_cached_tokens == 8
    s.update(out, {"b": 5}, NO_EOS)
    assert_empty(s)


def test_stop_conditions_finish_and_free() -> None:
    s = make()
    s.add("eos", [1, 2], SamplingParams(max_tokens=10))
    s.add("stop_id", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=(1000,)))
    s.add("ignore", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    out = s.schedule()
    finished = s.update(out, {"eos": 0, "stop_id": 1000, "ignore": 0}, frozenset({0}))
    assert {q.seq_id: q.finish_reason.value for q in finished} == {"eos": "stop",
                                                                   "stop_id": "stop"}
    run_all(s)
    assert_empty(s)


def test_eos_and_stop_token_ids_do_not_finish_before_min_tokens() -> None:
    s = make()
    q = s.add("a", [1, 2], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(7,)))
    for token in (0, 7):  # EOS, then a stop token id: outputs 1 and 2, not yet past 2
        assert not s.update(s.schedule(), {"a": token}, frozenset({0}))
    finished = s.update(s.schedule(), {"a": 7}, frozenset({0}))
    assert finished == [q] and q.finish_reason.value == "stop" and q.num_output_tokens == 3
    assert_empty(s)


def test_context_limit_finishes_with_length() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=BS, max_model_len=6, model_id="m"))
    q = s.add("a", [1, 2, 3, 4], SamplingParams(max_tokens=100))
    run_all(s)
    assert q.num_tokens == 6 and q.finish_reason.value == "length"
    assert_empty(s)


def test_abort_frees_blocks_in_any_state() -> None:
    s = make(budget=4)
    s.add("running", list(range(10)), SamplingParams(max_tokens=5))
    s.add("waiting", [1], SamplingParams(max_tokens=5))
    step(s)
    assert s.abort("running") and s.abort("waiting") and not s.abort("unknown")
    assert_empty(s)


def test_many_requests_with_tight_memory_all_finish() -> None:
    s = make(num_blocks=12, budget=16, max_seqs=6, watermark_blocks=1)
    for i in range(20):
        s.add(str(i), [i % 7 + 1] * (3 + i % 9), SamplingParams(max_tokens=4 + i % 5))
    run_all(s)
    assert_empty(s)


def test_the_budget_holds_with_chunked_prefills_decodes_and_preemptions() -> None:
    """Tight memory, a small budget, prompts longer than it (chunked over several steps
    while others decode) and preemptions: every step stays within the budget, schedules
    each sequence at most once, and never a sequence it preempted."""
    s = make(num_blocks=14, budget=12, max_seqs=8)
    for i in range(12):
        s.add(str(i), [i % 5 + 1] * (5 + 7 * (i % 4)), SamplingParams(max_tokens=3 + i % 4))
    steps = chunked = preempting = 0
    while s.num_unfinished:
        out = s.schedule()
        assert out.num_batched_tokens <= 12
        ids = [c.seq.seq_id for c in out.chunks]
        assert len(set(ids)) == len(ids)
        assert not {p.seq_id for p in out.preempted} & set(ids)
        chunked += any(not c.samples for c in out.chunks) and len(out.chunks) > 1
        preempting += bool(out.preempted)
        s.update(out, {c.seq.seq_id: 1000 + steps for c in out.chunks if c.samples}, NO_EOS)
        steps += 1
        assert steps < 1000, "scheduler made no progress"
    assert chunked and preempting  # the case exercised what it is about
    assert_empty(s)


def _forkable(s: Scheduler, prompt_len: int, max_tokens: int = 4) -> tuple:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    parent = s.add("p", list(range(prompt_len)), params)
    out = s.schedule()
    assert [c.samples for c in out.chunks] == [True]  # the whole prompt in one chunk
    kid = s.new_sequence("p/1", list(range(prompt_len)), params)
    return parent, kid, out


def test_fork_shares_full_prompt_blocks_and_copies_the_partial_one() -> None:
    s = make(num_blocks=16)
    parent, kid, out = _forkable(s, 10)  # 2 full blocks of 4, one partial
    reason, copy = s.fork(parent, kid, 7, NO_EOS)
    s.update(out, {"p": 6}, NO_EOS)
    assert reason is None and kid.status is SequenceStatus.RUNNING
    assert kid.block_table[:2] == parent.block_table[:2]
    assert copy == (parent.block_table[2], kid.block_table[2]) and copy[0] != copy[1]
    bm = s.block_manager
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    assert kid.num_computed_tokens == 10 and kid.output_token_ids == [7]
    assert bm.num_free_blocks == 16 - 4
    run_all(s)
    assert_empty(s)


def test_fork_of_a_block_aligned_prompt_copies_nothing() -> None:
    s = make(num_blocks=16)
    parent, kid, out = _forkable(s, 8)
    reason, copy = s.fork(parent, kid, 7, NO_EOS)
    assert reason is None and copy is None and kid.block_table == parent.block_table
    s.update(out, {"p": 6}, NO_EOS)
    run_all(s)
    assert_empty(s)


def test_fork_without_a_free_block_waits_to_be_recomputed() -> None:
    s = make(num_blocks=3)  # the parent's prompt takes all three
    parent, kid, out = _forkable(s, 10, max_tokens=2)
    reason, copy = s.fork(parent, kid, 7, NO_EOS)
    assert reason is None and copy is None
    assert kid.status is SequenceStatus.WAITING and not kid.block_table
    assert kid.token_ids[-1] == 7 and kid.num_computed_tokens == 0
    s.update(out, {"p": 6}, NO_EOS)
    run_all(s)
    assert_empty(s)


def test_fork_whose_first_token_ends_it_frees_what_it_took() -> None:
    s = make(num_blocks=16)
    parent, kid, out = _forkable(s, 10, max_tokens=1)
    reason, copy = s.fork(parent, kid, 7, NO_EOS)
    assert reason is not None and copy is None and kid.is_finished and not kid.block_table
    s.update(out, {"p": 6}, NO_EOS)
    assert_empty(s)


def test_prompts_share_the_stall_free_cap_only_while_a_request_decodes() -> None:
    """Alone, a prompt takes the whole budget; once another request decodes, every step
    computes at most the cap's prompt tokens (the running prompt's chunk and newly
    admitted ones together), and the decode still gets its token each step."""
    s = make(budget=32, prefill_tokens_while_decoding=6)
    s.add("long", list(range(40)), SamplingParams(max_tokens=3, ignore_eos=True))
    first = step(s).chunks
    assert [(c.seq.seq_id, c.num_tokens) for c in first] == [("long", 32)]  # no decode yet
    s.add("a", list(range(100, 104)), SamplingParams(max_tokens=12, ignore_eos=True))
    s.add("b", list(range(200, 205)), SamplingParams(max_tokens=2, ignore_eos=True))
    step(s)  # long's last 8 tokens (it then decodes) and the start of a
    for _ in range(200):
        if not s.num_unfinished:
            break
        out = s.schedule()
        decoding = [c for c in out.chunks if c.num_tokens == 1 and c.samples]
        prompts = sum(c.num_tokens for c in out.chunks if c not in decoding)
        if decoding:
            assert prompts <= 6
        s.update(out, {c.seq.seq_id: 7 for c in out.chunks if c.samples}, NO_EOS)
    assert_empty(s)  # all finished within the bound: no prompt starved


def test_the_cap_splits_a_prompt_it_would_have_computed_in_one_step() -> None:
    def chunks_of(cap: int) -> list[int]:
        s = make(budget=64, prefill_tokens_while_decoding=cap)
        s.add("d", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
        step(s)  # d decodes from now on
        s.add("p", list(range(30)), SamplingParams(max_tokens=1, ignore_eos=True))
        sizes: list[int] = []
        for _ in range(40):
            if s.get("p") is None or s.get("p").num_output_tokens:
                break
            out = step(s)
            sizes += [c.num_tokens for c in out.chunks if c.seq.seq_id == "p"]
        return sizes

    assert chunks_of(0) == [30]
    assert chunks_of(8) == [8, 8, 8, 6]


def test_the_cap_holds_through_preemptions() -> None:
    s = make(num_blocks=14, budget=12, max_seqs=8, prefill_tokens_while_decoding=5)
    for i in range(12):
        s.add(str(i), [i % 5 + 1] * (5 + 7 * (i % 4)), SamplingParams(max_tokens=3 + i % 4))
    steps = preempting = 0
    while s.num_unfinished:
        decoding_before = {q.seq_id for q in s.running
                           if q.num_tokens - q.num_computed_tokens == 1}
        out = s.schedule()
        prompts = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1 or not c.samples)
        if decoding_before:
            assert prompts <= 5
        assert out.num_batched_tokens <= 12
        preempting += bool(out.preempted)
        s.update(out, {c.seq.seq_id: 1000 + steps for c in out.chunks if c.samples}, NO_EOS)
        steps += 1
        assert steps < 1000, "scheduler made no progress"
    assert preempting
    assert_empty(s)
