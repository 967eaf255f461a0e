"""The KV block size when none is asked for: each device kind's default, filled in when a
config is built, so every reader (scheduler, registry, profile, transfer layout) sees the
size the engine runs with."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.profile import ProfileOptions
from cluster.deployment import DeploymentConfig
from workers.engine.params import DEFAULT_BLOCK_SIZES, EngineConfig, default_block_size


def test_cpu_takes_64_and_cuda_16() -> None:
    assert DEFAULT_BLOCK_SIZES == {"cpu": 64, "cuda": 16}
    assert EngineConfig(model="m").block_size == 64
    assert EngineConfig(model="m", device="cuda").block_size == 16
    assert EngineConfig(model="m", device="cuda:1").block_size == 16
    assert default_block_size() == default_block_size("cpu") == 64


@pytest.mark.parametrize("asked", [1, 16, 128, 256])
def test_a_size_asked_for_is_kept_on_every_device(asked: int) -> None:
    for device in ("cpu", "cuda"):
        assert EngineConfig(model="m", block_size=asked, device=device).block_size == asked


def test_the_filled_in_size_survives_a_replace_and_a_negative_one_is_refused() -> None:
    cfg = EngineConfig(model="m")
    assert dataclasses.replace(cfg, dtype="float32").block_size == 64
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        EngineConfig(model="m", block_size=-16)


def test_pdserve_up_and_the_profile_ask_for_the_default_and_say_so() -> None:
    field = next(f for f in dataclasses.fields(DeploymentConfig) if f.name == "block_size")
    assert DeploymentConfig().block_size == 0  # each worker resolves it on its device
    assert "64 on CPU" in str(field.metadata["help"])
    # The profile records the size it measured with, never 0.
    assert ProfileOptions(model="m", threads=(1,)).block_size == 64
    assert ProfileOptions(model="m", threads=(1,), block_size=32).block_size == 32
