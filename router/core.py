"""The router's request lifecycle, shared by the gRPC API and the OpenAI HTTP front.

A request passes through:

1. **validate** (model name, sampling values, prompt present and within the edge's
   bounds (:mod:`router.edge`), roles of chat messages, length against the workers'
   context) and **tokenize** (chat template for messages) on the tokenizer's own thread,
   never on the event loop; a bad field is INVALID_ARGUMENT naming it. The caller's
   tenant salts the request's cache namespace (:func:`router.auth.tenant_salt`).
2. **admit**: at most ``max_in_flight`` requests at once, and the caller's tenant within
   its limits (:mod:`router.limits`); beyond either RESOURCE_EXHAUSTED at once, never a
   queue that hangs.
3. **route and call**: one attempt runs on the workers through
   :class:`router.dispatch.Dispatcher` (disaggregated: reserve on a decode worker ->
   prefill -> commit -> decode stream; or one mixed worker), which picks workers with
   :class:`router.choice.Chooser` (routing policy + :mod:`router.prefix_lookup`) from
   the :class:`router.pool.WorkerPool` (connection, discovery, health, load).
4. **relay**: the tokens stream back, prompt ids on the first message, usage, timings
   and routing on the last.
5. **choices**: a request of ``n`` choices runs as one attempt (the prompt computed
   and its KV moved once, :mod:`router.dispatch`); each message names its choice
   (``index``), each choice ends with its own finish reason and usage (its tokens),
   and the request ends when every choice has.
6. **migrate** (Dynamo's name for it): when the worker generating a request fails
   mid-stream (it died, its transport broke), the request moves to another worker with
   the prompt plus the tokens already streamed as its new prompt and ``max_tokens``
   reduced by them, at most ``migration_limit`` times (moves of all choices counted
   together); the client sees one uninterrupted stream. After a failed attempt of
   several choices, each unfinished choice moves on its own, one after the other (as
   a request of one choice, with its seed). Greedy output is unchanged by a move.
   Seeded sampling restarts its random stream at the move, and text a stop-string
   check was still holding back on the failed worker is lost (the token ids are not).
   Past the limit the request fails with UNAVAILABLE.

Who is calling (:class:`router.auth.Principal`, from the edge's authentication; None:
a router without keys, :data:`router.auth.OPEN`) decides the salt, the limits, and
whether the last message's ``routing`` names workers: only admin callers see worker
addresses and indexed cached tokens.

When the consumer stops early (client cancelled or disconnected, deadline passed) every
worker call is cancelled, and the workers abort the request and free its blocks.

Metrics (``common.metrics``, names after vLLM's and Dynamo's frontend): requests by
final status, in flight, TTFT, inter-token latency, end-to-end latency, tokens, cached
tokens, routing decisions by policy and reason, migrations.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jinja2
import redis

from common.cost_model import load_profile
from common.metrics import Metrics
from common.prefix_index import PrefixIndexBackend, RedisPrefixIndex
from common.redis_url import connect as connect_redis
from common.registry import WorkerRegistry
from common.request import Request
from common.sampling import InvalidRequestError, check_prompt, check_sampling_vocab
from common.threads import TOKENIZER, name_native_thread
from common.traffic import TrafficLog, TrafficRecord
from common.wire import sampling_from_proto
from protos.pdserve.v1 import api_pb2, common_pb2, worker_pb2

from . import edge
from .adaptive import PrefillPlacement
from .auth import OPEN, Principal, tenant_salt
from .choice import Chooser, PromptHashes
from .config import RouterConfig
from .dispatch import Dispatcher
from .errors import RouterError, WorkerFailed
from .limits import TenantLimiter
from .lineage import Lineage
from .policies import make_policy
from .pool import Connect, RegistryLike, Worker, WorkerPool, grpc_connect
from .prefix_lookup import PrefixLookup

log = logging.getLogger(__name__)

ADMIN_ROUTING_FIELDS = ("worker", "decode_worker", "indexed_cached_tokens",
                        "estimated_prefill_tokens")
"""What ``routing`` tells only admin callers: where the request ran and what the shared
index says is cached there (the cluster's layout and other requests' traces). Others
see the policy, the reason and the migrations."""


def _status_of(e: BaseException) -> str:
    """The ``requests_total`` status of a request that failed with ``e`` (not a
    RouterError) before it was admitted."""
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED"
    return "INTERNAL"


@dataclasses.dataclass
class _Choice:
    """One choice's tokens so far (what a migration continues) and its last token's time."""

    last_token_at: float
    generated: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Noted:
    """A request's entry in the traffic log (:mod:`common.traffic`): noted when admitted,
    replaced when it ends."""

    key: str
    arrival: float
    """Unix time, once for both records."""
    cached: int = 0
    """The prompt tokens its last choice found cached (set when that choice finishes)."""
    parent: str = ""
    """The key of the earlier request whose prompt this one's begins with
    (:mod:`router.lineage`; "": none)."""


class _Relay:
    """Worker stream messages -> public responses: prompt ids first, timings last."""

    def __init__(self, request_id: str, prompt_ids: list[int], received: float) -> None:
        self.request_id, self.prompt_ids, self.received = request_id, prompt_ids, received
        self.first = True
        self.prompt_logprobs_sent = False
        self.first_token_at: float | None = None

    def convert(self, msg: worker_pb2.WorkerGenerateResponse,
                now: float) -> api_pb2.GenerateResponse:
        """``msg`` as the client's message; ``now``: when it came (monotonic), the same
        reading the router times the choice's tokens with."""
        out = api_pb2.GenerateResponse(request_id=self.request_id, token_ids=msg.token_ids,
                                       text=msg.text, logprobs=msg.logprobs)
        if self.first:
            out.prompt_token_ids.extend(self.prompt_ids)
            self.first = False
        if msg.prompt_logprobs and not self.prompt_logprobs_sent:  # once (a recompute
            out.prompt_logprobs.extend(msg.prompt_logprobs)       # sends them again)
            self.prompt_logprobs_sent = True
        if self.first_token_at is None and msg.token_ids:
            self.first_token_at = now
        if msg.finish_reason:
            out.finish_reason = msg.finish_reason
            out.usage.CopyFrom(msg.usage)
            out.timings.CopyFrom(common_pb2.Timings(
                ttft_s=(self.first_token_at or now) - self.received, e2e_s=now - self.received,
                queue_s=msg.queue_s))
        return out


def _latencies(relay: _Relay, choices: list[_Choice],
               finished: bool) -> tuple[float | None, float | None]:
    """A finished request's ``(ttft_s, e2e_s)`` for the traffic log: its first token
    (any choice's, as its relay timed it) and its last; ``(None, None)`` unless every
    choice finished and some token came. Finished is what the router handed on: a
    stream closed or cancelled after its last message (a client that stops reading at
    the finish, as the OpenAI front does) was served all the same."""
    if not finished or relay.first_token_at is None:
        return None, None
    # One clock reading a message (Router.generate): the first token's time is some
    # choice's last-token time then, so never past the last (the log's reader refuses
    # a TTFT past the E2E).
    return (relay.first_token_at - relay.received,
            max(c.last_token_at for c in choices) - relay.received)


class Router:
    """The request lifecycle over a :class:`WorkerPool`, a :class:`Chooser` and a
    :class:`Dispatcher` (see the module docstring).

    ``tokenizer`` (default: the model's, from ``config.model_path``) needs
    ``__call__(text).input_ids``, ``apply_chat_template`` and ``__len__``; ``connect``
    (default :func:`router.pool.grpc_connect`) opens a worker's channel and stub;
    ``registry`` and ``index`` (default: on ``config.redis_url``, if any) are the worker
    registry and the shared prefix index. Tests pass fakes; production passes none.
    """

    def __init__(self, config: RouterConfig, metrics: Metrics | None = None, *,
                 tokenizer: Any = None, connect: Connect = grpc_connect,
                 registry: RegistryLike | None = None,
                 index: PrefixIndexBackend | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics({"model": config.model_name})
        self.model_name = config.model_name
        if tokenizer is None:
            # Imported here: transformers takes seconds to import, and tests pass a fake.
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.tokenizer = tokenizer
        # One thread: tokenizing is CPU work that must not stall the event loop, and a
        # Hugging Face tokenizer is not safe to call from several threads at once.
        self._tokenizer_thread = ThreadPoolExecutor(
            1, thread_name_prefix="pdserve-tokenize", initializer=name_native_thread,
            initargs=(TOKENIZER,))
        self.limiter = TenantLimiter(config.tenant_limits())
        self._in_flight = 0
        self._ids = itertools.count()
        self._nonce = uuid.uuid4().hex[:8]  # router replicas and restarts never collide
        self._redis: redis.Redis | None = None
        if config.redis_url and (registry is None or index is None):
            self._redis = connect_redis(config.redis_url, socket_timeout=2,
                                        socket_connect_timeout=2)
            index = (index if index is not None
                     else RedisPrefixIndex(self._redis, self.model_name))
            registry = (registry if registry is not None
                        else WorkerRegistry(self._redis, self.model_name))
        self.prefixes = PrefixLookup(index, self.metrics, budget_s=config.prefix_lookup_budget_s)
        self.traffic = TrafficLog(self._redis, self.model_name) if self._redis else None
        """Requests' shapes, admitted and finished, for the live planner (common/traffic.py)."""
        self.lineage = Lineage(self.model_name)
        """Which earlier request each prompt continues, for its traffic records."""
        self._traffic_task: asyncio.Task | None = None
        self.workers = WorkerPool(config, self.metrics, connect=connect, registry=registry,
                                  on_redis=self.prefixes.note_redis)
        self.policy = make_policy(config.policy)
        self.chooser = Chooser(self.workers, self.policy, self.prefixes, self.metrics)
        self.decisions = self.chooser.decisions  # (policy, reason) -> count
        self.dispatcher = Dispatcher(self.workers, self.chooser, _placement(config))

    def pool(self, role: str) -> list[Worker]:
        return self.workers.serving(role)

    @property
    def disaggregated(self) -> bool:
        return self.workers.disaggregated

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def max_model_len(self) -> int:
        """The smallest context limit of the workers connected so far."""
        return self.workers.max_model_len

    async def start(self) -> None:
        """Connect to every worker given and found in the registry, and wait until each
        answers (loading takes a while) and the pools can serve."""
        await self.workers.start()
        if self.traffic is not None:
            self._traffic_task = asyncio.create_task(self._flush_traffic())

    async def _flush_traffic(self, every_s: float = 1.0) -> None:
        """Write the finished requests' shapes to Redis every second (from a thread)."""
        assert self.traffic is not None
        while True:
            await asyncio.sleep(every_s)
            records = self.traffic.take()
            try:
                await asyncio.to_thread(self.traffic.flush, records)
            except redis.RedisError as e:
                log.debug("traffic log not written (%d requests): %s", len(records), e)

    async def close(self) -> None:
        if self._traffic_task is not None:
            self._traffic_task.cancel()
        self.dispatcher.stalls.close()
        await self.workers.close()
        if self._redis is not None:
            self._redis.close()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # -- validation ----------------------------------------------------------------------

    def new_request_id(self) -> str:
        """A fresh request id, unique across router replicas and restarts."""
        return f"req-{uuid.uuid4().hex[:12]}-{next(self._ids)}"

    async def tokenize(self, req: api_pb2.GenerateRequest | api_pb2.TokenizeRequest
                       ) -> list[int]:
        """The prompt as token ids: bounded here (:mod:`router.edge`), then tokenized or
        rendered with the chat template on the tokenizer's thread. Raises
        :class:`RouterError` naming the field."""
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              "prompt: set one of text, token_ids or messages", "prompt")
        loop = asyncio.get_running_loop()
        if kind == "text":
            edge.check_text_prompt(req.text)
            ids = await loop.run_in_executor(self._tokenizer_thread, self._encode, req.text)
            return list(ids)
        if kind == "token_ids":
            return list(req.token_ids.ids)
        messages = [{"role": m.role, "content": m.content} for m in req.messages.messages]
        if not messages:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              "messages: must contain at least one message", "messages")
        bad = next((m["role"] for m in messages
                    if m["role"] not in ("system", "user", "assistant")), None)
        if bad is not None:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"messages: unknown role {bad[:40]!r}; use system, user or "
                              "assistant", "messages")
        edge.check_chat(messages)
        return list(await loop.run_in_executor(self._tokenizer_thread, self._render, messages))

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """On the tokenizer's thread."""
        if add_special_tokens:  # the tokenizer's own default
            return list(self.tokenizer(text).input_ids)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        """On the tokenizer's thread. A template that raises (``raise_exception`` in
        Jinja: roles that do not alternate, a system message it does not take) refuses
        the messages: its words are the template author's, meant for the client."""
        try:
            return list(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        except jinja2.TemplateError as e:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"messages: the model's chat template refuses them: "
                              f"{str(e)[:200]}", "messages") from None

    async def validate(self, req: api_pb2.GenerateRequest,
                       caller: Principal | None = None) -> Request:
        """The public request checked once, here at the edge, into the typed
        :class:`~common.request.Request` every later step carries (its id: the client's,
        else a fresh one; its cache salt: the caller's tenant and the client's salt).
        Raises :class:`RouterError` naming the field."""
        caller = caller or OPEN
        if req.model and req.model != self.model_name:
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"model: {req.model[:100]!r} is not served here; this router "
                              f"serves {self.model_name!r}", "model")
        if req.request_id:
            edge.check_request_id(req.request_id)
        try:
            sampling = sampling_from_proto(req.sampling)
            check_sampling_vocab(sampling, len(self.tokenizer))
            if req.WhichOneof("prompt") == "token_ids":
                # Checked before copying (up to millions of ids), and only once.
                check_prompt(req.token_ids.ids, self.max_model_len, len(self.tokenizer))
                ids = list(req.token_ids.ids)
            else:
                ids = await self.tokenize(req)
                check_prompt(ids, self.max_model_len, len(self.tokenizer))
            request = Request(req.request_id or self.new_request_id(), tuple(ids), sampling,
                              req.cache_salt or None, req.n or 1,
                              req.prompt_logprobs if req.HasField("prompt_logprobs") else None)
        except InvalidRequestError as e:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from e
        if caller.tenant:
            request = dataclasses.replace(
                request, cache_salt=tenant_salt(caller.tenant, request.cache_salt))
        return request

    # -- the request lifecycle -------------------------------------------------------------

    def count_sent(self, hop: str, nbytes: int) -> None:
        """One stream message of ``nbytes`` on ``hop`` (``grpc``, ``http``; the router
        counts ``worker`` itself): messages and bytes per token, per hop."""
        self.metrics.inc("stream_messages_total", hop=hop)
        self.metrics.inc("stream_bytes_total", nbytes, hop=hop)

    async def generate(
        self, req: api_pb2.GenerateRequest, timeout: float | None = None,
        caller: Principal | None = None,
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        """Validated, admitted, routed, relayed, migrated. See the module docstring.
        ``caller``: who asks (None: :data:`router.auth.OPEN`, a router without keys)."""
        received = time.monotonic()
        status = "OK"
        caller = caller or OPEN
        lease = None
        try:
            # The tenant's concurrency before any work on the request, its tokens once
            # the prompt's length is known (router/limits.py).
            lease = self.limiter.admit(caller.tenant, caller.limits)
            request = await self.validate(req, caller)
            if self._in_flight >= self.config.max_in_flight:
                raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  f"the router has {self._in_flight} requests in flight, its "
                                  f"limit (max_in_flight={self.config.max_in_flight}); retry "
                                  "later", retry_after_s=1)
            lease.reserve(self._reserve(request))
        except BaseException as e:
            if lease is not None:
                lease.settle(0)
            self.metrics.inc("requests_total", status=e.code.name
                             if isinstance(e, RouterError) else _status_of(e))
            raise
        request_id, ids = request.request_id, list(request.prompt_token_ids)
        relay = _Relay(request_id, ids, received)
        choices = [_Choice(received) for _ in range(request.n)]
        open_ = set(range(request.n))  # choices not ended yet
        solo: int | None = None  # after a failed attempt of several choices: one at a time
        hashes = PromptHashes()  # hashed once, for every attempt
        migrations = 0
        self._in_flight += 1
        self.metrics.set("requests_in_flight", self._in_flight)
        noted: _Noted | None = None
        try:
            noted = self._note_admitted(request, received)  # a failure here is this one's
            while open_:
                routing = api_pb2.Routing()
                if solo is None:
                    wreq = self._worker_request(request, choices[0].generated)
                else:
                    wreq = self._worker_request(request.choice(solo, request_id),
                                                choices[solo].generated)
                source = self.dispatcher.stream(wreq, timeout, routing, hashes)
                try:
                    async for msg in source:
                        index = msg.index if solo is None else solo
                        if index not in open_:
                            continue
                        self.count_sent("worker", msg.ByteSize())
                        now = time.monotonic()
                        self._observe_tokens(choices, index, msg, received, now)
                        out = relay.convert(msg, now)
                        out.index = index
                        if msg.finish_reason:
                            open_.discard(index)
                            self._finish(out, routing, ids, choices, index, migrations,
                                         received, caller, last=not open_, noted=noted)
                        yield out
                    unfinished = open_ if solo is None else open_ & {solo}
                    if unfinished:  # a stream that ends early is a failed attempt
                        raise WorkerFailed(f"the worker ended the stream of request "
                                           f"{request_id} with choices {sorted(unfinished)} "
                                           "unfinished")
                    solo = min(open_, default=None)  # the next choice to move, if any
                except WorkerFailed as e:
                    if not open_:  # every choice finished: only the stream's end was lost
                        break
                    generated = choices[solo if solo is not None else min(open_)].generated
                    if (migrations >= self.config.migration_limit
                            or len(generated) >= request.sampling.max_tokens):
                        raise  # out of moves, or every token came and only the end is lost
                    migrations += 1
                    self.metrics.inc("request_migrations_total")
                    log.warning("request %s moves to another worker after %d tokens (move %d "
                                "of at most %d): %s", request_id, len(generated), migrations,
                                self.config.migration_limit, e.message)
                    if request.n > 1:
                        solo = min(open_)
                finally:
                    await source.aclose()
        except RouterError as e:
            if not open_:  # every choice finished (the client has it all), and then the
                return     # deadline passed while the worker's stream was ending: served
            status = e.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED" if open_ else "OK"  # closed after its last message: served
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            output = sum(len(c.generated) for c in choices)
            lease.settle(len(ids) + output)
            if noted is not None and self.traffic is not None:  # finished, failed or gone
                ttft_s, e2e_s = _latencies(relay, choices, finished=not open_)
                self.traffic.note(TrafficRecord(noted.arrival, len(ids), noted.cached,
                                                output, noted.key, ttft_s=ttft_s,
                                                e2e_s=e2e_s, parent=noted.parent))
            self._in_flight -= 1
            self.metrics.set("requests_in_flight", self._in_flight)
            self.metrics.inc("requests_total", status=status)

    @contextlib.contextmanager
    def _tokenizer_work(self, caller: Principal | None) -> Iterator[None]:
        """Tokenizer work for a client outside a request (``Tokenize``, ``/tokenize``,
        ``/detokenize``): it is the router's own CPU work, so it holds one of the
        caller's tenant's concurrency slots while it runs."""
        caller = caller or OPEN
        lease = self.limiter.admit(caller.tenant, caller.limits)
        try:
            yield
        finally:
            lease.settle(0)

    async def tokenize_as(self, req: api_pb2.TokenizeRequest,
                          caller: Principal | None = None) -> list[int]:
        """The public ``Tokenize``: :meth:`tokenize` within the caller's tenant's
        concurrency limit."""
        with self._tokenizer_work(caller):
            return await self.tokenize(req)

    async def encode_as(self, text: str, add_special_tokens: bool,
                        caller: Principal | None = None) -> list[int]:
        """HTTP ``/tokenize`` of a text: as :meth:`tokenize_as`, but the client chooses
        whether the tokenizer adds its special tokens (BOS, ...)."""
        if add_special_tokens:
            return await self.tokenize_as(api_pb2.TokenizeRequest(text=text), caller)
        edge.check_text_prompt(text)
        with self._tokenizer_work(caller):
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_thread, self._encode, text, False)

    async def detokenize_as(self, ids: list[int], caller: Principal | None = None) -> str:
        """HTTP ``/detokenize``: ``ids`` as text (special tokens written out), on the
        tokenizer's thread, within the caller's concurrency limit. An id outside the
        vocabulary is INVALID_ARGUMENT naming ``tokens``."""
        vocab = len(self.tokenizer)
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"tokens[{bad}]: {ids[bad]} is not in the vocabulary of "
                              f"{self.model_name!r} (ids 0 to {vocab - 1})", "tokens")
        with self._tokenizer_work(caller):
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_thread, self.tokenizer.decode, ids)

    def _reserve(self, request: Request) -> int:
        """What a request may cost at most, in tokens: its prompt and the output the
        context leaves room for (``max_tokens``, capped by it), for each choice."""
        prompt = len(request.prompt_token_ids)
        return prompt + request.n * max(0, min(request.sampling.max_tokens,
                                               self.max_model_len - prompt))

    def _note_admitted(self, request: Request, received: float) -> _Noted | None:
        """The request in the traffic log as soon as it is admitted (its output: the most
        ``max_tokens`` allows), so that the planner sees requests in flight. The record
        that replaces it (the same key and arrival: :mod:`common.traffic`) is noted when
        the request ends, finished or not, with the output it had."""
        if self.traffic is None:
            return None
        key = f"{self._nonce}-{next(self._ids)}"
        noted = _Noted(key, time.time() - (time.monotonic() - received),
                       parent=self.lineage.link(request.prompt_token_ids, key,
                                                request.cache_salt))
        prompt = len(request.prompt_token_ids)
        self.traffic.note(TrafficRecord(noted.arrival, prompt, 0,
                                        self._reserve(request) - prompt, noted.key,
                                        done=False, parent=noted.parent))
        return noted

    def _worker_request(self, request: Request, generated: list[int]) -> Request:
        """The request a worker sees: a unique id (this router's nonce and a counter;
        clients may reuse theirs, and one request's cancellation must never reach
        another's); after a migration, the tokens so far continue the prompt."""
        return request.continued(
            generated, f"{request.request_id}#{self._nonce}-{next(self._ids)}")

    def _observe_tokens(self, choices: list[_Choice], index: int,
                        msg: worker_pb2.WorkerGenerateResponse, received: float,
                        now: float) -> None:
        """TTFT (the request's first token, whichever choice) and inter-token latency
        (within each choice) of one message's tokens, which came at ``now``."""
        if not msg.token_ids:
            return
        choice = choices[index]
        if choice.generated:
            gap = (now - choice.last_token_at) / len(msg.token_ids)
            for _ in msg.token_ids:
                self.metrics.observe("inter_token_latency_seconds", gap)
        elif not any(c.generated for c in choices):
            self.metrics.observe("time_to_first_token_seconds", now - received)
        choice.last_token_at = now
        choice.generated.extend(msg.token_ids)

    def _finish(self, out: api_pb2.GenerateResponse, routing: api_pb2.Routing, ids: list[int],
                choices: list[_Choice], index: int, migrations: int, received: float,
                caller: Principal, last: bool = True, noted: _Noted | None = None) -> None:
        """A choice's last message: usage over the whole choice (a migrated one's last
        worker saw part of the output as prompt), routing (where it ran only for
        admins); the request's metrics with the last choice's."""
        generated = choices[index].generated
        out.usage.prompt_tokens = len(ids)
        out.usage.completion_tokens = len(generated)
        out.usage.cached_tokens = min(out.usage.cached_tokens, len(ids))
        routing.migrations = migrations
        if not caller.admin:
            for name in ADMIN_ROUTING_FIELDS:
                routing.ClearField(name)
        out.routing.CopyFrom(routing)
        m = self.metrics
        m.inc("generation_tokens_total", len(generated))
        if not last:
            return
        took = time.monotonic() - received
        if noted is not None:  # the traffic log's record, noted as the request ends
            noted.cached = out.usage.cached_tokens
        m.observe("e2e_request_latency_seconds", took)
        m.inc("prompt_tokens_total", len(ids))
        m.inc("cached_prompt_tokens_total", out.usage.cached_tokens)

    async def status(self) -> api_pb2.GetStatusResponse:
        resp = api_pb2.GetStatusResponse(
            model=self.model_name, requests_in_flight=self._in_flight,
            max_requests_in_flight=self.config.max_in_flight,
            routing_decisions={f"{p}/{r}": n for (p, r), n in self.decisions.items()},
            prefix_index_up=self.prefixes.up)
        resp.workers.extend(await self.workers.statuses())
        return resp


def _placement(config: RouterConfig) -> PrefillPlacement | None:
    """The live prefill-placement rule when the router was given a machine profile."""
    if config.placement_profile is None:
        return None
    profile = dataclasses.replace(load_profile(config.placement_profile),  # their budget
                                  max_num_batched_tokens=config.max_num_batched_tokens)
    return PrefillPlacement(profile, config.decode_threads, config.prefill_threads,
                            config.itl_budget_ms / 1000, static_threshold=0,
                            kv_offer=config.kv_offer,
                            ttft_slo_s=config.ttft_slo_ms / 1000 if config.ttft_slo_ms else None)
