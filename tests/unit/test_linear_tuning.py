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
    onednn_linear,
    plain_rows,
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


def slow_when(slow, name: str, base: LinearOps = TORCH_LINEAR) -> LinearOps:
    """``base``, 2 ms slower per call where ``slow(rows)`` (tiny shapes take microseconds)."""

    def apply(x, w, bias):
        if slow(x.shape[0]):
            time.sleep(0.002)
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
        assert time.perf_counter() - t < 0.002, m
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
