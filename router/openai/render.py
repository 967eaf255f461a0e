"""Router messages -> OpenAI chunks and bodies, choice by choice (lifecycle step 5).

A :class:`Renderer` lives for one request. The router's messages each belong to one
choice (``index``); each choice keeps its own state (:class:`_Choice`: the completion's
text offset, whether chat's role was sent, its tool-call reader, its finish reason and
usage), so choices may interleave in any order. What is per request: usage (the
prompt once, the completion tokens of every choice summed, as OpenAI counts ``n`` and
``best_of``), the prompt (for ``echo`` and ``prompt_logprobs``, from the first message).

``best_of`` (non-streaming only, :mod:`.protocol` refuses it streamed): the body keeps
the ``n`` choices with the highest summed token log-probability, best first, numbered
0..n-1 again; their ``logprobs`` are shown only when the client asked.

``echo`` (completions): each choice's text starts with the prompt (the request's own text,
or its token ids decoded), and with ``logprobs`` its logprobs start with the prompt's
tokens: the first token's logprob and alternatives are ``null`` (nothing precedes it),
the others come from the router's ``prompt_logprobs``.

Side-effect free apart from the state it keeps; :mod:`.app` does the I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from protos.pdserve.v1 import api_pb2, common_pb2

from .protocol import Call
from .responses import FINISH_REASONS, LOGPROB_FLOOR
from .tool_parsers import Arguments, CallStart, Content, Event, ToolStream, fold

Strings = Callable[[Sequence[int]], list[str]]


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


class _Choice:
    """One choice's rendering state."""

    def __init__(self, index: int, call: Call) -> None:
        self.index = index
        self.text_offset = 0  # completions logprobs: where the next token starts
        self.sent_first = False  # chat: the role; completions: the echoed prompt
        self.completion_tokens = 0
        self.usage: common_pb2.Usage | None = None
        self.finish_reason: str | None = None
        self.msgs: list[api_pb2.GenerateResponse] = []  # non-streaming: collected
        self.tool_stream: ToolStream | None = None
        if call.tools is not None and call.tool_parser is not None:
            self.tool_stream = call.tool_parser.stream(call.tools.names, call.tools.forced)
        self.called = False
        """A tool call was read (the finish reason is then ``tool_calls``)."""

    def observe(self, msg: api_pb2.GenerateResponse) -> None:
        self.completion_tokens += len(msg.token_ids)
        if msg.HasField("usage"):
            self.usage = msg.usage
        if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason, "abort")

    def final_reason(self) -> str | None:
        if self.called and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    def score(self) -> float:
        """``best_of``'s rank: the summed log-probability of the choice's tokens."""
        return sum(e.logprob for m in self.msgs for e in m.logprobs)


class Renderer:
    """Turns router messages into OpenAI chunks / bodies for one request."""

    def __init__(self, call: Call, token_strings: Strings,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.call = call
        self.token_strings = token_strings
        self.decode = decode or (lambda ids: "".join(token_strings(ids)))
        """Echo of a token-id prompt: the ids as text."""
        self.choices: dict[int, _Choice] = {}
        self.prompt_ids: list[int] = []
        self.prompt_logprobs: list[common_pb2.TokenLogprob] = []

    def _choice(self, msg: api_pb2.GenerateResponse) -> _Choice:
        choice = self.choices.get(msg.index)
        if choice is None:
            choice = self.choices[msg.index] = _Choice(msg.index, self.call)
        if msg.prompt_token_ids:
            self.prompt_ids = list(msg.prompt_token_ids)
        if msg.prompt_logprobs:
            self.prompt_logprobs = list(msg.prompt_logprobs)
        choice.observe(msg)
        return choice

    def usage_json(self) -> dict[str, Any]:
        usages = [c.usage for c in self.choices.values() if c.usage is not None]
        p = usages[0].prompt_tokens if usages else len(self.prompt_ids)
        c = sum(ch.usage.completion_tokens if ch.usage is not None else ch.completion_tokens
                for ch in self.choices.values())
        k = max((u.cached_tokens for u in usages), default=0)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": k}}

    # -- logprobs

    def _strings(self, entries: Sequence[common_pb2.TokenLogprob]) -> tuple[list[str], list[str]]:
        ids = [e.token_id for e in entries]
        top_ids = [t.token_id for e in entries for t in e.top]
        strings = self.token_strings(ids + top_ids)
        return strings[:len(ids)], strings[len(ids):]

    def completion_logprobs(self, choice: _Choice, entries: Sequence[common_pb2.TokenLogprob],
                            echo: bool = False) -> dict[str, Any]:
        """OpenAI's legacy logprobs; with ``echo`` the prompt's tokens come first."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        if echo and self.prompt_ids:
            first = self.token_strings(self.prompt_ids[:1])[0]
            out["tokens"].append(first)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(choice.text_offset)
            choice.text_offset += len(first)
            self._legacy(choice, self.prompt_logprobs, out)
        self._legacy(choice, entries, out)
        return out

    def _legacy(self, choice: _Choice, entries: Sequence[common_pb2.TokenLogprob],
                out: dict[str, Any]) -> None:
        tokens, top_strings = self._strings(entries)
        k = 0
        for e, tok in zip(entries, tokens, strict=True):
            top: dict[str, float] = {}
            for t in e.top:
                top[top_strings[k]] = _lp(t.logprob)
                k += 1
            top.setdefault(tok, _lp(e.logprob))
            out["tokens"].append(tok)
            out["token_logprobs"].append(_lp(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(choice.text_offset)
            choice.text_offset += len(tok)

    def chat_logprobs(self, entries: Sequence[common_pb2.TokenLogprob]) -> list[dict[str, Any]]:
        tokens, top_strings = self._strings(entries)
        content = []
        k = 0
        for e, tok in zip(entries, tokens, strict=True):
            top = []
            for t in e.top:
                s = top_strings[k]
                k += 1
                top.append({"token": s, "logprob": _lp(t.logprob), "bytes": list(s.encode())})
            content.append({"token": tok, "logprob": _lp(e.logprob),
                            "bytes": list(tok.encode()), "top_logprobs": top})
        return content

    def prompt_logprobs_json(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then each
        token's ``{id: {"logprob", "rank", "decoded_token"}}`` with its alternatives."""
        if self.call.prompt_logprobs is None:
            return None
        entries = self.prompt_logprobs
        tokens, top_strings = self._strings(entries)
        out: list[dict[str, dict[str, Any]] | None] = [None]
        k = 0
        for e, tok in zip(entries, tokens, strict=True):
            d: dict[str, dict[str, Any]] = {}
            for rank, t in enumerate(e.top[: self.call.prompt_logprobs], start=1):
                d[str(t.token_id)] = {"logprob": _lp(t.logprob), "rank": rank,
                                      "decoded_token": top_strings[k + rank - 1]}
            k += len(e.top)
            d[str(e.token_id)] = {"logprob": _lp(e.logprob), "rank": e.rank or None,
                                  "decoded_token": tok}
            out.append(d)
        return out

    def _echo_text(self) -> str:
        req = self.call.req
        return req.text if req.WhichOneof("prompt") == "text" else self.decode(self.prompt_ids)

    # -- streaming

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        call = self.call
        out: dict[str, Any] = {
            "id": call.id,
            "object": "chat.completion.chunk" if call.chat else "text_completion",
            "created": call.created, "model": call.model, "system_fingerprint": None,
            "choices": choices,
        }
        if call.include_usage:
            out["usage"] = None
        return out

    def chunks(self, msg: api_pb2.GenerateResponse) -> list[dict[str, Any]]:
        """The SSE chunks for one router message (none when it carries nothing to say)."""
        choice = self._choice(msg)
        call = self.call
        want_lp = call.logprobs and len(msg.logprobs) > 0
        finish = choice.final_reason() if msg.finish_reason else None
        first = not choice.sent_first
        choice.sent_first = True
        extra = {}
        if first and msg.index == 0 and call.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self.prompt_logprobs_json()
        if not call.chat:
            echo = call.echo and first
            text = (self._echo_text() if echo else "") + msg.text
            if not (text or want_lp or finish or extra):
                return []
            lp = (self.completion_logprobs(choice, msg.logprobs, echo)
                  if want_lp or (echo and call.logprobs) else None)
            return [self._envelope([{"index": msg.index, "text": text, "logprobs": lp,
                                     "finish_reason": finish, **extra}])]
        deltas = self._deltas(choice, msg.text, final=bool(msg.finish_reason))
        finish = choice.final_reason() if msg.finish_reason else None  # after the reading
        if first:
            head = deltas[0] if deltas else {"content": ""}
            deltas[:1] = [{"role": "assistant", **head}]
        if not deltas and (want_lp or finish):
            deltas = [{}]
        lp = {"content": self.chat_logprobs(msg.logprobs), "refusal": None} if want_lp \
            else None
        out = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            body = self._envelope([{"index": msg.index, "delta": delta,
                                    "logprobs": lp if i == 0 else None,
                                    "finish_reason": finish if last else None}])
            if i == 0 and extra:
                body.update(extra)  # chat: at the top, as vLLM
            out.append(body)
        return out

    def _deltas(self, choice: _Choice, text: str, final: bool) -> list[dict[str, Any]]:
        """The chat deltas for new text: the text itself, or what the choice's tool-call
        reader decides of it."""
        if choice.tool_stream is None:
            return [{"content": text}] if text else []
        events = choice.tool_stream.feed(text) if text else []
        if final:
            events += choice.tool_stream.finish()
        return [self._delta(choice, e) for e in events]

    @staticmethod
    def _delta(choice: _Choice, event: Event) -> dict[str, Any]:
        if isinstance(event, Content):
            return {"content": event.text}
        choice.called = True
        if isinstance(event, CallStart):
            return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        assert isinstance(event, Arguments)
        return {"tool_calls": [{"index": event.index,
                                "function": {"arguments": event.text}}]}

    def usage_chunk(self) -> dict[str, Any]:
        out = self._envelope([])
        out["usage"] = self.usage_json()
        return out

    # -- non-streaming

    def body(self, msgs: Sequence[api_pb2.GenerateResponse]) -> dict[str, Any]:
        for m in msgs:
            self._choice(m).msgs.append(m)
        call = self.call
        ranked = sorted(self.choices.values(), key=lambda c: c.index)
        if len(ranked) > call.n:  # best_of: the n likeliest, best first
            ranked = sorted(ranked, key=lambda c: -c.score())[: call.n]
        scored = self.prompt_logprobs_json()  # once, however many choices show it
        choices = [self._choice_body(i, c, scored) for i, c in enumerate(ranked)]
        out = {"id": call.id, "object": "chat.completion" if call.chat else "text_completion",
               "created": call.created, "model": call.model, "system_fingerprint": None,
               "choices": choices, "usage": self.usage_json()}
        if call.chat and scored is not None:
            out["prompt_logprobs"] = scored
        return out

    def _choice_body(self, index: int, choice: _Choice,
                     scored: list[dict[str, dict[str, Any]] | None] | None
                     ) -> dict[str, Any]:
        call = self.call
        text = "".join(m.text for m in choice.msgs)
        entries = [e for m in choice.msgs for e in m.logprobs]
        if not call.chat:
            lp = self.completion_logprobs(choice, entries, call.echo) if call.logprobs \
                else None
            out = {"index": index, "text": (self._echo_text() if call.echo else "") + text,
                   "logprobs": lp, "finish_reason": choice.finish_reason}
            if scored is not None:
                out["prompt_logprobs"] = scored
            return out
        lp = {"content": self.chat_logprobs(entries), "refusal": None} if call.logprobs \
            else None
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if choice.tool_stream is not None:
            parsed = fold(choice.tool_stream.feed(text) + choice.tool_stream.finish())
            message["content"] = parsed.content
            if parsed.calls:
                choice.called = True
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.calls]
        return {"index": index, "message": message, "logprobs": lp,
                "finish_reason": choice.final_reason()}
