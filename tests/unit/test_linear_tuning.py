"""The GEMM choice measured at load (:func:`workers.models.linear.tuned_linear`): the pure
rule that turns timings into a choice per row count (:func:`plain_rows`), and the timed
choice itself on real ops, one of them made slow where it must lose by far more than
timing noise."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from workers.models.decoder import ModelShape
from workers.models.linear import (
    TORCH_LINEAR,
    LinearOps,
    gemv_linear,
    gemv_rows_from,
    onednn_linear,
    plain_rows,
    time_gemv_rows,
    tuned_linear,
)

ROWS = (1, 8, 32, 256)


@pytest.mark.parametrize(
    ("plain", "packed", "use"),
    [
        ([1, 1, 1, 1], [1, 1, 1, 1], [False] * 4),  # a tie keeps the packed op
        ([0.95, 0.85, 1, 1], [1, 1, 1, 1], [False, True, False, False]),  # margin 10%
        ([1, 3, 1, 3], [2, 2, 2, 2], [True, False, True, False]),
    ],
)
def test_plain_rows(plain, packed, use):
    assert plain_rows(plain, packed) == use


def test_plain_rows_needs_one_timing_per_row_count():
    with pytest.raises(ValueError):
        plain_rows([1, 1, 1], [1, 1, 1, 1])


SLOW_S = 0.03


def slow_when(slow, name: str, base: LinearOps = TORCH_LINEAR) -> LinearOps:
    """``base``, :data:`SLOW_S` slower per call where ``slow(rows)`` (tiny shapes take
    microseconds; a busy machine's preemptions take a few milliseconds)."""

    def apply(x, w, bias):
        if slow(x.shape[0]):
            time.sleep(SLOW_S)
        return base.apply(x, w, bias)

    return LinearOps(name, base.prepare, apply)


def slow_below(rows: int) -> LinearOps:
    return slow_when(lambda m: m <= rows, f"slow<={rows}")


SHAPES = [(16, 24), (24, 16)]


def test_tuned_linear_keeps_a_packed_op_when_plain_is_slow_everywhere():
    packed = LinearOps("packed", lambda w: w.contiguous(), F.linear)
    chosen, measured = tuned_linear(packed, SHAPES, torch.float32, rows=ROWS,
                                    plain=slow_below(10**6))
    assert chosen is packed
    assert [m for m, _, _ in measured] == list(ROWS)
    assert all(p > 10 * q for _, p, q in measured)


def test_tuned_linear_drops_a_packed_op_slow_everywhere():
    chosen, measured = tuned_linear(slow_below(10**6), SHAPES, torch.float32, rows=ROWS)
    assert chosen is TORCH_LINEAR
    assert all(q > 10 * p for _, p, q in measured)


def test_tuned_linear_runs_each_op_where_it_was_faster():
    # plain slow at 1 and 256 rows, packed slow at 8 and 32: each call of m rows runs
    # the op chosen at the least measured row count >= m
    packed = slow_when(lambda m: 2 <= m <= 32, "packed")
    plain = slow_when(lambda m: m < 2 or m > 32, "torch")
    chosen, _ = tuned_linear(packed, SHAPES, torch.float32, rows=ROWS, plain=plain)
    assert chosen.name == "by rows (1: packed, 8: torch, 32: torch, 256: packed)"
    w = torch.randn(24, 16)
    prepared = chosen.prepare(w)
    for m in (1, 2, 8, 32, 33, 300):  # every span gives F.linear's product, none sleeps
        x = torch.randn(m, 16)
        t = time.perf_counter()
        out = chosen.apply(x, prepared, None)
        assert time.perf_counter() - t < SLOW_S / 2, m
        torch.testing.assert_close(out, F.linear(x, w))


def test_tuned_linear_on_onednn_gives_the_same_product():
    packed = onednn_linear(torch.float32)
    if packed is None:
        pytest.skip("this torch has no oneDNN CPU backend")
    shape = ModelShape(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=96, vocab_size=10, rms_eps=1e-6)
    assert shape.layer_gemms() == [(64, 128), (64, 64), (64, 192), (96, 64)]
    chosen, measured = tuned_linear(packed, shape.layer_gemms(), torch.float32, rows=ROWS)
    assert len(measured) == len(ROWS)
    for k, n in shape.layer_gemms():
        w = torch.randn(n, k)
        prepared = chosen.prepare(w)
        for m in (1, 8, 40):
            x = torch.randn(m, k)
            torch.testing.assert_close(chosen.apply(x, prepared, None), F.linear(x, w),
                                       rtol=1e-4, atol=1e-4)


def test_tuned_linear_without_room_for_both_keeps_the_least_total():
    # packed slower by 2 ms at 8 and 32 rows, plain at 1 row: without memory for both
    # layouts, plain (the least summed time) for every size; with it, each where it won
    rows = (1, 8, 32)
    packed = slow_when(lambda m: 2 <= m <= 32, "packed")
    plain = slow_when(lambda m: m < 2, "torch")
    chosen, _ = tuned_linear(packed, SHAPES, torch.float32, rows=rows, plain=plain,
                             keep_both=False)
    assert chosen is plain
    chosen, _ = tuned_linear(packed, SHAPES, torch.float32, rows=rows, plain=plain)
    assert chosen.name == "by rows (1: packed, 8: torch, 32: torch)"


def test_room_for_a_copy_weighs_the_weights_against_available_memory():
    from workers.engine.model_runner import _room_for_a_copy

    small = torch.nn.Linear(10, 10)  # 440 bytes
    assert _room_for_a_copy(small)
    assert not _room_for_a_copy(small, share=0.0)


def _timings(table: dict[int, list[tuple[float, float]]]):
    """A ``timed(rows)`` that answers each row count's timings in turn (the last again)."""
    calls: dict[int, int] = {}

    def timed(m: int) -> tuple[float, float]:
        i = calls[m] = calls.get(m, -1) + 1
        return table[m][min(i, len(table[m]) - 1)]
    return timed, calls


def test_the_gemv_keeps_the_rows_where_it_beats_the_batched_op():
    """Zen 4 bf16 (measured, one thread): GEMV / oneDNN 0.55, 0.57, 1.02, 1.31x at 1-4 rows."""
    timed, calls = _timings({1: [(8.2, 14.8)], 2: [(10.3, 17.9)], 3: [(13.8, 13.6)],
                             4: [(17.8, 13.6)]})
    got = gemv_rows_from(timed, (1, 2, 3, 4))
    assert got.rows == 2 and got.probed == (1, 2, 3)  # the first loss, confirmed, ends it
    assert calls == {1: 0, 2: 0, 3: 1}  # a loss is timed twice, a win once
    assert got.gemv_s == (8.2, 10.3, 13.8) and got.batched_s == (14.8, 17.9, 13.6)


def test_one_slow_pass_does_not_cut_the_gemv_short():
    timed, _ = _timings({1: [(1.0, 2.0)], 2: [(3.0, 2.0), (1.5, 2.0)], 3: [(2.5, 2.0)]})
    got = gemv_rows_from(timed, (1, 2, 3))
    assert got.rows == 2 and got.gemv_s[1] == 1.5  # the least of the two passes kept


def test_a_gemv_that_loses_at_one_row_is_never_used():
    timed, _ = _timings({1: [(3.0, 2.0)], 2: [(1.0, 2.0)]})
    assert gemv_rows_from(timed, (1, 2)).rows == 0
    assert gemv_rows_from(_timings({1: [(1.0, 2.0)], 2: [(1.0, 2.0)]})[0], (1, 2)).rows == 2


def test_no_gemv_rows_leaves_the_batched_op_alone():
    assert gemv_linear(lambda x, w, b: x, TORCH_LINEAR, max_rows=0) is TORCH_LINEAR


def test_the_gemv_rows_are_timed_on_real_ops_made_slow():
    """The timed probe on real ops, slowed where each must lose by far more than noise:
    the batched op by 20 ms a call, the GEMV by 80 ms a call past 2 rows (a busy machine
    would have to stall the GEMV by 20 ms in each of 3 passes, twice, to move it)."""
    def slow(ms: float, past: int):
        def apply(x, w, bias):
            if x.numel() // x.shape[-1] > past:
                time.sleep(ms / 1e3)
            return F.linear(x, w, bias)
        return apply

    gemv = LinearOps("gemv", lambda w: w.contiguous(), slow(80, 2))
    batched = LinearOps("batched", lambda w: w.contiguous(), slow(20, 0))
    got = time_gemv_rows(gemv, batched, [(64, 32)], torch.float32, layers=1,
                         probe=(1, 2, 3, 4), reps=3)
    assert got.rows == 2 and got.probed == (1, 2, 3)
