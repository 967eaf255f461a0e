"""The KV block size when none is asked for: each device kind's default, filled in when a
config is built, so every reader (scheduler, registry, profile, transfer layout) sees the
size the engine runs with."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.profile import ProfileOptions
from cluster.deployment import DeploymentConfig, DeploymentError
from router.dispatch import same_kv
from router.pool import Worker
from workers.engine.params import (
    DEFAULT_BLOCK_SIZES,
    EngineConfig,
    default_block_size,
    local_limit,
    resolve_block_size,
)


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
    with pytest.raises(DeploymentError, match="--block-size -1"):
        DeploymentConfig(block_size=-1)
    assert "64 on CPU" in str(field.metadata["help"])
    # The profile records the size it measured with, never 0.
    assert ProfileOptions(model="m", threads=(1,)).block_size == 64
    assert ProfileOptions(model="m", threads=(1,), block_size=32).block_size == 32


def test_a_cached_prompts_last_partial_block_is_computed_where_it_is_cached() -> None:
    # The decode worker's rule (workers/engine_reservations.py): uncached tokens from
    # which a reserved prompt goes to a prefill worker.
    assert local_limit(32, 0, 64) == 32  # nothing cached here: the threshold alone
    assert local_limit(32, 128, 64) == 64  # cached: what the last whole block leaves over
    assert local_limit(32, 128, 16) == 32  # small blocks: the threshold already covers it
    assert local_limit(0, 128, 64) == 0 and local_limit(None, 128, 64) == 0  # always remote


def test_kv_moves_only_between_workers_of_one_block_size() -> None:
    def worker(block_size: int, model_id: str = "m") -> Worker:
        return Worker("127.0.0.1:1", None, None, block_size=block_size, model_id=model_id)

    assert same_kv(worker(64), worker(64))
    assert not same_kv(worker(64), worker(16))  # a CPU and a GPU worker left to defaults
    assert not same_kv(worker(64, "a"), worker(64, "b"))
    assert same_kv(worker(64, ""), worker(64, "b"))  # an unknown model matches


def test_every_config_fills_in_a_zero_through_one_resolver() -> None:
    assert resolve_block_size(0) == 64 and resolve_block_size(0, "cuda:0") == 16
    assert resolve_block_size(32, "cuda") == 32
    with pytest.raises(ValueError, match="overhead_block_size must be >= 1"):
        resolve_block_size(-1, name="overhead_block_size")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        ProfileOptions(model="m", threads=(1,), block_size=-1)
