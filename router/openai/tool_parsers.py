"""Tool-call formats, by name: how tools, calls and results are written into the prompt,
the grammar that forces calls, and how calls are read back out of the generated text.

A format is a :class:`ToolParser`; :data:`PARSERS` holds them by name and
:func:`tool_parser` picks one (``"hermes"`` is the default; another model family's format
is one more class registered here). One request's flow through its parser:

1. the prompt: :meth:`~ToolParser.system_prompt` lists the offered tools (appended to the
   system message), :meth:`~ToolParser.render_calls` writes an earlier assistant turn's
   calls, :meth:`~ToolParser.render_results` a run of ``role: "tool"`` messages (one user
   turn: the chat template of the router knows only system, user and assistant);
2. with ``tool_choice`` ``"required"`` or a named function, :meth:`~ToolParser.grammar`
   (llguidance's Lark) is sent to the worker as a ``KIND_GRAMMAR`` structured output;
3. the output: :meth:`~ToolParser.stream` makes a :class:`ToolStream`, fed the text as it
   arrives and finished at the end; it yields :data:`Event` values (content, a call's
   start, a piece of its arguments). :func:`parse` folds the same events for a whole
   text, so a streamed answer always adds up to the non-streamed one.

Hermes (NousResearch's format, Qwen2.5's templates): the tools as JSON lines inside
``<tools></tools>``, each call ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>``, each result ``<tool_response>\\n...\\n</tool_response>``.

Reading Hermes output: text outside call blocks is ``content``, less the whitespace that
separates it from a call. A block whose JSON is not ``{"name": <declared>, "arguments":
{...}}`` stays content, tags and all. Text that may be the start of ``<tool_call>`` is
held back until it is decided. Without a grammar (``auto``) a block is held until its
``</tool_call>`` (it may still turn out to be content); under a grammar the call's name
and then its arguments stream as they are generated, and the block ends at the first
``</tool_call>`` after its JSON (one inside a string of the arguments is text). The
arguments string is the block's own JSON text for them.

Plain Python, no I/O; a :class:`ToolStream` belongs to one request.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .tools import Tool, ToolCall, dumps_arguments

# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Content:
    """Text for ``content``."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call ``index`` (0, 1, ...) begins: its id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    """The next piece of call ``index``'s arguments text."""

    index: int
    text: str


Event = Content | CallStart | Arguments


class ToolStream(Protocol):
    """One request's output reader. ``feed`` takes the next text and returns what is
    decided; ``finish`` returns the rest (call it once, at the end). Not thread-safe."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


class ToolParser(Protocol):
    """One model family's tool-call format (see the module docstring for the flow)."""

    name: str

    def system_prompt(self, tools: Sequence[Tool]) -> str: ...

    def render_calls(self, content: str, calls: Sequence[ToolCall]) -> str: ...

    def render_results(self, results: Sequence[str]) -> str: ...

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str: ...

    def stream(self, names: frozenset[str], forced: bool,
               new_id: Callable[[], str] | None = None) -> ToolStream: ...


def new_call_id() -> str:
    """OpenAI's shape of a call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Parsed:
    """A whole output read: ``content`` (None when empty) and the calls in order."""

    content: str | None
    calls: tuple[ToolCall, ...]


def parse(stream: ToolStream, text: str) -> Parsed:
    """``text`` read whole, by folding the events ``stream`` gives for it."""
    return fold(stream.feed(text) + stream.finish())


def fold(events: Sequence[Event]) -> Parsed:
    content: list[str] = []
    starts: list[CallStart] = []
    args: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, Content):
            content.append(e.text)
        elif isinstance(e, CallStart):
            starts.append(e)
            args.setdefault(e.index, [])
        else:
            args.setdefault(e.index, []).append(e.text)
    calls = tuple(ToolCall(s.name, "".join(args[s.index]), s.id) for s in starts)
    return Parsed("".join(content) or None, calls)


# --------------------------------------------------------------------------- hermes

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

HERMES_PREAMBLE = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options inside the call grammar: one spelling, the prompt's own
(``{"name": "f", "arguments": {"a": 1}}``), so the model cannot pad with whitespace."""

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')
"""How a well-formed call block begins, up to its arguments."""

_SPACE = frozenset(" \t\r\n")
_TAIL_CHARS = _SPACE | {"}"}
"""What may end a block's arguments so far without being sent yet: whitespace and
``}`` (the block's own closing brace may be among them)."""


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (not all of it)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_of(block: str, names: frozenset[str]) -> tuple[str, str] | None:
    """``(name, arguments text)`` of a whole block's text (between the tags), or None when
    it is not a call of one of ``names`` with an object of arguments."""
    try:
        obj = json.loads(block, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return None
    name, args = obj["name"], obj["arguments"]
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    head = _HEAD.match(block)
    if head is not None:
        raw = _closed_arguments(block[head.end():])
        try:  # the block's own text, unless a duplicate key made it something else
            if json.loads(raw, parse_constant=_reject_constant) == args:
                return name, raw
        except (ValueError, RecursionError):
            pass
    return name, dumps_arguments(args)


def _closed_arguments(rest: str) -> str:
    """The arguments text of a complete block, from the end of its head: up to the
    block's final ``}``."""
    s = rest.strip()
    if s.endswith("}"):
        s = s[:-1].rstrip()
    return s


class _JsonEnd:
    """Finds where the JSON value a text begins with ends, reading each character once
    as the text grows (strings and escapes are followed; brackets counted)."""

    def __init__(self) -> None:
        self.pos = 0
        self.end = -1
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str) -> int:
        """The end of the value in ``text`` (a longer version of the last one), else -1."""
        while self.end < 0 and self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self.end = self.pos
        return self.end


class HermesStream:
    """The Hermes output reader (see the module docstring). ``forced``: the grammar
    guarantees well-formed calls, so a call streams as it is generated."""

    def __init__(self, names: frozenset[str], forced: bool,
                 new_id: Callable[[], str] | None = None) -> None:
        self._names = names
        self._forced = forced
        self._new_id = new_id or new_call_id
        self._buf = ""          # text not decided yet
        self._in_call = False   # inside a <tool_call> block
        self._after_call = False  # drop whitespace after a call
        self._pre_ws = ""       # whitespace before the open tag (content if no call)
        self._calls = 0
        self._head_end = -1     # forced: where the open block's arguments begin
        self._sent = 0          # forced: arguments characters sent for the open block
        self._scanned = 0       # the open block's text before this holds no close tag
        self._json = _JsonEnd()  # forced: where the open block's JSON ends

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if not self._in_call:
                if not self._text(out, final):
                    return out
            elif not self._block(out, final):
                return out

    def _text(self, out: list[Event], final: bool) -> bool:
        """Outside a block; True when a block opened (go on reading it)."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after_call = False
        i = self._buf.find(TOOL_CALL_OPEN)
        if i >= 0:
            before = self._buf[:i]
            body = before.rstrip()
            if body:
                out.append(Content(body))
            self._pre_ws = before[len(body):]
            self._buf = self._buf[i + len(TOOL_CALL_OPEN):]
            self._in_call, self._head_end, self._sent, self._scanned = True, -1, 0, 0
            self._json = _JsonEnd()
            return True
        if final:
            if self._buf:
                out.append(Content(self._buf))
            self._buf = ""
            return False
        held = _partial(self._buf, TOOL_CALL_OPEN)
        ready = self._buf[:len(self._buf) - held]
        body = ready.rstrip()  # whitespace waits: it may precede a call
        if body:
            out.append(Content(body))
        self._buf = self._buf[len(body):]
        return False

    def _block(self, out: list[Event], final: bool) -> bool:
        """Inside a block; True when it closed (go on reading text)."""
        j = -1
        if not self._forced:
            j = self._buf.find(TOOL_CALL_CLOSE, self._scanned)  # each character scanned once
        elif self._json.scan(self._buf) >= 0:  # the tag that follows the call's JSON
            j = self._buf.find(TOOL_CALL_CLOSE, max(self._scanned, self._json.end))
        if j < 0 and not final:
            self._scanned = max(self._scanned, len(self._buf) - len(TOOL_CALL_CLOSE) + 1)
            if self._forced:
                self._stream_arguments(out)
            return False
        block = self._buf if j < 0 else self._buf[:j]
        close = "" if j < 0 else TOOL_CALL_CLOSE
        self._buf = "" if j < 0 else self._buf[j + len(close):]
        self._in_call = False
        if self._forced and self._head_end < 0 and _call_of(block.strip(),
                                                             self._names) is None:
            self._open_call(block, out)  # cut short: a call with what it has, as streamed
        if self._head_end >= 0:  # streamed as it came: send the rest of its arguments
            rest = block[self._head_end:]
            if close:
                args = _closed_arguments(rest)
            elif self._json.end < 0:  # the output ended inside the call's JSON
                args = rest.strip()
            else:  # ... or after it, maybe inside the tag
                args = _closed_arguments(rest[:len(rest) - _partial(rest, TOOL_CALL_CLOSE)])
            self._send(out, args)
            self._after_call = True
            return True
        found = _call_of(block.strip(), self._names)
        if found is None:
            out.append(Content(self._pre_ws + TOOL_CALL_OPEN + block + close))
            self._pre_ws = ""
            return True
        name, args = found
        index = self._start(out, name)
        out.append(Arguments(index, args))
        self._after_call = True
        return True

    def _start(self, out: list[Event], name: str) -> int:
        index = self._calls
        self._calls += 1
        self._pre_ws = ""
        out.append(CallStart(index, self._new_id(), name))
        return index

    def _open_call(self, block: str, out: list[Event]) -> None:
        """Start the call ``block`` begins, once its head (name) is whole."""
        head = _HEAD.match(block)
        if head is not None and head.group(1) in self._names:
            self._start(out, head.group(1))
            self._head_end = head.end()

    def _stream_arguments(self, out: list[Event]) -> None:
        if self._head_end < 0:
            self._open_call(self._buf, out)
            if self._head_end < 0:
                return  # not yet (or never: then the block is read whole at its end)
        buf, start = self._buf, self._head_end
        while start < len(buf) and buf[start] in _SPACE:
            start += 1
        self._head_end = start  # the arguments begin past any whitespace
        # without copying the block: its text grows a token at a time
        end = len(buf) - _partial(buf, TOOL_CALL_CLOSE)
        while end > start and buf[end - 1] in _TAIL_CHARS:
            end -= 1
        if end - start > self._sent:
            out.append(Arguments(self._calls - 1, buf[start + self._sent:end]))
            self._sent = end - start

    def _send(self, out: list[Event], args: str) -> None:
        """Send what of ``args`` (the open block's arguments text so far) is not sent."""
        if len(args) > self._sent:
            out.append(Arguments(self._calls - 1, args[self._sent:]))
            self._sent = len(args)


class HermesParser:
    """The Hermes format (module docstring)."""

    name = "hermes"

    def system_prompt(self, tools: Sequence[Tool]) -> str:
        lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
        return HERMES_PREAMBLE.format(tools=lines)

    def render_calls(self, content: str, calls: Sequence[ToolCall]) -> str:
        blocks = [f'{TOOL_CALL_OPEN}\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n'
                  f"{TOOL_CALL_CLOSE}" for c in calls]
        return "\n".join([content, *blocks] if content else blocks)

    def render_results(self, results: Sequence[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)

    def grammar(self, tools: Sequence[Tool], parallel: bool) -> str:
        """Lark for one call (or, ``parallel``, one or more separated by newlines) of one
        of ``tools``, its JSON following ``{"name": <that name>, "arguments": <its
        parameters schema>}`` (each function a ``%json`` alternative)."""
        rules = [f"fn_{i}: %json {json.dumps(_call_schema(t), ensure_ascii=True)}"
                 for i, t in enumerate(tools)]
        alternatives = " | ".join(f"fn_{i}" for i in range(len(tools)))
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return "\n".join([start, f'call: "{TOOL_CALL_OPEN}\\n" ({alternatives}) '
                                 f'"\\n{TOOL_CALL_CLOSE}"', *rules]) + "\n"

    def stream(self, names: frozenset[str], forced: bool,
               new_id: Callable[[], str] | None = None) -> ToolStream:
        return HermesStream(names, forced, new_id)


def _call_schema(tool: Tool) -> dict[str, object]:
    """The JSON schema of one call of ``tool``. ``$defs``/``definitions`` of its parameters
    move to the top so that their ``#/$defs/...`` references still resolve."""
    params = dict(tool.parameters)
    schema: dict[str, object] = {"x-guidance": JSON_STYLE}
    for key in ("$defs", "definitions"):
        if key in params:
            schema[key] = params.pop(key)
    schema.update({"type": "object",
                   "properties": {"name": {"const": tool.name}, "arguments": params},
                   "required": ["name", "arguments"], "additionalProperties": False})
    return schema


HERMES = HermesParser()

PARSERS: dict[str, ToolParser] = {HERMES.name: HERMES}
"""Tool-call formats by name."""

DEFAULT_PARSER = HERMES.name


def tool_parser(name: str = DEFAULT_PARSER) -> ToolParser:
    """The format called ``name``; ValueError naming the known ones otherwise."""
    parser = PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return parser
