"""Router messages -> OpenAI Responses events and body (lifecycle step 5 of
``POST /v1/responses``; the request half is :mod:`.responses_api`).

The chat :class:`.render.Renderer`'s chunks (content pieces, tool-call starts and argument
pieces, the finish reason) become output items: a ``message`` item with one
``output_text`` part, and a ``function_call`` item per call, in the order generated.
Streamed as Responses server-sent events (``event: <type>`` + ``data: {...}`` with
``sequence_number``): ``response.created``, ``response.in_progress``, per item
``response.output_item.added``, (message) ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, (call) ``response.function_call_arguments.delta``...,
``.done``, then ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when cut short: ``incomplete_details.reason``
``max_output_tokens``). No ``[DONE]`` (OpenAI sends none). A failure after the stream
began is an ``error`` event and a ``response.failed``. Not streamed, the same events are
folded and the final response object is the body, so both add up to the same output.

Plain Python, no I/O; a :class:`ResponsesRenderer` belongs to one request.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from protos.pdserve.v1 import api_pb2, common_pb2

from .protocol import ApiError, dumps_event
from .render import Renderer, Strings
from .responses_api import ResponsesCall


def sse_event(obj: dict[str, Any]) -> bytes:
    """One Responses server-sent event: its ``type`` as the event name, then the JSON."""
    return f"event: {obj['type']}\ndata: {dumps_event(obj)}\n\n".encode()


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat usage in Responses terms. ``cache_write_tokens`` (OpenAI's explicit cache
    breakpoints, which pdserve does not have) is 0: newer clients require the field."""
    cached = chat["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


class ResponsesRenderer:
    """Router messages -> Responses events and body, for one request (see the module
    docstring). Keeps the output items as they grow; at most one is open (the last).
    :meth:`opening`, :meth:`events`, :meth:`closing` and :meth:`failure` give the SSE
    bytes of a stream, :meth:`body` the whole response; not thread-safe."""

    def __init__(self, parsed: ResponsesCall, token_strings: Strings,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        self.call = parsed.call
        self.echo = parsed.echo
        self.chat = Renderer(parsed.call, token_strings, decode)
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.calls: dict[int, dict[str, Any]] = {}  # the chat tool-call index -> its item
        self.finish: str | None = None  # the chat finish reason

    # -- the response object

    def response(self, status: str) -> dict[str, Any]:
        """The response object now (``usage`` once finished)."""
        incomplete = {"reason": "max_output_tokens"} if self.finish == "length" else None
        return {"id": self.call.id, "object": "response", "created_at": self.call.created,
                "status": status, "background": False, "error": None,
                "incomplete_details": incomplete, "model": self.call.model,
                "output": list(self.items), "previous_response_id": None, "reasoning": None,
                "store": False, "truncation": "disabled", **self.echo,
                "usage": _usage(self.chat.usage_json()) if self.finish else None}

    def _status(self) -> str:
        return "completed" if self.finish in ("stop", "tool_calls") else "incomplete"

    # -- events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _feed(self, msg: api_pb2.GenerateResponse) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for chunk in self.chat.chunks(msg):
            [choice] = chunk["choices"]
            delta = choice["delta"]
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for piece in delta.get("tool_calls") or ():
                out += self._call_delta(piece)
            if choice["finish_reason"] is not None:
                self.finish = choice["finish_reason"]
        if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED and self.finish:
            if not self.items:  # an empty answer is still one (empty) message
                out += self._open_message()
            out += self._close()
            status = self._status()
            out.append(self._event(f"response.{status}", response=self.response(status)))
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        out = self._close()
        item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                "role": "assistant", "content": []}
        self.open = item
        self.items.append(item)
        index = len(self.items) - 1
        out.append(self._event("response.output_item.added", output_index=index,
                               item=dict(item, content=[])))
        item["content"].append({"type": "output_text", "text": "", "annotations": []})
        out.append(self._event("response.content_part.added", item_id=item["id"],
                               output_index=index, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        out = [] if self.open is not None and self.open["type"] == "message" \
            else self._open_message()
        assert self.open is not None
        self.open["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                               output_index=len(self.items) - 1, content_index=0,
                               delta=text, logprobs=[]))
        return out

    def _call_delta(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        fn = piece.get("function") or {}
        if "id" in piece:  # a call starts
            out += self._close()
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": piece["id"], "name": fn.get("name", ""), "arguments": "",
                    "status": "in_progress"}
            self.open = self.calls[piece["index"]] = item
            self.items.append(item)
            out.append(self._event("response.output_item.added",
                                   output_index=len(self.items) - 1, item=dict(item)))
        item = self.calls[piece["index"]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta",
                                   item_id=item["id"], output_index=self.items.index(item),
                                   delta=fn["arguments"]))
        return out

    def _close(self) -> list[dict[str, Any]]:
        """The done events of the open item, if any."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed" if self.finish in (None, "stop", "tool_calls") \
            else "incomplete"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=part["text"],
                                   logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=part))
        else:
            out.append(self._event("response.function_call_arguments.done",
                                   item_id=item["id"], output_index=index, name=item["name"],
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    # -- what the driver calls (the shape of .app's answers)

    def opening(self) -> list[bytes]:
        created = self._event("response.created", response=self.response("in_progress"))
        progress = self._event("response.in_progress", response=self.response("in_progress"))
        return [sse_event(created), sse_event(progress)]

    def events(self, msg: api_pb2.GenerateResponse) -> list[bytes]:
        return [sse_event(e) for e in self._feed(msg)]

    def closing(self) -> list[bytes]:
        return []  # response.completed went with the last message; no [DONE]

    def failure(self, err: ApiError) -> list[bytes]:
        """An error after the stream began: an ``error`` event, then ``response.failed``."""
        error = self._event("error", code=err.code, message=err.message, param=err.param)
        failed = self.response("failed")
        # response.error.code is one of OpenAI's fixed codes; the error event has ours.
        code = ("rate_limit_exceeded" if err.status == 429 else
                "invalid_prompt" if err.status < 500 else "server_error")
        failed["error"] = {"code": code, "message": err.message}
        return [sse_event(error), sse_event(self._event("response.failed", response=failed))]

    def body(self, msgs: Sequence[api_pb2.GenerateResponse]) -> dict[str, Any]:
        """The whole response: the stream's events folded (so both always agree)."""
        for m in msgs:
            self._feed(m)
        return self.response(self._status())
