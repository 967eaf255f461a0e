"""Client-side resume: a stream whose router dies continues on another router.

The router moves a request to another *worker* when its worker fails mid-stream
(:mod:`router.core`, "migrate"). This is the same rule one level up, run by the Python
client (:mod:`router.client`) when the *router* it streams from is gone:

1. The request goes to the client's current router. Every message passes through
   :meth:`Resume.relay`, which records the prompt ids (the router's first message always
   carries them), the request id and the token ids received so far.
2. The stream fails with a status that means "this router is gone" (:data:`RESUMABLE`).
   Anything else is the router's answer about the request and is raised unchanged.
3. :meth:`Resume.retry` builds the request that continues it: the prompt ids plus the
   tokens received as a token-ids prompt, ``max_tokens`` and ``min_tokens`` reduced by
   the tokens received, a grammar's ``prior_tokens`` advanced by them (the new worker
   re-derives its state), the same request id, cache salt and other sampling fields.
   Before the first message nothing was received, and the original request is sent
   again as it was. Never more than ``max_resumes`` times, never past the call's
   deadline, and not once every token has come (only the end was lost).
4. The next router's messages are rewritten so that the caller sees one uninterrupted
   stream: no second ``prompt_token_ids``, the first request id throughout, and on the
   last message usage over the whole request (``prompt_tokens`` the original prompt,
   ``completion_tokens`` every token, ``cached_tokens`` at most the prompt; as
   :meth:`router.core.Router._finish` does for a migration) and timings as the client
   measured them (the routers' own each saw only a part).

A request of several choices (``n`` > 1) is not resumed: its error is raised.

Limits (the same as a migration's): greedy output is unchanged by a resume (tested
token for token: tests/integration/test_client_resume.py). Seeded sampling restarts its
random stream on the new router, so a resumed seeded request differs from an
undisturbed one (it is still a valid sample). ``frequency_penalty`` and
``presence_penalty`` count output tokens only, and the tokens before the resume are
prompt to the new router (``repetition_penalty`` sees prompt and output alike, so it is
unaffected). Text is detokenized by the new router from the resume point on, so text
the dead router was still holding back is lost or comes out differently (its token ids
do not): an incomplete UTF-8 character (a byte-level BPE splits many characters over
tokens; the tiny test models write stray bytes often) and the characters that could
begin a stop string; a stop string that straddles the resume point is not seen.
Logprobs continue for each new token. ``routing`` on the last message is the last router's (its
``migrations`` count that router's moves only). A request whose prompt plus the tokens
received fills the model's context cannot resume (the new router refuses it as
INVALID_ARGUMENT). A router that dies after the request reached a worker leaves that
worker's copy running until the worker notices the broken call (it then frees its
blocks); the resumed request prefills the prompt and the tokens so far again (the
prefix cache serves what the worker still holds of them).

Plain state, no I/O: one object per request, used from one thread (or task) at a time.
"""

from __future__ import annotations

import dataclasses
import time

import grpc

from common.wire import sampling_from_proto, sampling_to_proto
from protos.pdserve.v1 import api_pb2

RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                       grpc.StatusCode.UNKNOWN})
"""Statuses that mean the router is gone, not an answer about the request.

UNAVAILABLE: the router cannot be reached, its connection dropped (a killed process:
"Socket closed"), it shut down ("Cancelling all calls"), or it found no worker to serve
(another router may). CANCELLED: the stream was cancelled from the other side (a router
or a proxy between going away); this client never cancels a stream it still reads.
UNKNOWN: some gRPC versions report a dropped connection so ("Stream removed"); pdserve's
router never answers UNKNOWN itself (every failure leaves it with a named status).

Everything else is raised unchanged, never retried: INVALID_ARGUMENT, NOT_FOUND,
UNAUTHENTICATED and PERMISSION_DENIED would be answered the same by any router;
RESOURCE_EXHAUSTED is admission control (retrying elsewhere at once would defeat it:
the caller decides, after its ``retry-after``); DEADLINE_EXCEEDED means the call's
time is up; INTERNAL is a router's deliberate answer."""


class Resume:
    """One request's stream across routers (see the module docstring).

    ``request``: the request as first sent; ``max_resumes``: how many times it may move;
    ``timeout``: the call's whole deadline in seconds (None: none), shared by every
    router it moves through. Not thread-safe; :meth:`relay` and :meth:`retry` mutate."""

    def __init__(self, request: api_pb2.GenerateRequest, max_resumes: int,
                 timeout: float | None = None) -> None:
        self.original = request
        self.request = request
        """What to send to the next router."""
        self.max_resumes = max_resumes
        self.max_tokens = sampling_from_proto(request.sampling).max_tokens
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.prompt_ids: list[int] | None = None
        """From the first message; None until it came."""
        self.request_id = ""
        self.token_ids: list[int] = []
        self.finished = False
        self._open = max(request.n, 1)  # choices not ended
        self.resumes = 0
        self._first_token_at: float | None = None

    def time_left(self) -> float | None:
        """The timeout of the next call: what is left of the deadline (None: none)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def relay(self, msg: api_pb2.GenerateResponse) -> api_pb2.GenerateResponse:
        """``msg`` as the caller sees it, recorded (mutated in place after a resume)."""
        if self.prompt_ids is None:
            if msg.prompt_token_ids:
                self.prompt_ids = list(msg.prompt_token_ids)
        elif msg.prompt_token_ids:  # a resumed stream's first: the caller has them
            del msg.prompt_token_ids[:]
        if self.request_id:
            msg.request_id = self.request_id
        else:
            self.request_id = msg.request_id
        if msg.token_ids and self._first_token_at is None:
            self._first_token_at = time.monotonic()
        self.token_ids.extend(msg.token_ids)
        if msg.finish_reason:
            self._open -= 1
            self.finished = self._open == 0
            if self.request is not self.original:  # resumed mid-stream
                self._finish(msg)
        return msg

    def _finish(self, msg: api_pb2.GenerateResponse) -> None:
        """The last message of a resumed stream: usage over the whole request, and the
        client's timings (the last router saw the end only)."""
        assert self.prompt_ids is not None
        prompt = len(self.prompt_ids)
        msg.usage.prompt_tokens = prompt
        msg.usage.completion_tokens = len(self.token_ids)
        msg.usage.cached_tokens = min(msg.usage.cached_tokens, prompt)
        now = time.monotonic()
        msg.timings.ttft_s = (self._first_token_at or now) - self.started
        msg.timings.e2e_s = now - self.started

    def retry(self, error: grpc.RpcError) -> bool:
        """Whether the request moves on after ``error`` ended its stream; if so
        :attr:`request` is now the one that continues it and the move is counted."""
        code = error.code() if callable(getattr(error, "code", None)) else None
        if (code not in RESUMABLE or self.resumes >= self.max_resumes
                or self.original.n > 1  # a request of several choices is not resumed
                or len(self.token_ids) >= self.max_tokens
                or (self.deadline is not None and time.monotonic() >= self.deadline)):
            return False
        self.resumes += 1
        if self.prompt_ids is not None:
            self.request = self._continued()
        return True

    def _continued(self) -> api_pb2.GenerateRequest:
        """The original request continued after the tokens received (the rule of
        :meth:`common.request.Request.continued`, with ``min_tokens`` reduced too)."""
        assert self.prompt_ids is not None
        n = len(self.token_ids)
        params = sampling_from_proto(self.original.sampling)
        params = dataclasses.replace(params, max_tokens=params.max_tokens - n,
                                     min_tokens=max(0, params.min_tokens - n))
        if params.structured is not None:
            params = dataclasses.replace(params, structured=dataclasses.replace(
                params.structured, prior_tokens=params.structured.prior_tokens + n))
        out = api_pb2.GenerateRequest()
        out.CopyFrom(self.original)
        out.request_id = self.request_id or self.original.request_id
        out.token_ids.ids[:] = self.prompt_ids + self.token_ids  # replaces text/messages
        out.sampling.CopyFrom(sampling_to_proto(params))
        return out
