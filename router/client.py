"""The Python client of the public API (sync and asyncio): what the CLI, the load
harness, the tests and users share.

``Client(target).generate("prompt", max_tokens=16)`` returns a :class:`Completion`;
``stream(...)`` yields the raw :class:`api_pb2.GenerateResponse` messages as they come.
A prompt is a string, a list of token ids, or a list of ``{"role", "content"}`` chat
messages. Errors surface as ``grpc.RpcError`` with the server's status and message.
A router serving TLS is reached with ``tls_ca`` (the CA certificate file that signed its
certificate; ``pdserve certs`` writes ``ca.pem``), optionally checking another name than
the target's host (``tls_server_name``). ``api_key`` (a router with a key file needs
one; ``status`` an admin key) goes as ``authorization: Bearer KEY`` metadata on every call.

Several routers: ``Client(["10.0.0.1:50051", "10.0.0.2:50051"])`` (a list or tuple; a
string is always one gRPC target, which may itself be a name that resolves to several
addresses, such as ``dns:///router.svc:50051``). Calls go to the current router, the
first at the start; a channel per target is opened on its first use. When a stream's
router dies (:data:`router.resume.RESUMABLE`), the request *resumes* on the next one with
the prompt plus the tokens already received, at most ``max_resumes`` times (default: 3
with several targets, 0 with one: a single target behind a load balancer may set it),
and the next router becomes the current one. A greedy stream completes token for token
as if nothing happened; the caller sees one stream. :mod:`router.resume` has the rule
and its limits (seeded sampling restarts its random stream; text a stop string held back
on the dead router is lost). ``Completion.resumes`` counts one request's resumes,
``Client.resumes`` every request's, and each is logged as a warning.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.sampling import SamplingParams
from common.tls import client_credentials, load_ca
from common.wire import FINISH_NAMES, sampling_to_proto
from protos.pdserve.v1 import api_pb2, api_pb2_grpc, common_pb2

from .resume import Resume

log = logging.getLogger(__name__)

Prompt = str | Sequence[int] | Sequence[dict[str, str]]


@dataclass
class Completion:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    routing: dict[str, Any] = field(default_factory=dict)
    """How the router placed it: policy, reason, worker, indexed_cached_tokens, ..."""
    resumes: int = 0
    """How many times the client moved the request to another router (its router died)."""
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    """Asked for: one per prompt token after the first (token id, log-probability, top)."""

    def add(self, msg: api_pb2.GenerateResponse) -> None:
        self.request_id = msg.request_id or self.request_id
        self.text += msg.text
        self.token_ids.extend(msg.token_ids)
        self.prompt_token_ids.extend(msg.prompt_token_ids)
        self.prompt_logprobs.extend(msg.prompt_logprobs)
        if msg.finish_reason:
            self.finish_reason = FINISH_NAMES.get(msg.finish_reason, "unknown")
            u = msg.usage
            self.usage = {"prompt_tokens": u.prompt_tokens,
                          "completion_tokens": u.completion_tokens,
                          "cached_tokens": u.cached_tokens}
            self.ttft_s, self.e2e_s = msg.timings.ttft_s, msg.timings.e2e_s
            r = msg.routing
            self.routing = {"policy": r.policy, "reason": r.reason, "worker": r.worker,
                            "indexed_cached_tokens": r.indexed_cached_tokens,
                            "estimated_prefill_tokens": r.estimated_prefill_tokens,
                            "decode_worker": r.decode_worker, "migrations": r.migrations}

    def to_json(self) -> dict[str, Any]:
        """The object DESIGN.md's command-line section defines for ``--json``."""
        return {"text": self.text, "token_ids": self.token_ids,
                "prompt_token_ids": self.prompt_token_ids, "finish_reason": self.finish_reason,
                "usage": self.usage, "ttft_s": self.ttft_s, "e2e_s": self.e2e_s}


def busy_workers(status: api_pb2.GetStatusResponse) -> list[api_pb2.WorkerStatus]:
    """Serving workers that still hold something: a request running, waiting or reserved,
    a KV block not free, or a transfer in flight. None, with no request in flight at the
    router (``status.requests_in_flight``), is an idle cluster: what every leak check
    (tests, ``pdserve chaos``, ``pdserve fuzz``) waits for."""
    return [w for w in status.workers if w.serving and (
        w.running_requests or w.waiting_requests or w.reserved_requests
        or w.free_blocks != w.total_blocks or w.transfers.in_flight)]


def describe_busy(w: api_pb2.WorkerStatus) -> str:
    """One busy worker (:func:`busy_workers`) as a leak report names it."""
    return (f"{w.role} worker {w.address}: {w.total_blocks - w.free_blocks} of "
            f"{w.total_blocks} blocks held, {w.running_requests} running, "
            f"{w.waiting_requests} waiting, {w.reserved_requests} reserved, "
            f"{w.transfers.in_flight} transfers in flight")


def build_request(prompt: Prompt, request_id: str = "", model: str = "",
                  cache_salt: str = "", n: int = 1, prompt_logprobs: int | None = None,
                  **sampling: Any) -> api_pb2.GenerateRequest:
    """``sampling`` takes :class:`SamplingParams` fields; they are validated here too.
    ``n``: choices (see :meth:`Client.choices`); ``prompt_logprobs``: the prompt tokens'
    log-probabilities with this many alternatives (:attr:`Completion.prompt_logprobs`)."""
    req = api_pb2.GenerateRequest(request_id=request_id, model=model, cache_salt=cache_salt,
                                  sampling=sampling_to_proto(SamplingParams(**sampling)),
                                  n=n if n != 1 else 0, prompt_logprobs=prompt_logprobs)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.messages.extend(api_pb2.ChatMessage(role=m["role"], content=m["content"])
                                     for m in prompt)  # type: ignore[index]
    else:
        req.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return req


def _secure(tls_ca: str | None, tls_server_name: str | None
            ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """Credentials and options for a TLS router (None: plaintext)."""
    if tls_ca is None:
        return None, []
    options = ([("grpc.ssl_target_name_override", tls_server_name)]
               if tls_server_name else [])
    return client_credentials(load_ca(tls_ca)), options


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries ``api_key`` (none without one)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


Targets = str | Sequence[str]
"""One gRPC target (``HOST:PORT``, or any name gRPC resolves), or several routers."""


class _Routers:
    """The routers a client may use, which one is current, and the resume bookkeeping
    both clients share; safe to call from several threads."""

    def __init__(self, target: Targets, max_resumes: int | None) -> None:
        targets = [target] if isinstance(target, str) else list(target)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"target: give a router's HOST:PORT or a non-empty list of "
                             f"them, got {target!r}")
        if max_resumes is None:
            max_resumes = 3 if len(targets) > 1 else 0
        if max_resumes < 0:
            raise ValueError(f"max_resumes: must be >= 0, got {max_resumes}")
        self.targets = targets
        self.max_resumes = max_resumes
        self.current = 0
        self.resumes = 0
        self._lock = threading.Lock()

    def next(self, failed: int) -> None:
        """Router ``failed`` did not answer: the next one becomes current (unless another
        request moved on already)."""
        with self._lock:
            if self.current == failed:
                self.current = (failed + 1) % len(self.targets)

    def moved(self, resume: Resume, failed: int, error: grpc.RpcError) -> float:
        """After ``resume.retry(error)`` agreed: count and log the move, make the next
        router current; how long to wait before calling it (only when it is the router
        that just failed: a single target, reconnecting)."""
        self.next(failed)
        with self._lock:
            self.resumes += 1
        log.warning("router %s failed after %d tokens of request %s (%s: %s); it resumes "
                    "on %s (resume %d of at most %d)", self.targets[failed],
                    len(resume.token_ids), resume.request_id or "(not started)",
                    error.code().name, error.details(), self.targets[self.current],
                    resume.resumes, resume.max_resumes)
        if self.current != failed:
            return 0.0
        left = resume.time_left()
        return min(1.0, 0.1 * 2 ** (resume.resumes - 1), 1.0 if left is None else left)


class Client:
    """The sync client. ``target``: one router, or a list of routers to resume on (see
    the module docstring); ``max_resumes``: how many times one request may move to
    another router (default 3 with several targets, 0 with one). Safe to share between
    threads (gRPC channels are)."""

    def __init__(self, target: Targets, tls_ca: str | None = None,
                 tls_server_name: str | None = None, *, api_key: str | None = None,
                 max_resumes: int | None = None) -> None:
        self._metadata = auth_metadata(api_key)
        self._routers = _Routers(target, max_resumes)
        self._creds, self._options = _secure(tls_ca, tls_server_name)
        self._channels: dict[int, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def resumes(self) -> int:
        """Resumes (moves to another router) of all this client's requests so far."""
        return self._routers.resumes

    def _channel(self, i: int | None = None) -> grpc.Channel:
        """Router ``i``'s channel (default: the current router's), opened on first use."""
        i = self._routers.current if i is None else i
        with self._lock:
            if self._closed:
                raise ValueError("this client is closed")
            channel = self._channels.get(i)
            if channel is None:
                target = self._routers.targets[i]
                channel = (grpc.secure_channel(target, self._creds, self._options)
                           if self._creds else grpc.insecure_channel(target))
                self._channels[i] = channel
            return channel

    def _stub_of(self, i: int) -> api_pb2_grpc.PDServeStub:
        return api_pb2_grpc.PDServeStub(self._channel(i))

    @property
    def _stub(self) -> api_pb2_grpc.PDServeStub:
        """The current router's stub (benchmarks/router.py calls it directly)."""
        return self._stub_of(self._routers.current)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def stream(self, prompt: Prompt, timeout: float | None = None, **kw: Any
               ) -> Iterator[api_pb2.GenerateResponse]:
        """The response messages as they come, as one stream even when the request
        resumes on another router. ``timeout``: the whole request's deadline."""
        yield from self._stream(Resume(build_request(prompt, **kw),
                                       self._routers.max_resumes, timeout))

    def _stream(self, resume: Resume) -> Iterator[api_pb2.GenerateResponse]:
        while True:
            i = self._routers.current
            call = self._stub_of(i).Generate(resume.request, timeout=resume.time_left(),
                                          metadata=self._metadata)
            try:
                for msg in call:
                    yield resume.relay(msg)
                return
            except grpc.RpcError as e:
                if resume.finished:
                    return  # every message came; only the end of the call was lost
                if self._closed or not resume.retry(e):
                    raise
                wait = self._routers.moved(resume, i, e)
            finally:
                call.cancel()  # stops the request server-side if the caller stopped early
            if wait:
                time.sleep(wait)

    def generate(self, prompt: Prompt, timeout: float | None = None, **kw: Any) -> Completion:
        resume = Resume(build_request(prompt, **kw), self._routers.max_resumes, timeout)
        out = Completion()
        for msg in self._stream(resume):
            out.add(msg)
        out.resumes = resume.resumes
        return out

    def choices(self, prompt: Prompt, n: int, timeout: float | None = None, **kw: Any
                ) -> list[Completion]:
        """``n`` completions of one prompt, computed once (``index`` order). A request
        of several choices does not resume on another router: its error is raised."""
        outs = [Completion() for _ in range(n)]
        for msg in self._stream(Resume(build_request(prompt, n=n, **kw), 0, timeout)):
            outs[msg.index].add(msg)
        return outs

    def status(self, timeout: float = 5.0) -> api_pb2.GetStatusResponse:
        """The current router's status."""
        return self._stub.GetStatus(api_pb2.GetStatusRequest(), timeout=timeout,
                                      metadata=self._metadata)

    def list_models(self) -> list[str]:
        return [m.id for m in self._stub.ListModels(api_pb2.ListModelsRequest(),
                                                      metadata=self._metadata).models]

    def serving(self, timeout: float = 2.0) -> bool:
        """Whether the current router's health check says SERVING: it is up and the
        workers it started with answer. Needs no API key (health checks are open)."""
        answer = health_pb2_grpc.HealthStub(self._channel()).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout)
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until a router serves (it starts after its workers load; with several,
        they are tried in turn and the one serving becomes current); no key needed."""
        deadline = time.monotonic() + timeout
        while True:
            i = self._routers.current
            try:
                if self.serving(timeout=2.0):
                    return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
            self._routers.next(i)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router did not serve within {timeout:.0f} s")
            time.sleep(0.5 / len(self._routers.targets))


class AsyncClient:
    """The asyncio client; ``target`` and ``max_resumes`` as :class:`Client`'s. Use it
    from one event loop."""

    def __init__(self, target: Targets, tls_ca: str | None = None,
                 tls_server_name: str | None = None, *, api_key: str | None = None,
                 max_resumes: int | None = None) -> None:
        self._metadata = auth_metadata(api_key)
        self._routers = _Routers(target, max_resumes)
        self._creds, self._options = _secure(tls_ca, tls_server_name)
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._closed = False

    @property
    def resumes(self) -> int:
        """Resumes (moves to another router) of all this client's requests so far."""
        return self._routers.resumes

    @property
    def _stub(self) -> api_pb2_grpc.PDServeStub:
        """The current router's stub."""
        return self._stub_of(self._routers.current)

    def _stub_of(self, i: int) -> api_pb2_grpc.PDServeStub:
        """Router ``i``'s stub; its channel is opened on first use."""
        if self._closed:
            raise ValueError("this client is closed")
        channel = self._channels.get(i)
        if channel is None:
            target = self._routers.targets[i]
            channel = (grpc.aio.secure_channel(target, self._creds, self._options)
                       if self._creds else grpc.aio.insecure_channel(target))
            self._channels[i] = channel
        return api_pb2_grpc.PDServeStub(channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    async def stream(self, prompt: Prompt, timeout: float | None = None, **kw: Any
                     ) -> AsyncIterator[api_pb2.GenerateResponse]:
        """As :meth:`Client.stream`."""
        stream = self._stream(Resume(build_request(prompt, **kw), self._routers.max_resumes,
                                     timeout))
        try:
            async for msg in stream:
                yield msg
        finally:
            await stream.aclose()  # the call is cancelled now, not when collected

    async def _stream(self, resume: Resume) -> AsyncIterator[api_pb2.GenerateResponse]:
        while True:
            i = self._routers.current
            call = self._stub_of(i).Generate(resume.request, timeout=resume.time_left(),
                                          metadata=self._metadata)
            try:
                async for msg in call:
                    yield resume.relay(msg)
                return
            except grpc.RpcError as e:
                if resume.finished:
                    return
                if self._closed or not resume.retry(e):
                    raise
                wait = self._routers.moved(resume, i, e)
            finally:
                call.cancel()
            if wait:
                await asyncio.sleep(wait)

    async def generate(self, prompt: Prompt, timeout: float | None = None, **kw: Any
                       ) -> Completion:
        resume = Resume(build_request(prompt, **kw), self._routers.max_resumes, timeout)
        out = Completion()
        async for msg in self._stream(resume):
            out.add(msg)
        out.resumes = resume.resumes
        return out

    async def choices(self, prompt: Prompt, n: int, timeout: float | None = None, **kw: Any
                      ) -> list[Completion]:
        """As :meth:`Client.choices`."""
        outs = [Completion() for _ in range(n)]
        async for msg in self._stream(Resume(build_request(prompt, n=n, **kw), 0, timeout)):
            outs[msg.index].add(msg)
        return outs

    async def status(self, timeout: float = 5.0) -> api_pb2.GetStatusResponse:
        """The current router's status."""
        return await self._stub.GetStatus(api_pb2.GetStatusRequest(), timeout=timeout,
                                            metadata=self._metadata)

    async def tokenize(self, text: str, timeout: float = 5.0) -> list[int]:
        """``text`` as the router's tokenizer encodes a text prompt (special tokens it
        adds, such as BOS, included)."""
        answer = await self._stub.Tokenize(api_pb2.TokenizeRequest(text=text),
                                             timeout=timeout, metadata=self._metadata)
        return list(answer.token_ids)
