"""``dtype="auto"`` is resolved where the engine is built: the model, the KV cache and the
block-hash root all use the concrete dtype, and the engine says what it picked."""

from __future__ import annotations

import logging

import torch

from workers.engine.dtype_choice import resolve_dtype
from workers.engine.llm_engine import LLMEngine, model_identity
from workers.engine.params import EngineConfig


def test_auto_engine_runs_and_hashes_in_the_dtype_this_machine_picks(tiny_checkpoints,
                                                                     caplog) -> None:
    path = tiny_checkpoints["llama"]
    expected, reason = resolve_dtype("auto", "cpu")
    with caplog.at_level(logging.INFO, logger="workers.engine.llm_engine"):
        engine = LLMEngine(EngineConfig(model=str(path), num_blocks=16, block_size=4))
    assert engine.dtype == engine.config.dtype == expected
    assert engine.runner.dtype == getattr(torch, expected)
    assert engine.model_id == model_identity(path, expected) == engine.capacity().model_id
    assert f"dtype auto -> {expected} ({reason})" in caplog.messages


def test_explicit_dtype_is_kept_and_logged_as_asked(tiny_checkpoints, caplog) -> None:
    path = tiny_checkpoints["llama"]
    with caplog.at_level(logging.INFO, logger="workers.engine.llm_engine"):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_blocks=16,
                                        block_size=4))
    assert engine.dtype == "float32" and engine.model_id.endswith(":float32")
    assert "dtype float32 (as asked)" in caplog.messages
