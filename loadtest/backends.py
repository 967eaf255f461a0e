"""What the harness sends requests through: the router's gRPC API, or any
OpenAI-compatible HTTP server (``/v1/completions``, streamed), so pdserve and its peers
are measured by the same code.

Every backend streams one request into a :class:`loadtest.metrics.RequestRecord`: the
arrival time of each message (gRPC) or SSE chunk (HTTP) that carries output, the output
token count (the final usage when the server reports it, as ``vllm bench serve`` does
with ``--use-server-token-count`` semantics), prompt and cached tokens. Greedy,
``ignore_eos`` (the output length is the workload's), one request per prompt.
``queue_depth`` samples the server's queues where the API exposes them (gRPC
``GetStatus``: waiting, running and reserved requests summed over the workers).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Protocol

from .metrics import RequestRecord


class TargetError(RuntimeError):
    """The target cannot be used at all (nothing answers there, it refuses the harness's
    questions): one line saying what was tried and what to do; the run does not start."""


def is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


class Backend(Protocol):
    name: str

    async def __aenter__(self) -> Backend: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def send(self, prompt: list[int], output_len: int, rec: RequestRecord,
                   timeout_s: float) -> None: ...

    async def queue_depth(self) -> tuple[int, int, int] | None: ...


class GrpcBackend:
    """The router's public gRPC API (``pdserve.v1.PDServe/Generate``)."""

    name = "grpc"

    def __init__(self, target: str, api_key: str | None = None,
                 tls_ca: str | None = None) -> None:
        from router.client import AsyncClient

        self.target = target
        self._client = AsyncClient(target, tls_ca, api_key=api_key)

    async def __aenter__(self) -> GrpcBackend:
        await self._client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.__aexit__(*exc)

    async def send(self, prompt: list[int], output_len: int, rec: RequestRecord,
                   timeout_s: float) -> None:
        async for msg in self._client.stream(prompt, timeout=timeout_s, max_tokens=output_len,
                                             temperature=0.0, ignore_eos=True):
            if msg.token_ids:
                rec.token_times.append(time.monotonic())
                rec.output_tokens += len(msg.token_ids)
            if msg.finish_reason:
                rec.cached_tokens = msg.usage.cached_tokens
                rec.prompt_tokens = msg.usage.prompt_tokens or rec.prompt_tokens

    async def queue_depth(self) -> tuple[int, int, int] | None:
        try:
            status = await self._client.status(timeout=2.0)
        except Exception:  # noqa: BLE001 - a missed sample, not a failed run
            return None
        ws = [w for w in status.workers if w.serving]
        return (sum(w.waiting_requests for w in ws), sum(w.running_requests for w in ws),
                sum(w.reserved_requests for w in ws))


class OpenAIBackend:
    """An OpenAI-compatible server's ``/v1/completions`` with ``stream: true`` and
    ``stream_options.include_usage`` (pdserve's HTTP front, vLLM, SGLang, ...). The
    prompt goes as token ids; vLLM's extensions ``ignore_eos`` is sent too."""

    name = "openai"

    def __init__(self, base_url: str, model: str | None = None,
                 api_key: str | None = None) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = None

    async def __aenter__(self) -> OpenAIBackend:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                              headers=self._headers)
        if self.model is None:  # the server's first model, as the peers' clients do
            url = f"{self.base_url}/v1/models"
            try:
                async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=10)
                                             ) as r:
                    r.raise_for_status()
                    self.model = (await r.json())["data"][0]["id"]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, LookupError,
                    TypeError) as e:
                await self._session.close()
                raise TargetError(f"cannot list the models at {url}: "
                                  f"{e or type(e).__name__}") from None
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, prompt: list[int], output_len: int, rec: RequestRecord,
                   timeout_s: float) -> None:
        import aiohttp

        body = {"model": self.model, "prompt": prompt, "max_tokens": output_len,
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        assert self._session is not None
        async with self._session.post(f"{self.base_url}/v1/completions", json=body,
                                      timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
            chunks = 0
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("choices") and event["choices"][0].get("text"):
                    rec.token_times.append(time.monotonic())
                    chunks += 1
                usage = event.get("usage")
                if usage:
                    rec.output_tokens = int(usage.get("completion_tokens") or chunks)
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = int(details.get("cached_tokens") or 0)
            if not rec.output_tokens:
                rec.output_tokens = chunks

    async def queue_depth(self) -> tuple[int, int, int] | None:
        return None
