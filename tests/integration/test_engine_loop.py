"""The engine thread behind the servers: ids, aborts and delivery."""

from __future__ import annotations

import asyncio

from conftest import assert_no_leaks

from common.request import Request
from workers.engine.llm_engine import LLMEngine
from workers.engine.params import EngineConfig, SamplingParams
from workers.engine_loop import EngineLoop


def test_closing_a_finished_stream_never_aborts_a_newer_request_with_its_id(
    tiny_checkpoints,
) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), num_blocks=64))
    loop = EngineLoop(engine)
    ids = engine.tokenize("same id twice")

    async def run() -> int:
        first = loop.generate(Request("dup", ids, SamplingParams(max_tokens=2, ignore_eos=True)))
        async for out in first:
            if out.finished:
                break  # the stream is not closed yet
        second = loop.generate(Request("dup", ids, SamplingParams(max_tokens=6, ignore_eos=True)))
        got = [await second.__anext__()]
        await first.aclose()  # must not reach the second request
        got += [o async for o in second]
        return len(got[-1].token_ids)

    try:
        assert asyncio.run(asyncio.wait_for(run(), timeout=30)) == 6
        assert_no_leaks(engine)
    finally:
        loop.close()


def test_cancelled_consumer_frees_blocks(tiny_checkpoints) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoints["llama"]), num_blocks=64))
    loop = EngineLoop(engine)

    async def run() -> None:
        stream = loop.generate(Request("c", engine.tokenize("go"),
                                       SamplingParams(max_tokens=300, ignore_eos=True)))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if loop.load().free_blocks == loop.load().total_blocks and not loop.load().running:
                return
            await asyncio.sleep(0.01)

    try:
        asyncio.run(run())
        assert_no_leaks(engine)
    finally:
        loop.close()
