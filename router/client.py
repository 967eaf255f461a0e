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
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.sampling import SamplingParams
from common.tls import client_credentials, load_ca
from common.wire import FINISH_NAMES, sampling_to_proto
from protos.pdserve.v1 import api_pb2, api_pb2_grpc

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

    def add(self, msg: api_pb2.GenerateResponse) -> None:
        self.request_id = msg.request_id or self.request_id
        self.text += msg.text
        self.token_ids.extend(msg.token_ids)
        self.prompt_token_ids.extend(msg.prompt_token_ids)
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


def build_request(prompt: Prompt, request_id: str = "", model: str = "",
                  cache_salt: str = "", **sampling: Any) -> api_pb2.GenerateRequest:
    """``sampling`` takes :class:`SamplingParams` fields; they are validated here too."""
    req = api_pb2.GenerateRequest(request_id=request_id, model=model, cache_salt=cache_salt,
                                  sampling=sampling_to_proto(SamplingParams(**sampling)))
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


class Client:
    def __init__(self, target: str, tls_ca: str | None = None,
                 tls_server_name: str | None = None, *, api_key: str | None = None) -> None:
        self._metadata = auth_metadata(api_key)
        creds, options = _secure(tls_ca, tls_server_name)
        self._channel = (grpc.secure_channel(target, creds, options) if creds
                         else grpc.insecure_channel(target))
        self._stub = api_pb2_grpc.PDServeStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(self, prompt: Prompt, timeout: float | None = None, **kw: Any
               ) -> Iterator[api_pb2.GenerateResponse]:
        call = self._stub.Generate(build_request(prompt, **kw), timeout=timeout,
                                   metadata=self._metadata)
        try:
            yield from call
        finally:
            call.cancel()  # stops the request server-side if the caller stopped early

    def generate(self, prompt: Prompt, timeout: float | None = None, **kw: Any) -> Completion:
        out = Completion()
        for msg in self.stream(prompt, timeout=timeout, **kw):
            out.add(msg)
        return out

    def status(self, timeout: float = 5.0) -> api_pb2.GetStatusResponse:
        return self._stub.GetStatus(api_pb2.GetStatusRequest(), timeout=timeout,
                                    metadata=self._metadata)

    def list_models(self) -> list[str]:
        return [m.id for m in self._stub.ListModels(api_pb2.ListModelsRequest(),
                                                    metadata=self._metadata).models]

    def serving(self, timeout: float = 2.0) -> bool:
        """Whether the router's health check says SERVING: it is up and the workers it
        started with answer. Needs no API key (health checks are open)."""
        answer = health_pb2_grpc.HealthStub(self._channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout)
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until the router serves (it starts after its workers load); no key
        needed."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.serving(timeout=2.0):
                    return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router did not serve within {timeout:.0f} s")
            time.sleep(0.5)


class AsyncClient:
    def __init__(self, target: str, tls_ca: str | None = None,
                 tls_server_name: str | None = None, *, api_key: str | None = None) -> None:
        self._metadata = auth_metadata(api_key)
        creds, options = _secure(tls_ca, tls_server_name)
        self._channel = (grpc.aio.secure_channel(target, creds, options) if creds
                         else grpc.aio.insecure_channel(target))
        self._stub = api_pb2_grpc.PDServeStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(self, prompt: Prompt, timeout: float | None = None, **kw: Any
                     ) -> AsyncIterator[api_pb2.GenerateResponse]:
        call = self._stub.Generate(build_request(prompt, **kw), timeout=timeout,
                                   metadata=self._metadata)
        try:
            async for msg in call:
                yield msg
        finally:
            call.cancel()

    async def generate(self, prompt: Prompt, timeout: float | None = None, **kw: Any
                       ) -> Completion:
        out = Completion()
        async for msg in self.stream(prompt, timeout=timeout, **kw):
            out.add(msg)
        return out

    async def status(self, timeout: float = 5.0) -> api_pb2.GetStatusResponse:
        return await self._stub.GetStatus(api_pb2.GetStatusRequest(), timeout=timeout,
                                          metadata=self._metadata)

    async def tokenize(self, text: str, timeout: float = 5.0) -> list[int]:
        """``text`` as the router's tokenizer encodes a text prompt (special tokens it
        adds, such as BOS, included)."""
        answer = await self._stub.Tokenize(api_pb2.TokenizeRequest(text=text), timeout=timeout,
                                           metadata=self._metadata)
        return list(answer.token_ids)
