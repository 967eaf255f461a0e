"""The decode GEMV's weight layout is the one the model runner measured at load, in every
dtype that runs it, and either layout gives Hugging Face's greedy tokens.

The measurement itself (``kernels.time_gemv_tiles``) is unit-tested on the real kernel in
``tests/unit/test_int8_linear.py``; here its verdict is pinned both ways (the function
replaced by one returning a fixed timing) so that both of the runner's branches run on
every machine, whichever layout this CPU would pick. Up to how many rows the GEMV runs is
pinned to the default too (:func:`fixed_gemv_rows`: on tiny models the timing is noise);
``test_gemv_rows.py`` tests that measurement.
"""

from __future__ import annotations

import pytest
from conftest import assert_no_leaks, hf_greedy
from test_engine_matches_hf import GREEDY, prompts_for

from workers.engine import kernels, model_runner
from workers.engine.llm import LLM
from workers.models.linear import GEMV_ROWS, DualWeight, GemvRowsTiming, Int8Weight


@pytest.fixture(scope="module", autouse=True)
def native() -> None:
    if kernels.load() is None:
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")


def fixed_gemv_rows(monkeypatch: pytest.MonkeyPatch, rows: int = GEMV_ROWS) -> None:
    """The model runner's GEMV row limit pinned to ``rows`` (a stand-in for
    ``workers.models.linear.time_gemv_rows``)."""
    monkeypatch.setattr(model_runner, "time_gemv_rows",
                        lambda *_, **__: GemvRowsTiming(rows, (), (), ()))


@pytest.fixture(autouse=True)
def pinned_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    fixed_gemv_rows(monkeypatch)


def fixed(tiles: bool):  # noqa: ANN201 - a stand-in for kernels.time_gemv_tiles
    def timing(shapes, dtype, layers, **_):  # noqa: ANN001, ANN202
        return kernels.TilesTiming(tiles, 2.0 if tiles else 1.0, 1.0 if tiles else 2.0, 1)
    return timing


def gemv_weights(llm: LLM) -> list:
    model = llm.engine.runner.model
    return [model.lm_head, *(w for lw in model.layers for w in vars(lw).values()
                             if isinstance(w, DualWeight | Int8Weight))]


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_gemv_takes_the_measured_layout(tiny_checkpoints, monkeypatch, dtype,
                                              tiles) -> None:
    monkeypatch.setattr(kernels, "time_gemv_tiles", fixed(tiles))
    path = tiny_checkpoints["llama"]
    llm = LLM(path, dtype=dtype, num_blocks=64, block_size=4)
    runner = llm.engine.runner
    assert runner.gemv_tiling is not None and runner.gemv_tiling.tiles == tiles
    weights = gemv_weights(llm)
    assert weights and all(isinstance(w, DualWeight) for w in weights)
    # Tiles where K is whole chunks (the tiny models have both kinds), else row-major.
    assert [isinstance(w.gemv, kernels.GemvTiles) for w in weights] == [
        tiles and w.shape[1] % kernels.PACK_CHUNK == 0 for w in weights]
    assert any(w.shape[1] % kernels.PACK_CHUNK == 0 for w in weights)
    prompts = prompts_for(llm)
    outs = llm.generate(prompts, GREEDY)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens, dtype=dtype)
    if dtype == "float32":
        assert [o.token_ids for o in outs] == ref
    else:  # bf16 rounds fused and unfused GEMMs differently: the first token must agree
        assert [o.token_ids[0] for o in outs] == [r[0] for r in ref]
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("tiles", [True, False])
def test_int8_weights_take_the_measured_layout(tiny_checkpoints, monkeypatch, tiles) -> None:
    monkeypatch.setattr(kernels, "time_gemv_tiles", fixed(tiles))
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=64, block_size=4,
              quantization="int8")
    assert llm.engine.runner.gemv_tiling.tiles == tiles
    weights = [w for w in gemv_weights(llm) if isinstance(w, Int8Weight)]
    assert weights and [w.tiled for w in weights] == [
        tiles and w.shape[1] % kernels.PACK_CHUNK == 0 for w in weights]
    outs = llm.generate(prompts_for(llm)[:2], GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert_no_leaks(llm.engine)


def test_no_gemv_when_turned_off(tiny_checkpoints, monkeypatch) -> None:
    def never(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("timed a GEMV layout the engine was told not to use")

    monkeypatch.setattr(kernels, "time_gemv_tiles", never)
    llm = LLM(tiny_checkpoints["llama"], dtype="float32", num_blocks=64, block_size=4,
              decode_gemv=False)
    assert llm.engine.runner.gemv_tiling is None
    assert not any(isinstance(w, DualWeight) for w in gemv_weights(llm))
