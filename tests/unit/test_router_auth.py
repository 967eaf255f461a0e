"""The router's trust boundary end to end in one process: the real gRPC server
(``router.server.grpc_server``: interceptor, servicer, health, reflection) on 127.0.0.1
and the real OpenAI HTTP app, over a real :class:`router.core.Router` on fake in-process
workers (tests/fake_workers.py), with an API key file.

The route lists are read from the servers themselves (``app.router.routes()``, the
public service's descriptor), so a route added without authentication fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp.test_utils import TestClient, TestServer
from fake_workers import Cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.pdserve.v1 import api_pb2
from router.auth import KeyStore, tenant_salt
from router.client import AsyncClient, Client
from router.errors import RETRY_AFTER_METADATA
from router.openai import create_app
from router.openai.app import HEALTH_PATHS
from router.server import grpc_server

USER = "sk-acme-user-0123456789"
OTHER = "sk-globex-user-98765432"
ADMIN = "sk-ops-admin-abcdefabcdef"
WRONG = "sk-nobody-000000000000000"
SERVICE = api_pb2.DESCRIPTOR.services_by_name["PDServe"]
SECRET = "secret detail /srv/router/tokenizer.py line 7"


def key_file(tmp_path: Path, text: str | None = None) -> Path:
    path = tmp_path / "keys"
    path.write_text(text or f"{USER} acme\n{OTHER} globex\n{ADMIN} ops admin\n")
    path.chmod(0o600)
    return path


class Served:
    def __init__(self, cluster: Cluster, target: str, http: TestClient,
                 channel: grpc.aio.Channel) -> None:
        self.cluster, self.target, self.http, self.channel = cluster, target, http, channel

    def call(self, method: str, key: str | None) -> Any:
        """A multi-callable for ``method`` of the public service sending ``key``."""
        m = SERVICE.methods_by_name[method]
        path = f"/{SERVICE.full_name}/{method}"
        out_type = _message_class(m.output_type)
        make = (self.channel.unary_stream if m.server_streaming
                else self.channel.unary_unary)
        callable_ = make(path, request_serializer=_serialize,
                         response_deserializer=out_type.FromString)
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        return lambda request, **kw: callable_(request, metadata=metadata, **kw)


def _serialize(msg: Any) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _message_class(descriptor: Any) -> Any:
    return getattr(api_pb2, descriptor.name)


@contextlib.asynccontextmanager
async def serving(keys_path: Path | None, *, metrics_public: bool = False,
                  **cluster: Any) -> AsyncIterator[Served]:
    async with Cluster(["mixed"], **cluster) as c:
        keys = KeyStore(keys_path) if keys_path else None
        server, health = grpc_server(c.router, keys)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        app = create_app(c.router, keys=keys, metrics_text=c.router.metrics.text,
                         metrics_public=metrics_public)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            async with TestClient(TestServer(app)) as http:
                yield Served(c, f"127.0.0.1:{port}", http, channel)
        finally:
            await channel.close()
            await server.stop(None)


def run(body: Any) -> None:
    asyncio.run(body())


async def rpc(served: Served, method: str, key: str | None, request: Any = None) -> Any:
    """The method's answer (a list for a stream); raises AioRpcError."""
    m = SERVICE.methods_by_name[method]
    if request is None:
        request = _message_class(m.input_type)()
        if method == "Generate":
            request = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=[5, 6, 7]))
        if method == "Tokenize":
            request = api_pb2.TokenizeRequest(text="abc")
    call = served.call(method, key)(request, timeout=5)
    if m.server_streaming:
        return [msg async for msg in call]
    return await call


# -- gRPC -----------------------------------------------------------------------------------


def test_every_public_rpc_needs_a_key_and_get_status_an_admin_key(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path)) as s:
            for method in SERVICE.methods_by_name:
                for key in (None, WRONG, f"{USER}x"):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await rpc(s, method, key)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, key)
                    assert not key or key not in e.value.details()
                if method == "GetStatus":
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await rpc(s, method, USER)
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    status = await rpc(s, method, ADMIN)
                    assert status.workers[0].address == s.cluster.workers[0].address
                else:
                    await rpc(s, method, USER)  # answers
            # a method no service has: refused for the key before anything else
            unknown = s.channel.unary_unary(f"/{SERVICE.full_name}/Nope",
                                            request_serializer=_serialize,
                                            response_deserializer=bytes)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await unknown(b"", timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    run(body)


def test_health_is_open_and_reflection_needs_a_key(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path)) as s:
            health = health_pb2_grpc.HealthStub(s.channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(s.channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")

            async def services(metadata: tuple) -> list[str]:
                call = stub.ServerReflectionInfo(iter([ask]), metadata=metadata, timeout=5)
                return [svc.name async for r in call
                        for svc in r.list_services_response.service]

            with pytest.raises(grpc.aio.AioRpcError) as e:
                await services(())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert SERVICE.full_name in await services((("authorization",
                                                          f"Bearer {USER}"),))

    run(body)


def test_without_a_key_file_every_rpc_is_open(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(None) as s:
            status = await rpc(s, "GetStatus", None)
            assert status.workers
            last = (await rpc(s, "Generate", None))[-1]
            assert last.routing.worker == s.cluster.workers[0].address

    run(body)


def test_grpc_tenants_are_salted_and_see_no_workers(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path)) as s:
            (w,) = s.cluster.workers
            mine = await rpc(s, "Generate", USER)
            theirs = await rpc(s, "Generate", OTHER)
            admin = await rpc(s, "Generate", ADMIN)
            assert [r.cache_salt for r in w.requests] == [
                tenant_salt("acme", None), tenant_salt("globex", None), tenant_salt("ops", None)]
            assert mine[-1].routing.worker == theirs[-1].routing.worker == ""
            assert admin[-1].routing.worker == w.address

    run(body)


def test_bytes_that_are_not_utf8_are_invalid_argument_naming_the_field(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path)) as s:
            good = api_pb2.GenerateRequest(messages=api_pb2.ChatMessages(messages=[
                api_pb2.ChatMessage(role="user", content="QQQQ")])).SerializeToString()
            bad = good.replace(b"QQQQ", b"Q\xed\xa0\x80")  # a lone surrogate, UTF-8'd
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await rpc(s, "Generate", USER, bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "messages.messages[0].content: not valid UTF-8 text"
            text = api_pb2.TokenizeRequest(text="abc").SerializeToString()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await rpc(s, "Tokenize", USER, text.replace(b"abc", b"a\xffc"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("text: ")

    run(body)


def test_grpc_internal_errors_carry_the_request_id_and_no_exception_text(
        tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path)) as s:
            s.cluster.tokenizer.error = RuntimeError(SECRET)
            request = api_pb2.GenerateRequest(request_id="mine-1", text="hello")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await rpc(s, "Generate", USER, request)
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert e.value.details() == "internal error; see the router log for request mine-1"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await rpc(s, "Tokenize", USER, api_pb2.TokenizeRequest(text="hello"))
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "RuntimeError" not in e.value.details() and "secret" not in e.value.details()

    run(body)


def test_a_failed_worker_is_told_without_its_address_or_error_text(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path), migration_limit=0) as s:
            (w,) = s.cluster.workers
            w.fail_after = (1, grpc.StatusCode.INTERNAL)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await rpc(s, "Generate", ADMIN)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            details = e.value.details()
            assert "retry later" in details and "request req-" in details
            assert w.address not in details and "on purpose" not in details
            w.fail_after = (1, grpc.StatusCode.INTERNAL)
            resp = await s.http.post("/v1/completions", json={"prompt": [5, 6], "stream": True},
                                     headers={"Authorization": f"Bearer {USER}"})
            text = await resp.text()
            assert resp.status == 200 and '"code":"unavailable"' in text
            assert w.address not in text and "on purpose" not in text

    run(body)


def test_tenant_over_its_limit_is_resource_exhausted_with_retry_after(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path), tenant_tokens_per_minute=20) as s:
            await rpc(s, "Generate", USER)  # reserves 3 + 8 of 20
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await rpc(s, "Generate", USER, api_pb2.GenerateRequest(
                    token_ids=api_pb2.TokenIds(ids=list(range(5, 20)))))  # 15 + 8 > 9 left
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            trailing = dict(e.value.trailing_metadata() or ())
            assert int(trailing[RETRY_AFTER_METADATA]) >= 1
            await rpc(s, "Generate", OTHER)  # globex has its own bucket
            resp = await s.http.post("/v1/completions", json={"prompt": [5] * 15},
                                     headers={"Authorization": f"Bearer {USER}"})
            assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1

    run(body)


def test_python_clients_send_their_key_and_wait_for_readiness_without_one(
        tmp_path: Path) -> None:
    def sync_client(target: str) -> None:  # on a thread: the server runs on this loop
        with Client(target) as anonymous:
            anonymous.wait_ready(timeout=5)  # the health check: no key needed
            with pytest.raises(grpc.RpcError) as e:
                anonymous.list_models()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(target, api_key=ADMIN) as admin:
            assert admin.status().workers
            assert admin.generate([5, 6, 7], max_tokens=2).routing["worker"]

    async def body() -> None:
        async with serving(key_file(tmp_path)) as s:
            await asyncio.to_thread(sync_client, s.target)
            async with AsyncClient(s.target, api_key=USER) as user:
                out = await user.generate([5, 6, 7], max_tokens=2)
                assert len(out.token_ids) == 2 and out.routing["worker"] == ""
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await user.status()
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

    run(body)


# -- HTTP -----------------------------------------------------------------------------------


def _url(canonical: str) -> str:
    return canonical.replace("{model}", "x")


def test_every_http_route_but_health_needs_a_key(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path)) as s:
            routes = [(r.method, r.resource.canonical) for r in s.http.app.router.routes()
                      if r.resource is not None]
            assert ("POST", "/v1/chat/completions") in routes and ("GET", "/metrics") in routes
            for method, path in routes:
                if path in HEALTH_PATHS:
                    resp = await s.http.request(method, _url(path))
                    assert resp.status == 200, path
                    continue
                for headers in ({}, {"Authorization": f"Bearer {WRONG}"},
                                {"Authorization": f"Basic {USER}"}):
                    resp = await s.http.request(method, _url(path), headers=headers,
                                                json={"prompt": "p"})
                    assert resp.status == 401, (method, path, headers)
                    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
                    if method != "HEAD":
                        err = (await resp.json())["error"]
                        assert err["code"] == "invalid_api_key" and WRONG not in err["message"]
            resp = await s.http.get("/no/such/route")
            assert resp.status == 401  # no key: nothing said about which routes exist
            resp = await s.http.get("/no/such/route", headers={"Authorization": f"Bearer {USER}"})
            assert resp.status == 404

    run(body)


def test_metrics_need_an_admin_key_unless_public(tmp_path: Path) -> None:
    async def body() -> None:
        path = key_file(tmp_path)
        async with serving(path) as s:
            resp = await s.http.get("/metrics", headers={"Authorization": f"Bearer {USER}"})
            assert resp.status == 403
            assert (await resp.json())["error"]["code"] == "permission_denied"
            resp = await s.http.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
            assert resp.status == 200 and "pdserve:" in await resp.text()
        async with serving(path, metrics_public=True) as s:
            resp = await s.http.get("/metrics")
            assert resp.status == 200 and "pdserve:" in await resp.text()

    run(body)


def test_http_tenants_are_salted_per_key(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(key_file(tmp_path)) as s:
            (w,) = s.cluster.workers
            for key in (USER, OTHER, USER):
                resp = await s.http.post("/v1/completions",
                                         json={"prompt": [5, 6, 7], "max_tokens": 2},
                                         headers={"Authorization": f"Bearer {key}"})
                assert resp.status == 200
            assert [r.cache_salt for r in w.requests] == [
                tenant_salt("acme", None), tenant_salt("globex", None), tenant_salt("acme", None)]

    run(body)


def test_a_new_key_works_and_a_removed_one_stops_within_two_seconds(tmp_path: Path) -> None:
    async def body() -> None:
        path = key_file(tmp_path, f"{USER} acme\n")
        async with serving(path) as s:
            async def status(key: str) -> int:
                resp = await s.http.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                return resp.status

            assert (await status(USER), await status(OTHER)) == (200, 401)
            new = tmp_path / "keys.new"
            new.write_text(f"{OTHER} globex\n")
            os.replace(new, path)  # how an operator should rotate: atomically
            start = time.monotonic()
            while await status(OTHER) != 200:
                assert time.monotonic() - start < 2.5, "the new key did not work in time"
                await asyncio.sleep(0.05)
            assert await status(USER) == 401
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await rpc(s, "ListModels", USER)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await rpc(s, "ListModels", OTHER)

    run(body)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "\ud83d"}]}]},
     "messages[0].content[1].text"),
    ("/v1/completions", {"prompt": "p", "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/completions", {"prompt": "p", "cache_salt": "\ud800"}, "cache_salt"),
], ids=["prompt", "chat", "chat-part", "stop", "cache-salt"])
def test_lone_surrogate_is_a_400_naming_the_field(tmp_path: Path, path: str,
                                                  body: dict, param: str) -> None:
    async def run_() -> None:
        async with serving(None) as s:
            for stream in (False, True):
                resp = await s.http.post(path, json={**body, "stream": stream})
                assert resp.status == 400
                err = (await resp.json())["error"]
                assert err["param"] == param and "Unicode" in err["message"]
            assert s.cluster.workers[0].requests == []

    run(run_)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
], ids=["completions", "chat"])
def test_http_500_says_only_internal_error_and_the_request_id(
        tmp_path: Path, path: str, body: dict, stream: bool) -> None:
    async def run_() -> None:
        async with serving(key_file(tmp_path)) as s:
            s.cluster.tokenizer.error = RuntimeError(SECRET)
            resp = await s.http.post(path, json={**body, "stream": stream},
                                     headers={"Authorization": f"Bearer {USER}"})
            assert resp.status == 500
            text = await resp.text()
            rid = resp.headers["X-Request-Id"]
            assert (await resp.json())["error"]["message"] == (
                f"internal error; see the router log for request {rid}")
            assert "RuntimeError" not in text and "secret" not in text

    run(run_)
