"""OpenAI's Responses API (``POST /v1/responses``): the subset vLLM serves for text models,
as a translation onto the chat path (lifecycle steps 2, 3 and 5 of :mod:`router.openai`).

One request's lifecycle:

2. **Parse** (:func:`parse_responses`): every Responses field this front knows is checked
   here, and a bad one is a 400 naming it in Responses terms (``input[2].content[0].type``,
   ``tools[0].name``, ``text.format.schema``); a field that asks for something pdserve
   cannot do (stored state, hosted tools, images, ...) is refused the same way.
3. **Translate**: the body is rewritten as a chat body (``instructions`` a system message
   first; message items as messages; ``function_call`` items as an assistant's
   ``tool_calls``, ``function_call_output`` items as ``tool`` messages; flat function
   tools as chat tools; ``text.format`` as ``response_format``; ``max_output_tokens`` as
   ``max_completion_tokens``) and :func:`.protocol.parse_request` makes the one
   ``GenerateRequest`` from it, so tools, grammars and structured output behave exactly as
   on ``/v1/chat/completions``. The request id is ``resp_<hex>``. A refusal of the chat
   layer is renamed into Responses terms (:func:`_in_responses_terms`).
4. **Drive** (:mod:`.app`, shared with the other generation routes).
5. **Answer** (:mod:`.responses_events`): output items as Responses events, or folded
   into one response object.

Fields
------
Served: ``model``, ``input`` (a string, or a list of items: messages ``{"role": "user" |
"system" | "developer" | "assistant", "content": str | [{"type": "input_text" |
"output_text", "text"}]}`` (``type: "message"`` optional; parts joined with ``"\\n"``),
``function_call`` items ``{"call_id", "name", "arguments"}`` and ``function_call_output``
items ``{"call_id", "output"}`` answering one of them), ``instructions``,
``max_output_tokens`` (default: the rest of the context), ``temperature``, ``top_p``,
``stream``, ``tools`` (``{"type": "function", "name", "description", "parameters"}``),
``tool_choice`` (``"none"``, ``"auto"``, ``"required"``, ``{"type": "function",
"name"}``), ``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``,
``json_schema`` with ``schema``). vLLM's sampling extensions pass through as on chat:
:data:`PASSED_THROUGH`.

Refused unless absent or neutral (:data:`REFUSED`): ``previous_response_id`` and
``conversation`` (nothing is stored: send the whole conversation in ``input``),
``store: true``, ``background: true``, ``prompt``, ``include``, ``truncation: "auto"``,
``max_tool_calls``, ``top_logprobs`` > 0.

Ignored: ``metadata`` (echoed), ``user`` (echoed), ``reasoning``, ``service_tier``,
``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``,
``stream_options``, ``text.verbosity``, a tool's ``strict``, an item's ``id`` and
``status``, and any field not named here.

Plain Python, no I/O.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.errors import RouterError

from .protocol import (
    CHAT_TEXT_PART_SEPARATOR,
    UINT32_MAX,
    Call,
    Fields,
    RouterLike,
    bad,
    describe,
    parse_request,
)
from .tool_parsers import DEFAULT_PARSER
from .tools import TOOL_CHOICES, check_name

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")

PASSED_THROUGH = ("seed", "top_k", "min_p", "repetition_penalty", "stop", "ignore_eos",
                  "cache_salt")
"""vLLM's sampling extensions, checked by :mod:`.protocol` under the same names."""


def _never(v: Any) -> bool:
    return False


NO_STORAGE = "this server stores nothing: send the whole conversation in input (earlier " \
             "output items may be sent back as input items)"

# name -> (accepts, why). Checked only when the field is present and not null.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "previous_response_id": (_never, f"previous_response_id is not supported; {NO_STORAGE}"),
    "conversation": (_never, f"conversation is not supported; {NO_STORAGE}"),
    "store": (lambda v: v is False, "store: true is not supported (no response is stored); "
                                    "leave store unset or false"),
    "background": (lambda v: v is False, "background responses are not supported (nothing "
                                         "is stored to poll); leave background unset or false"),
    "prompt": (_never, "prompt (a stored prompt template) is not supported; send "
                       "instructions and input"),
    "include": (lambda v: v == [], "include is not supported: no extra output data "
                                   "(logprobs, encrypted reasoning, ...) is produced"),
    "truncation": (lambda v: v == "disabled", "truncation \"auto\" is not supported: an "
                                              "input longer than the context is refused, "
                                              "never truncated"),
    "max_tool_calls": (_never, "max_tool_calls is not supported; set parallel_tool_calls "
                               "to false for at most one call"),
    "top_logprobs": (lambda v: v == 0 and not isinstance(v, bool),
                     "top_logprobs is not supported on /v1/responses; use "
                     "/v1/chat/completions with logprobs"),
}

_RENAMES = ((re.compile(r"tools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"tool_choice\.function\."), "tool_choice."),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"))
"""Chat-layer names -> the Responses fields they were made from."""


def _in_responses_terms(exc: RouterError) -> RouterError:
    """A refusal of the chat layer with its field (and text) named as the client sent it."""
    message, field = exc.message, exc.field
    for pattern, repl in _RENAMES:
        message = pattern.sub(repl, message)
        field = pattern.sub(repl, field) if field is not None else None
    return RouterError(exc.code, message, field, retry_after_s=exc.retry_after_s)


# --------------------------------------------------------------------------- request


@dataclass(frozen=True)
class ResponsesCall:
    """One parsed ``/v1/responses`` request: the chat :class:`.protocol.Call` the router is
    driven with, and the request fields the response object repeats (``echo``)."""

    call: Call
    echo: dict[str, Any]


def parse_responses(body: dict[str, Any], router: RouterLike, *,
                    tool_format: str = DEFAULT_PARSER) -> ResponsesCall:
    """Validate a Responses body and translate it; raises RouterError/ApiError naming the
    field (see the module docstring for what is served, refused and ignored)."""
    f = Fields(body)
    for name, (accepts, why) in REFUSED.items():
        v = body.get(name)
        if v is not None and not accepts(v):
            shown = json.dumps(v, ensure_ascii=False, allow_nan=True)
            raise bad(name, f"{why}; got {name}={shown[:60]}")
    chat: dict[str, Any] = {name: body[name] for name in ("model", *PASSED_THROUGH)
                            if name in body}
    instructions = f.str_("instructions")
    chat["messages"] = _messages(body.get("input"), instructions)
    chat["stream"] = bool(f.bool_("stream"))
    max_output = f.int_("max_output_tokens", 1, UINT32_MAX)
    if max_output is not None:
        chat["max_completion_tokens"] = max_output
    for name in ("temperature", "top_p"):
        if f.number(name) is not None:
            chat[name] = body[name]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": t.get("parameters")}} for t in tools]
    tool_choice = _tool_choice(body.get("tool_choice"))
    if tool_choice is not None:
        chat["tool_choice"] = tool_choice if isinstance(tool_choice, str) else {
            "type": "function", "function": {"name": tool_choice["name"]}}
    parallel = f.bool_("parallel_tool_calls")
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    text_format = _text_format(body.get("text"))
    if text_format["type"] != "text":
        chat["response_format"] = _response_format(text_format)
    try:
        call = parse_request(chat, router, chat=True, tool_format=tool_format)
    except RouterError as exc:
        raise _in_responses_terms(exc) from None
    call.id = call.req.request_id = f"resp_{uuid.uuid4().hex}"
    metadata = body.get("metadata")
    echo = {
        "instructions": instructions, "max_output_tokens": max_output,
        "metadata": metadata if isinstance(metadata, dict) else None,
        "parallel_tool_calls": parallel is not False, "temperature": chat.get("temperature"),
        "top_p": chat.get("top_p"), "text": {"format": text_format},
        "tool_choice": tool_choice if tool_choice is not None else "auto" if tools else "none",
        "tools": [{"type": "function", "name": t["name"], "description": t.get("description"),
                   "parameters": t.get("parameters"), "strict": t.get("strict")}
                  for t in tools],
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    return ResponsesCall(call, echo)


def _messages(v: Any, instructions: str | None) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if v is None:
        raise bad("input", "input is required: a string, or a list of message, "
                           "function_call and function_call_output items")
    if isinstance(v, str):
        return [*out, {"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise bad("input", "input must be a string or a non-empty list of items, got "
                           f"{describe(v)}")
    calls: set[str] = set()  # call_ids of the function_call items so far
    for i, item in enumerate(v):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where} must be an object (a message or function call item), "
                             f"got {describe(item)}")
        kind = item.get("type") or "message"
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, "
                                           f"got {describe(role)}")
            out.append({"role": role, "content": _text(item.get("content"),
                                                        f"{where}.content")})
        elif kind == "function_call":
            call = _function_call(item, where)
            calls.add(call["id"])
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            last = out[-1] if out else None
            if last is None or not (last["role"] == "tool" or last.get("tool_calls")):
                raise bad(where, f"{where}: a function_call_output answers a function_call "
                                 "item; it must follow one (or another function_call_output)")
            call_id = _str(item, "call_id", where)
            if call_id not in calls:
                raise bad(f"{where}.call_id", f"{where}.call_id {call_id[:40]!r} answers no "
                                              "function_call item earlier in input")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item.get("output"), f"{where}.output")})
        else:
            raise bad(f"{where}.type", f"{where}.type {describe(kind)} is not supported; use "
                                       "message, function_call or function_call_output")
    return out


def _str(item: dict[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad(f"{where}.{key}", f"{where}.{key} must be a string, got {describe(v)}")
    return v


def _text(content: Any, where: str) -> str:
    """A string, or a list of ``input_text``/``output_text`` parts, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"{where} must be a string or a list of input_text parts, got "
                         f"{describe(content)}")
    texts = []
    for j, part in enumerate(content):
        pwhere = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad(f"{pwhere}.type", f"{pwhere}: only text parts ({', '.join(TEXT_PARTS)}) "
                                        f"are supported, got {describe(kind or part)}")
        texts.append(_str(part, "text", pwhere))
    return CHAT_TEXT_PART_SEPARATOR.join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as a chat ``tool_calls`` entry (arguments checked)."""
    call_id = _str(item, "call_id", where)
    name = check_name(item.get("name"), f"{where}.name")
    arguments = _str(item, "arguments", where)
    try:
        parsed = json.loads(arguments or "{}")
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise bad(f"{where}.arguments", f"{where}.arguments must be the JSON text of an "
                                        f"object, got {arguments[:40]!r}")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments or "{}"}}


def _tools(v: Any) -> list[dict[str, Any]]:
    """Responses function tools (flat); their values are :mod:`.tools`' to check."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise bad("tools", "tools must be a list of {\"type\": \"function\", \"name\", "
                           f"\"description\", \"parameters\"}} objects, got {describe(v)}")
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(where, f"{where} must be an object, got {describe(t)}")
        if t.get("type") != "function":
            raise bad(f"{where}.type", f"{where}.type {describe(t.get('type'))} is not "
                                       "supported: only function tools are (no hosted tools)")
        if "function" in t and "name" not in t:
            raise bad(where, f"{where}: Responses tools are flat, {{\"type\": \"function\", "
                             "\"name\", \"description\", \"parameters\"}; the nested "
                             "\"function\" object is the chat API's shape")
        check_name(t.get("name"), f"{where}.name")
    return v


def _tool_choice(v: Any) -> str | dict[str, Any] | None:
    if v is None or (isinstance(v, str) and v in TOOL_CHOICES):
        return v
    if isinstance(v, dict) and v.get("type") == "function":
        return {"type": "function", "name": check_name(v.get("name"), "tool_choice.name")}
    raise bad("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                             f"{{\"type\": \"function\", \"name\": ...}}, got {describe(v)}")


def _text_format(v: Any) -> dict[str, Any]:
    """``text.format``, checked (default ``{"type": "text"}``)."""
    if v is not None and not isinstance(v, dict):
        raise bad("text", f"text must be an object with format, got {describe(v)}")
    fmt = (v or {}).get("format")
    if fmt is None:
        return {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise bad("text.format", "text.format must be {\"type\": \"text\"}, {\"type\": "
                                 "\"json_object\"} or {\"type\": \"json_schema\", \"name\", "
                                 f"\"schema\"}}, got {describe(fmt)}")
    if not isinstance(fmt.get("schema"), dict):
        raise bad("text.format.schema", "text.format.schema must be a JSON schema object, got "
                                        f"{describe(fmt.get('schema'))}")
    name = fmt.get("name", "response")
    strict = fmt.get("strict")
    if not isinstance(name, str):
        raise bad("text.format.name", f"text.format.name must be a string, got {describe(name)}")
    if strict is not None and not isinstance(strict, bool):
        raise bad("text.format.strict", "text.format.strict must be true or false, got "
                                        f"{describe(strict)}")
    out = {"type": "json_schema", "name": name, "schema": fmt["schema"], "strict": strict}
    if isinstance(fmt.get("description"), str):
        out["description"] = fmt["description"]
    return out


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"],
                                                   "strict": fmt["strict"]}}
