"""The float decode GEMV's row limit as the model runner measures it at load
(``workers.models.linear.time_gemv_rows``, unpinned, on a tiny model): the rows its rule
keeps from the timings it made, and the layers running the GEMV's weights up to them and
the batched op's past them. The rule itself is unit-tested on fake timings
(``tests/unit/test_linear_tuning.py``)."""

from __future__ import annotations

import pytest
from test_gemv_layout import gemv_weights

from workers.engine import kernels
from workers.engine.llm import LLM
from workers.models.linear import GEMV_MARGIN, DualWeight


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gemv_row_limit_is_measured_at_load_and_honoured(tiny_checkpoints, dtype) -> None:
    if kernels.load() is None:
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    llm = LLM(tiny_checkpoints["llama"], dtype=dtype, num_blocks=64, block_size=4,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    g = runner.gemv_rows
    assert g is not None and g.probed and len(g.gemv_s) == len(g.batched_s) == len(g.probed)
    expected = 0  # the rule: every probed count up to it won (within the margin)
    for m, gemv_s, batched_s in zip(g.probed, g.gemv_s, g.batched_s, strict=True):
        if gemv_s >= GEMV_MARGIN * batched_s:
            break
        expected = m
    assert g.rows == expected and runner.gemv_handover_rows == expected, g
    model = runner.model
    if g.rows == 0:  # the GEMV lost at one row: the batched op alone, one layout
        assert not any(isinstance(w, DualWeight) for w in gemv_weights(llm))
        return
    lw = model.layers[0]
    for rows in (1, g.rows, g.rows + 1):
        kinds = {model._layer_native(w, rows)[1] for w in (lw.qkv, lw.o, lw.gate_up, lw.down)}
        assert all(k >= 0 for k in kinds) if rows <= g.rows else all(k < 0 for k in kinds), \
            (rows, kinds, g)
