"""Scheduler side doors for disaggregation: reserve/commit/recompute on the decode side,
hold/release on the prefill side. No torch; every test ends with every block free."""

from __future__ import annotations

from test_scheduler import BS, NO_EOS, assert_empty, make, run_all, step

from workers.engine.params import SamplingParams
from workers.engine.sequence import FinishReason, SequenceStatus

P = SamplingParams(max_tokens=4)


def test_reserve_holds_the_whole_prompt_outside_the_queues_and_commit_runs_it() -> None:
    s = make(num_blocks=16)
    seq = s.reserve("r", list(range(10)), P)
    assert seq is not None and seq.status is SequenceStatus.RESERVED
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0
    assert step(s).is_empty  # a reserved request is never scheduled
    assert s.block_manager.num_free_blocks == 13
    assert s.commit(seq, 500, NO_EOS) is None
    assert seq.status is SequenceStatus.RUNNING and seq.output_token_ids == [500]
    out = step(s)  # straight to decode: one token, the first one's KV
    assert [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [(10, 1, True)]
    run_all(s)
    assert seq.num_output_tokens == 4
    assert_empty(s)


def test_reserve_reuses_the_cached_prefix_and_commit_caches_the_rest() -> None:
    s = make(num_blocks=16)
    s.add("warm", list(range(9)), SamplingParams(max_tokens=1))
    run_all(s)
    seq = s.reserve("r", list(range(12)), P)
    assert seq is not None and seq.num_computed_tokens == 2 * BS  # 2 full blocks reused
    s.commit(seq, 7, NO_EOS)
    probe = s.reserve("probe", list(range(12)) + [7, 8], P)
    assert probe is not None and probe.num_computed_tokens == 3 * BS  # now 3 are cached
    s.abort("probe")
    s.finish(seq, FinishReason.ABORT)
    assert_empty(s)


def test_reserve_refuses_without_room_and_respects_max_seqs() -> None:
    s = make(num_blocks=4, max_seqs=2)
    assert s.reserve("big", list(range(20)), P) is None  # 5 blocks > 4
    assert s.num_unfinished == 0 and s.block_manager.num_free_blocks == 4
    a, b = s.reserve("a", [1, 2], P), s.reserve("b", [3, 4], P)
    assert a is not None and b is not None
    assert s.reserve("c", [5], P) is None  # max_num_seqs counts reservations
    s.abort("a")
    s.abort("b")
    assert_empty(s)


def test_recompute_after_a_failed_transfer_prefills_prompt_and_first_token() -> None:
    s = make(num_blocks=16)
    seq = s.reserve("r", list(range(6)), P)
    assert seq is not None
    assert s.recompute(seq, 900, NO_EOS) is None
    assert seq.status is SequenceStatus.WAITING and seq.token_ids[-1] == 900
    assert s.block_manager.num_free_blocks == 16  # the garbage blocks were freed
    out = step(s)
    assert [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [(0, 7, True)]
    run_all(s)
    assert seq.num_output_tokens == 4
    assert_empty(s)


def test_commit_with_a_final_first_token_finishes_and_frees() -> None:
    s = make(num_blocks=16)
    seq = s.reserve("r", [1, 2, 3], SamplingParams(max_tokens=1))
    assert seq is not None
    assert s.commit(seq, 5, NO_EOS) is FinishReason.LENGTH
    assert seq.is_finished
    assert_empty(s)


def test_hold_keeps_blocks_past_finish_until_release() -> None:
    s = make(num_blocks=16)
    seq = s.add("p", list(range(9)), SamplingParams(max_tokens=1))
    s.schedule()  # admitted
    s.hold(seq)
    s.finish(seq, FinishReason.REMOTE)
    assert seq.is_finished and s.held == {"p": seq}
    assert s.block_manager.num_free_blocks == 13
    again = s.add("p", [1], P)  # the id may be reused meanwhile: release is by object
    s.release(seq)
    s.release(seq)  # idempotent
    assert not s.held
    s.abort(again.seq_id)
    assert_empty(s)


def test_release_before_finish_cancels_the_hold() -> None:
    s = make(num_blocks=16)
    seq = s.add("p", [1, 2, 3], P)
    s.hold(seq)
    s.release(seq)
    s.abort("p")
    assert not s.held
    assert_empty(s)
