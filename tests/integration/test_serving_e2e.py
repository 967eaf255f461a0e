"""End to end over real gRPC on loopback: client -> router -> mixed worker -> client.

Each module-scoped cluster is real processes (``cluster.local.LocalCluster``, the code
behind ``pdserve up``); every test ends by checking through ``GetStatus`` that no KV
block is held and no request is left running on any worker.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest
from cluster_helpers import ExtraRouter, assert_cluster_idle, start
from conftest import hf_greedy
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pdserve.v1 import api_pb2, api_pb2_grpc
from router.client import AsyncClient, Client, build_request
from workers.engine.llm import LLM
from workers.engine.params import SamplingParams

GREEDY = {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True}


def test_greedy_through_router_equals_offline_engine_and_hf(cluster, tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    prompts = ["Hello there", "The quick brown fox", "def main():\n"]
    with Client(cluster.target) as client:
        served = [client.generate(p, **GREEDY) for p in prompts]
    llm = LLM(path, dtype="float32", num_blocks=64)
    offline = llm.generate(prompts, SamplingParams(**GREEDY))
    ids = [s.prompt_token_ids for s in served]
    assert ids == [o.prompt_token_ids for o in offline]
    assert [s.token_ids for s in served] == [o.token_ids for o in offline]
    assert [s.token_ids for s in served] == hf_greedy(path, ids, 16)
    assert all(s.finish_reason == "length" and s.usage["completion_tokens"] == 16
               for s in served)
    assert_cluster_idle(cluster)


def test_streamed_text_equals_the_whole_text_and_usage_is_reported(cluster) -> None:
    with Client(cluster.target) as client:
        pieces = [m.text for m in client.stream("Once upon a time", **GREEDY)]
        whole = client.generate("Once upon a time", **GREEDY)
        again = client.generate("Once upon a time", **GREEDY)
    assert "".join(pieces) == whole.text
    assert whole.usage["prompt_tokens"] == len(whole.prompt_token_ids)
    assert 0 < whole.ttft_s <= whole.e2e_s
    # The same prompt again: its full blocks come from the prefix cache.
    assert again.usage["cached_tokens"] == (len(again.prompt_token_ids) // 16) * 16
    assert again.token_ids == whole.token_ids
    assert_cluster_idle(cluster)


def test_chat_messages_and_token_ids_are_accepted(cluster) -> None:
    with Client(cluster.target) as client:
        chat = client.generate([{"role": "user", "content": "hi"}], **GREEDY)
        ids = client.generate(chat.prompt_token_ids, **GREEDY)
    assert chat.token_ids == ids.token_ids
    assert_cluster_idle(cluster)


def test_sixteen_concurrent_streams_all_complete(cluster) -> None:
    async def run() -> list:
        async with AsyncClient(cluster.target) as client:
            return await asyncio.gather(*[
                client.generate(f"request {i} says", max_tokens=24, temperature=0.8, seed=i,
                                ignore_eos=True) for i in range(16)])

    outs = asyncio.run(run())
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    assert_cluster_idle(cluster)


def test_cancelled_stream_frees_its_blocks_at_once(cluster) -> None:
    async def run() -> int:
        async with AsyncClient(cluster.target) as client:
            got = 0
            async for msg in client.stream("cancel me", max_tokens=400, ignore_eos=True):
                got += len(msg.token_ids)
                if got >= 2:
                    break  # closing the stream cancels the call
            return got

    assert asyncio.run(run()) >= 2
    assert_cluster_idle(cluster, timeout=5)


def test_deadline_expiry_is_reported_and_frees_blocks(cluster) -> None:
    with Client(cluster.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate("x " * 200, timeout=0.05, max_tokens=300, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_cluster_idle(cluster)


@pytest.mark.parametrize(
    ("request_kw", "code", "text"),
    [
        ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt: must contain at least 1"),
        ({"prompt": "word " * 600}, grpc.StatusCode.INVALID_ARGUMENT, "max_model_len 512"),
        ({"prompt": [10**6]}, grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        ({"prompt": "hi", "model": "gpt-4"}, grpc.StatusCode.NOT_FOUND, "not served here"),
        ({"prompt": [{"role": "wizard", "content": "x"}]}, grpc.StatusCode.INVALID_ARGUMENT,
         "unknown role"),
    ],
)
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(cluster, request_kw, code,
                                                                    text) -> None:
    with Client(cluster.target) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(**request_kw, max_tokens=4)
        assert err.value.code() == code and text in err.value.details()
        assert len(client.generate("still serving", max_tokens=3).token_ids) == 3
    assert_cluster_idle(cluster)


def test_bad_sampling_values_are_invalid_argument_from_the_server(cluster) -> None:
    # Bypass the client's own validation to check the server's.
    with grpc.insecure_channel(cluster.target) as channel:
        stub = api_pb2_grpc.PDServeStub(channel)
        for field, value, limit in [("temperature", -1.0, ">= 0"), ("top_p", 1.5, "(0, 1]"),
                                    ("max_tokens", 0, ">= 1")]:
            req = build_request("hi")
            setattr(req.sampling, field, value)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{field}:") and limit in err.value.details()


def test_oversized_request_is_refused(cluster) -> None:
    with grpc.insecure_channel(cluster.target) as channel:
        stub = api_pb2_grpc.PDServeStub(channel)
        req = api_pb2.GenerateRequest(text="a" * (50 * 2**20))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with Client(cluster.target) as client:
        assert client.generate("fine", max_tokens=2).token_ids


def test_health_reflection_and_model_listing(cluster) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(cluster.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        [resp] = list(refl.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert "pdserve.v1.PDServe" in names and "grpc.health.v1.Health" in names
    with Client(cluster.target) as client:
        assert client.list_models() == ["llama"]


def test_overload_is_resource_exhausted_never_a_hang(cluster) -> None:
    """A router of its own with room for 2 requests, on the shared cluster's worker."""
    with ExtraRouter(cluster, "router-overload", max_in_flight=2) as router:
        async def run() -> grpc.StatusCode:
            async with AsyncClient(router.target) as client:
                streams = [client.stream("slow", max_tokens=400, ignore_eos=True)
                           for _ in range(2)]
                for s in streams:
                    await s.__anext__()  # both admitted and running
                try:
                    await asyncio.wait_for(client.generate("third", max_tokens=2), timeout=10)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    return e.code()
                finally:
                    for s in streams:
                        await s.aclose()

        assert asyncio.run(run()) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert_cluster_idle(SimpleNamespace(target=router.target))  # its admissions too
    assert_cluster_idle(cluster)


def test_a_worker_that_cannot_start_is_named_with_its_log(tmp_path) -> None:
    """A CI run keeps no files: the start-up error quotes the failing process's log."""
    with pytest.raises(RuntimeError) as info:
        start(tmp_path / "no-such-model", tmp_path, prefill=1, decode=1)
    text = str(info.value)
    assert " while starting; see " in text and ".log:" in text
    assert "no-such-model' does not exist" in text  # the worker's own words, quoted
