"""OpenAI tool calling, request side: ``tools``, ``tool_choice``, ``parallel_tool_calls``
and the tool turns of ``messages``, checked and turned into typed values.

A request's tools pass through three steps (the other two modules own the rest):

1. **Parse** (here): :func:`tool_use` reads the three fields into one :class:`ToolUse`, or
   None when no tool is offered (no ``tools``, or ``tool_choice: "none"``: the tools are
   then left out of the prompt and the output is not parsed). :func:`history_calls` reads
   an assistant message's ``tool_calls``. Every value is bounded (:data:`MAX_TOOLS`,
   :data:`NAME_PATTERN`, :data:`MAX_DESCRIPTION_CHARS`, the schema's size) and a bad one
   is a 400 naming the field, e.g. ``tools[2].function.name``, and the limit.
2. **Prompt and grammar** (:mod:`.tool_parsers`, the named parser, ``hermes`` by
   default): the tools go into the system message, earlier calls and their results into
   their turns; with ``tool_choice`` ``"required"`` or a named function, the parser's
   grammar (a ``KIND_GRAMMAR`` structured output) makes the worker sample only
   well-formed calls of the allowed functions whose arguments follow their schemas.
   ``"auto"`` is unconstrained.
3. **Answer** (:mod:`.responses` with the parser's stream): the generated text becomes
   ``content`` and ``tool_calls``, streamed or whole.

Nothing here does I/O or imports the rest of the front, so :mod:`.protocol` and
:mod:`.tool_parsers` both use it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import grpc

from common.sampling import MAX_STRUCTURED_SPEC_BYTES
from router.errors import RouterError

MAX_TOOLS = 128
"""Tools per request (OpenAI's limit too); each is an alternative of the call grammar."""

NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""OpenAI's function-name syntax; it also keeps names literal inside the grammar and the
parser (no quotes or escapes)."""

MAX_DESCRIPTION_CHARS = 8192
"""A function's description goes into every prompt that offers it."""

MAX_CALLS_PER_MESSAGE = MAX_TOOLS
"""``tool_calls`` of one assistant message in the history."""

TOOL_CHOICES = ("none", "auto", "required")

DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function declared without ``parameters`` takes none (OpenAI's reading)."""


def _bad(param: str, message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


def _shown(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False, allow_nan=True)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Tool:
    """One declared function. ``parameters`` is its arguments' JSON schema (an object)."""

    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry, as the prompt lists it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    """One call: in the history (``arguments`` the client's JSON text, parsed and checked)
    or parsed from the output."""

    name: str
    arguments: str
    """The arguments object as JSON text (OpenAI sends and expects a string)."""
    id: str = ""


@dataclass(frozen=True)
class ToolUse:
    """What a request asks of tools. ``choice``: ``"auto"`` (the model may call any of
    ``tools`` or answer in text), ``"required"`` (at least one call of any), or
    ``"function"`` (a call of ``function``). ``parallel``: more than one call allowed."""

    tools: tuple[Tool, ...]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """Whether the output is constrained to calls (by a grammar, not by hoping)."""
        return self.choice != "auto"

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools a call may name: the named one, or all."""
        if self.function is None:
            return self.tools
        return tuple(t for t in self.tools if t.name == self.function)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.callable)


def tool_use(body: dict[str, Any]) -> ToolUse | None:
    """The request's tools, or None when none is offered (JSON null reads as absent).
    Raises RouterError naming the field."""
    tools = _tools(body.get("tools"))
    choice, function = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "parallel_tool_calls must be true or false, got "
                                          f"{_shown(parallel)}")
    if choice == "none":
        return None
    return ToolUse(tools, choice, function, parallel is not False)


def _tools(v: Any) -> tuple[Tool, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise _bad("tools", f"tools must be a list of {{\"type\": \"function\", \"function\": "
                            f"{{...}}}} objects, got {_shown(v)}")
    if len(v) > MAX_TOOLS:
        raise _bad("tools", f"tools has {len(v)} entries; at most {MAX_TOOLS} are accepted")
    out: list[Tool] = []
    seen: set[str] = set()
    for i, t in enumerate(v):
        tool = _tool(t, f"tools[{i}]")
        if tool.name in seen:
            raise _bad(f"tools[{i}].function.name", f"tools[{i}].function.name "
                       f"{tool.name!r} is declared twice; function names must be unique")
        seen.add(tool.name)
        out.append(tool)
    return tuple(out)


def _tool(t: Any, where: str) -> Tool:
    if not isinstance(t, dict):
        raise _bad(where, f"{where} must be an object, got {_shown(t)}")
    if t.get("type", "function") != "function":
        raise _bad(f"{where}.type", f"{where}.type must be \"function\" (the only kind of "
                                    f"tool), got {_shown(t.get('type'))}")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise _bad(f"{where}.function", f"{where}.function must be an object with name, "
                                        "description and parameters")
    name = check_name(fn.get("name"), f"{where}.function.name")
    description = fn.get("description")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise _bad(f"{where}.function.description",
                   f"{where}.function.description must be a string, got {_shown(description)}")
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise _bad(f"{where}.function.description",
                   f"{where}.function.description is {len(description)} characters; at "
                   f"most {MAX_DESCRIPTION_CHARS} are accepted")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = DEFAULT_PARAMETERS
    if not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters",
                   f"{where}.function.parameters must be a JSON schema object, got "
                   f"{_shown(parameters)}")
    size = len(json.dumps(parameters, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_STRUCTURED_SPEC_BYTES:
        raise _bad(f"{where}.function.parameters",
                   f"{where}.function.parameters is {size} bytes of JSON; at most "
                   f"{MAX_STRUCTURED_SPEC_BYTES} are accepted")
    return Tool(name, description, parameters)


def check_name(name: Any, where: str) -> str:
    """A function name, else a 400 naming ``where`` and the syntax."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise _bad(where, f"{where} must match ^[a-zA-Z0-9_-]{{1,64}}$, got {_shown(name)}")
    return name


def _tool_choice(v: Any, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    """``(choice, function)``; the default is ``"auto"`` with tools, ``"none"`` without."""
    if v is None:
        return ("auto" if tools else "none"), None
    if isinstance(v, str):
        if v not in TOOL_CHOICES:
            raise _bad("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" "
                                      "or {\"type\": \"function\", \"function\": {\"name\": "
                                      f"...}}}}, got {_shown(v)}")
        if v != "none" and not tools:
            raise _bad("tool_choice", f"tool_choice {v!r} needs tools; none were given")
        return v, None
    if not isinstance(v, dict) or v.get("type") != "function" \
            or not isinstance(v.get("function"), dict):
        raise _bad("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                                  "{\"type\": \"function\", \"function\": {\"name\": ...}}, "
                                  f"got {_shown(v)}")
    name = check_name(v["function"].get("name"), "tool_choice.function.name")
    if name not in {t.name for t in tools}:
        raise _bad("tool_choice.function.name",
                   f"tool_choice.function.name {name!r} is not one of the declared tools")
    return "function", name


def history_calls(v: Any, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (``where`` names it, e.g.
    ``messages[3].tool_calls``): each ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` with ``arguments`` the JSON text of an object."""
    if not isinstance(v, list):
        raise _bad(where, f"{where} must be a list of tool calls, got {_shown(v)}")
    if len(v) > MAX_CALLS_PER_MESSAGE:
        raise _bad(where, f"{where} has {len(v)} calls; at most {MAX_CALLS_PER_MESSAGE} are "
                          "accepted")
    out = []
    for j, c in enumerate(v):
        at = f"{where}[{j}]"
        if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
            raise _bad(at, f"{at} must be {{\"id\", \"type\": \"function\", \"function\": "
                           "{\"name\", \"arguments\"}}")
        if c.get("type", "function") != "function":
            raise _bad(f"{at}.type", f"{at}.type must be \"function\", got "
                                     f"{_shown(c.get('type'))}")
        call_id = c.get("id", "")
        if not isinstance(call_id, str):
            raise _bad(f"{at}.id", f"{at}.id must be a string, got {_shown(call_id)}")
        name = check_name(c["function"].get("name"), f"{at}.function.name")
        arguments = c["function"].get("arguments", "{}")
        if not isinstance(arguments, str):
            raise _bad(f"{at}.function.arguments", f"{at}.function.arguments must be a "
                       f"string (the arguments' JSON text), got {_shown(arguments)}")
        try:
            parsed = json.loads(arguments or "{}", parse_constant=_no_constant)
        except (ValueError, RecursionError):
            raise _bad(f"{at}.function.arguments", f"{at}.function.arguments is not valid "
                       "JSON text") from None
        if not isinstance(parsed, dict):
            raise _bad(f"{at}.function.arguments", f"{at}.function.arguments must encode a "
                       f"JSON object, got {_shown(parsed)}")
        out.append(ToolCall(name, dumps_arguments(parsed), call_id))
    return tuple(out)


def tool_result(m: dict[str, Any], content: str, where: str) -> str:
    """A ``role: "tool"`` message's result text; its ``tool_call_id``, when sent, must be a
    string (the prompt formats of this front do not show it)."""
    call_id = m.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise _bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string, got "
                                            f"{_shown(call_id)}")
    return content


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def dumps_arguments(args: Any) -> str:
    """Arguments as the prompt and the answers write them: JSON with ``", "`` and
    ``": "`` separators, as the tool-call grammar also makes the model write them."""
    return json.dumps(args, ensure_ascii=False, allow_nan=False)
