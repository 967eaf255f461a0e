"""Shared fixtures: tiny random checkpoints of every architecture, the default model,
a Hugging Face reference, and the leak check every KV-moving test ends with."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> checkpoint directory (plus "tokenizer"), built once per session."""
    return tiny_models.build_all(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["avx512", "avx2", "scalar"])
def paged_attention_op(request: pytest.FixtureRequest):  # noqa: ANN201 - a partial of the op
    """The native paged decode-attention op on one of its code paths (each path this
    build compiled: an AVX-512 build has all three, an AVX2 one two)."""
    import functools

    import torch

    from workers.engine import kernels

    cache = os.environ.get("PDSERVE_TEST_CACHE_DIR")
    if kernels.load(Path(cache) / "kernels" if cache else None) is None:
        pytest.skip(f"paged decode kernel unavailable: {kernels.unavailable_reason()}")
    op = functools.partial(kernels.paged_decode_attention, isa=request.param)
    one = torch.zeros(1, 1, 8)
    try:
        op(one, one.view(1, 1, 1, 8), one.view(1, 1, 1, 8), torch.zeros(1, 1, dtype=torch.int32),
           torch.ones(1, dtype=torch.int32))
    except RuntimeError as e:
        if "not compiled" not in str(e):
            raise
        pytest.skip(f"{request.param}: {e}")
    return op


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real default model, converted once into the shared cache."""
    from workers.model_store import resolve_model

    cache = os.environ.get("PDSERVE_TEST_CACHE_DIR")
    return resolve_model(None, Path(cache) if cache else None)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              dtype: str = "float32", stop_at_eos: bool = False) -> list[list[int]]:
    """Reference: transformers ``generate``, one prompt at a time.

    With ``stop_at_eos=False`` EOS is never produced (``min_new_tokens`` masks it), which
    equals our ``ignore_eos`` only while EOS is never the argmax: true for the tiny
    models, whose EOS row is damped. Real models compare with ``stop_at_eos=True``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            g = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=max_new_tokens,
                               min_new_tokens=0 if stop_at_eos else max_new_tokens,
                               pad_token_id=0)
            out.append(g[0, len(ids):].tolist())
    return out


def assert_no_leaks(engine) -> None:  # noqa: ANN001 - LLMEngine, imported lazily
    """Every request is gone and every KV block is back in the free pool."""
    sched = engine.scheduler
    bm = sched.block_manager
    assert not engine.has_unfinished_requests()
    assert sched.num_unfinished == 0 and not sched.running and not sched.waiting
    assert not sched.reserved and not sched.held
    assert bm.num_free_blocks == bm.num_blocks, (
        f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    )
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.fixture(scope="session")
def cluster(tiny_checkpoints, tmp_path_factory):
    """A real local cluster (router + one mixed worker) on the tiny llama, shared."""
    from cluster_helpers import start

    c = start(tiny_checkpoints["llama"], tmp_path_factory.mktemp("cluster-logs"))
    yield c
    c.stop()


def kv_test_config():  # noqa: ANN201 - TransferConfig, imported lazily
    """The KV channel's timeouts for in-process engine tests: short enough to fail a
    hung test, long enough for a loaded 2-core box."""
    from workers.transfer import TransferConfig

    return TransferConfig(connect_timeout_s=20.0, offer_timeout_s=10.0, data_timeout_s=10.0)


@pytest.fixture(scope="module")
def channel():
    """A KV channel in this process, (sender, receiver), one per test module: the
    engines' disaggregation hooks over real gloo threads (tests/integration)."""
    from workers.transfer import KVReceiver, KVSender

    receiver = KVReceiver("decode-test", kv_test_config())
    sender = KVSender("prefill-test", kv_test_config())
    yield sender, receiver
    sender.close()
    receiver.close()


async def on_engine(loop, fn, timeout: float):  # noqa: ANN001, ANN201 - EngineLoop, any
    """``fn()`` on the engine loop's thread, after every command posted before this call;
    its result (or exception) comes back to the awaiting test."""
    import asyncio

    aloop = asyncio.get_running_loop()
    fut: asyncio.Future = aloop.create_future()

    def call() -> None:
        try:
            aloop.call_soon_threadsafe(fut.set_result, fn())
        except Exception as e:  # noqa: BLE001 - back to the test
            aloop.call_soon_threadsafe(fut.set_exception, e)

    loop.call_soon(call)
    return await asyncio.wait_for(fut, timeout)


async def engine_idle(loop, timeout: float) -> None:  # noqa: ANN001 - EngineLoop
    """Wait (bounded) until the loop publishes nothing queued, running or reserved and
    every block free; ``assert_no_leaks`` then reads the engine while its thread waits,
    and reports a leak itself."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = loop.load()
        if (load.running == load.waiting == load.reserved == 0
                and load.free_blocks == load.total_blocks):
            return
        await asyncio.sleep(0.01)
