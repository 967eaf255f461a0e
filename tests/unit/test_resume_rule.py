"""Client-side resume (router/resume.py, router/client.py): a stream whose router dies
continues on another router, token for token.

The rule is checked on :class:`router.resume.Resume` alone with real protobuf messages
and real gRPC errors; the clients, sync and asyncio, run against two real
:class:`router.core.Router` objects behind the real gRPC servicer
(``router.server.grpc_server``) over the same fake worker (tests/fake_workers.py, whose
output depends only on the context length, so a resumed request continues exactly). A
router "dies" by its server stopping with every call open: the client sees what a killed
router process gives it, UNAVAILABLE (tests/integration/test_client_resume.py kills real
router processes). Each scenario ends with the fake cluster's leak check, on both routers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
import pytest
from fake_workers import MODEL, Cluster, FakeWorker, expected_tokens

from cluster.net import free_port
from common.sampling import StructuredOutput
from common.wire import sampling_from_proto
from protos.pdserve.v1 import api_pb2, common_pb2
from router.client import AsyncClient, Client, build_request
from router.core import Router, RouterConfig
from router.resume import RESUMABLE, Resume
from router.server import grpc_server

P = 10
PROMPT = list(range(10, 10 + P))
LENGTH = common_pb2.FINISH_REASON_LENGTH


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def message(tokens: list[int], prompt: list[int] | None = None, request_id: str = "req-1",
            finish: bool = False) -> api_pb2.GenerateResponse:
    """A router's stream message, as :class:`router.core._Relay` builds it."""
    msg = api_pb2.GenerateResponse(request_id=request_id, token_ids=tokens,
                                   text="".join(f"<{t}>" for t in tokens))
    msg.prompt_token_ids.extend(prompt or [])
    if finish:
        msg.finish_reason = LENGTH
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(prompt or []),
                                            completion_tokens=len(tokens), cached_tokens=12))
    return msg


# -- the rule, on Resume alone ---------------------------------------------------------------


def test_continued_request_is_the_prompt_plus_tokens_received_with_reduced_limits() -> None:
    structured = StructuredOutput("regex", "[a-z]+")
    original = build_request("some text", request_id="", cache_salt="salt", max_tokens=10,
                             min_tokens=4, seed=7, temperature=0.5, stop=["\n"],
                             structured=structured)
    resume = Resume(original, max_resumes=2)
    resume.relay(message([101, 102], prompt=[5, 6, 7], request_id="req-abc"))
    resume.relay(message([103]))
    assert resume.retry(error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    sent = resume.request
    assert sent.WhichOneof("prompt") == "token_ids"
    assert list(sent.token_ids.ids) == [5, 6, 7, 101, 102, 103]
    assert sent.request_id == "req-abc"  # the next router answers under the same id
    assert sent.cache_salt == "salt"
    params = sampling_from_proto(sent.sampling)
    before = sampling_from_proto(original.sampling)
    assert (params.max_tokens, params.min_tokens) == (7, 1)
    assert params.structured == StructuredOutput("regex", "[a-z]+", prior_tokens=3)
    assert (params.seed, params.temperature, params.stop) == (7, 0.5, ("\n",))
    assert params == dataclasses.replace(before, max_tokens=7, min_tokens=1,
                                         structured=params.structured)
    assert original.WhichOneof("prompt") == "text"  # the original is left as it was
    # min_tokens never goes below 0
    resume.relay(message([104, 105, 106, 107]))
    assert resume.retry(error(grpc.StatusCode.UNAVAILABLE))
    assert sampling_from_proto(resume.request.sampling).min_tokens == 0
    assert resume.resumes == 2


def test_a_failure_before_the_first_message_sends_the_original_request_again() -> None:
    original = build_request("some text", max_tokens=10)
    resume = Resume(original, max_resumes=1)
    assert resume.retry(error(grpc.StatusCode.UNAVAILABLE, "Connection refused"))
    assert resume.request is original
    # The next router's first message is the caller's first: its prompt ids stay.
    first = resume.relay(message([101], prompt=[5, 6, 7], request_id="req-new"))
    assert list(first.prompt_token_ids) == [5, 6, 7]
    last = resume.relay(message([102], request_id="req-new", finish=True))
    assert last.usage.completion_tokens == 1  # a request sent again whole is untouched


def test_resumed_stream_reads_as_one_stream_with_usage_over_the_whole_request() -> None:
    resume = Resume(build_request(PROMPT, max_tokens=5), max_resumes=1)
    seen = [resume.relay(message([101], prompt=PROMPT, request_id="req-a")),
            resume.relay(message([102], request_id="req-a"))]
    assert resume.retry(error(grpc.StatusCode.UNAVAILABLE))
    # The next router's messages: the longer prompt first, its usage counts its part.
    last = message([104, 105], request_id="req-a", finish=True)
    last.usage.prompt_tokens, last.usage.completion_tokens = P + 2, 3
    seen += [resume.relay(message([103], prompt=[*PROMPT, 101, 102], request_id="req-a")),
             resume.relay(last)]
    assert [list(m.prompt_token_ids) for m in seen] == [PROMPT, [], [], []]
    assert [t for m in seen for t in m.token_ids] == [101, 102, 103, 104, 105]
    usage = seen[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (P, 5, P)
    assert 0 < seen[-1].timings.ttft_s <= seen[-1].timings.e2e_s


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c != grpc.StatusCode.OK],
                         ids=lambda c: c.name)
def test_only_statuses_that_mean_the_router_is_gone_resume(code: grpc.StatusCode) -> None:
    resume = Resume(build_request(PROMPT, max_tokens=5), max_resumes=3)
    resume.relay(message([101], prompt=PROMPT))
    assert resume.retry(error(code)) == (code in RESUMABLE)
    assert RESUMABLE == {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                         grpc.StatusCode.UNKNOWN}


def test_no_resume_past_the_limit_the_deadline_or_the_last_token() -> None:
    gone = error(grpc.StatusCode.UNAVAILABLE)
    limited = Resume(build_request(PROMPT, max_tokens=5), max_resumes=1)
    assert limited.retry(gone) and not limited.retry(gone)
    assert limited.resumes == 1
    assert not Resume(build_request(PROMPT, max_tokens=5), max_resumes=0).retry(gone)
    late = Resume(build_request(PROMPT, max_tokens=5), max_resumes=3, timeout=0.0)
    assert late.time_left() == 0.0 and not late.retry(gone)
    done = Resume(build_request(PROMPT, max_tokens=2), max_resumes=3)
    done.relay(message([101, 102], prompt=PROMPT))  # every token came, the end did not
    assert not done.retry(gone)


def test_targets_and_max_resumes_are_checked() -> None:
    with pytest.raises(ValueError, match="target"):
        Client([])
    with pytest.raises(ValueError, match="max_resumes"):
        Client("127.0.0.1:1", max_resumes=-1)
    assert Client("127.0.0.1:1")._routers.max_resumes == 0  # one target: as before
    assert Client(["127.0.0.1:1", "127.0.0.1:2"])._routers.max_resumes == 3


# -- the clients against two real routers ----------------------------------------------------


@dataclass
class Routers:
    cluster: Cluster
    second: Router
    servers: list[grpc.aio.Server]
    targets: list[str]

    @property
    def worker(self) -> FakeWorker:
        return self.cluster.workers[0]


@contextlib.asynccontextmanager
async def two_routers(**config: object) -> AsyncIterator[Routers]:
    """Two routers on one fake mixed worker, each behind the real gRPC servicer; at the
    end both have nothing in flight and the worker no call open."""
    async with Cluster(["mixed"], **config) as c:
        second = Router(RouterConfig(workers=(c.workers[0].address,), model_path="unused",
                                     model_name=MODEL, connect_timeout_s=2.0),
                        tokenizer=c.tokenizer, connect=c.connect)
        await second.start()
        servers: list[grpc.aio.Server] = []
        targets: list[str] = []
        try:
            for router in (c.router, second):
                server, _ = grpc_server(router, None)
                targets.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
                await server.start()
                servers.append(server)
            yield Routers(c, second, servers, targets)
            assert second.in_flight == 0
        finally:
            for server in servers:
                await server.stop(None)
            await second.close()


def assert_one_stream(msgs: list[api_pb2.GenerateResponse], prompt: list[int],
                      n: int) -> None:
    """One uninterrupted stream of ``n`` tokens: prompt ids on the first message only,
    one request id, the finish and whole-request usage on the last."""
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == expected_tokens(len(prompt), n)
    assert "".join(m.text for m in msgs) == "".join(f"<{t}>" for t in tokens)
    assert list(msgs[0].prompt_token_ids) == prompt
    assert not any(m.prompt_token_ids for m in msgs[1:])
    assert len({m.request_id for m in msgs}) == 1
    assert not any(m.finish_reason for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), n)
    assert 0 < last.timings.ttft_s <= last.timings.e2e_s


def assert_moved_after(worker: FakeWorker, prompt: list[int], k: int, n: int) -> None:
    """The worker's second request continues the first after the tokens the client had:
    at least the ``k`` it had read when it stopped the router, and any already on the
    wire then (a loaded machine delivers one more before the stream breaks), of ``n``."""
    first, moved = worker.requests[:2]
    assert list(first.prompt_token_ids) == prompt
    had = len(moved.prompt_token_ids) - len(prompt)
    assert k <= had < n
    assert list(moved.prompt_token_ids) == prompt + expected_tokens(len(prompt), had)
    assert moved.sampling.max_tokens == n - had
    assert moved.request_id.split("#")[0] == first.request_id.split("#")[0]


def test_async_stream_resumes_on_the_next_router_when_its_router_dies() -> None:
    async def body() -> None:
        async with two_routers() as r:
            r.worker.token_delay_s = 0.02  # the kill lands mid-stream
            msgs: list[api_pb2.GenerateResponse] = []
            async with AsyncClient(r.targets) as client:
                async for m in client.stream(PROMPT, max_tokens=8, temperature=0.0):
                    msgs.append(m)
                    if len(msgs) == 3:
                        await r.servers[0].stop(None)  # router 1 dies mid-stream
                assert client.resumes == 1
                # The survivor is now current: the next request goes there at once.
                again = await client.generate(PROMPT, max_tokens=2, temperature=0.0)
                assert again.resumes == 0 and again.token_ids == expected_tokens(P, 2)
            assert_one_stream(msgs, PROMPT, 8)
            assert_moved_after(r.worker, PROMPT, 3, 8)

    run(body)


def test_sync_stream_of_a_text_prompt_resumes_on_the_next_router() -> None:
    async def body() -> None:
        async with two_routers() as r:
            r.worker.token_delay_s = 0.02
            loop = asyncio.get_running_loop()
            msgs: list[api_pb2.GenerateResponse] = []

            def consume() -> int:  # on a thread: the routers serve on this loop
                with Client(r.targets) as client:
                    for m in client.stream("hello there", max_tokens=8, temperature=0.0):
                        msgs.append(m)
                        if len(msgs) == 3:
                            asyncio.run_coroutine_threadsafe(
                                r.servers[0].stop(None), loop).result(5)
                    return client.resumes

            assert await asyncio.to_thread(consume) == 1
            prompt = [ord(c) for c in "hello there"]  # the fake tokenizer's ids
            assert_one_stream(msgs, prompt, 8)
            assert_moved_after(r.worker, prompt, 3, 8)

    run(body)


def test_a_dead_first_router_is_passed_over_before_the_first_message() -> None:
    async def body() -> None:
        async with two_routers() as r:
            dead = f"127.0.0.1:{free_port()}"

            def call() -> list:
                with Client([dead, r.targets[1]]) as client:
                    out = client.generate(PROMPT, max_tokens=4, temperature=0.0)
                    second = client.generate(PROMPT, max_tokens=4, temperature=0.0)
                    return [out, second, client.resumes]

            out, second, total = await asyncio.to_thread(call)
            assert out.resumes == 1 and second.resumes == 0 and total == 1
            assert out.token_ids == second.token_ids == expected_tokens(P, 4)
            assert out.prompt_token_ids == PROMPT
            assert out.usage["prompt_tokens"] == P and out.usage["completion_tokens"] == 4
            # The original request went again as it was: one request, on router 2.
            assert [list(q.prompt_token_ids) for q in r.worker.requests] == [PROMPT] * 2
            assert r.cluster.router.in_flight == 0

    run(body)


def test_an_answer_about_the_request_is_raised_not_resumed() -> None:
    async def body() -> None:
        async with two_routers() as r:
            async with AsyncClient(r.targets) as client:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.generate(list(range(64)), max_tokens=4)  # too long
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert client.resumes == 0
            assert r.worker.requests == []

    run(body)


def test_past_max_resumes_the_last_failure_is_raised() -> None:
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    with Client(dead, max_resumes=2) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert client.resumes == 2
        assert time.monotonic() - started < 5  # two different routers: no waiting
    with Client(dead[0]) as single, pytest.raises(grpc.RpcError) as e:  # one target:
        single.generate(PROMPT, max_tokens=4)  # fails as it always did, no resume
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and single.resumes == 0
