"""The Python client of the public API (sync and asyncio): what the CLI, the load
harness, the tests and users share.

``Client(target).generate("prompt", max_tokens=16)`` returns a :class:`Completion`;
``stream(...)`` yields the raw :class:`api_pb2.GenerateResponse` messages as they come.
A prompt is a string, a list of token ids, or a list of ``{"role", "content"}`` chat
messages. Errors surface as ``grpc.RpcError`` with the server's status and message.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.sampling import SamplingParams
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


class Client:
    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = api_pb2_grpc.PDServeStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(self, prompt: Prompt, timeout: float | None = None, **kw: Any
               ) -> Iterator[api_pb2.GenerateResponse]:
        call = self._stub.Generate(build_request(prompt, **kw), timeout=timeout)
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
        return self._stub.GetStatus(api_pb2.GetStatusRequest(), timeout=timeout)

    def list_models(self) -> list[str]:
        return [m.id for m in self._stub.ListModels(api_pb2.ListModelsRequest()).models]

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until the router answers (it starts after its workers load)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.status(timeout=2.0)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


class AsyncClient:
    def __init__(self, target: str) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = api_pb2_grpc.PDServeStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(self, prompt: Prompt, timeout: float | None = None, **kw: Any
                     ) -> AsyncIterator[api_pb2.GenerateResponse]:
        call = self._stub.Generate(build_request(prompt, **kw), timeout=timeout)
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
        return await self._stub.GetStatus(api_pb2.GetStatusRequest(), timeout=timeout)
