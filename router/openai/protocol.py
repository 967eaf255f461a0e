"""OpenAI request bodies in, one ``api_pb2.GenerateRequest`` out (lifecycle steps 2 and 3).

2. **Parse.** The body must be a JSON object (``NaN``/``Infinity`` are refused) whose
   strings are all Unicode (a lone surrogate, ``"\\ud800"``, is a 400 naming where it is,
   e.g. ``messages[0].content``). Each field
   this front knows is type-checked here; a wrong type is a 400 naming the field. Fields
   that ask for something pdserve does not do (``n`` > 1, ``echo``, beam search,
   ``functions``, ...) are refused with a 400 saying so, unless they carry their neutral
   value. Unknown fields
   are ignored (see *Fields* below). ``model``, when present, must be the served model
   (else 404, ``code: "model_not_found"``).
3. **Translate.** One ``GenerateRequest``: ``request_id`` is the response id
   (``cmpl-<hex>`` / ``chatcmpl-<hex>``), the prompt is ``text``, ``token_ids`` or
   ``messages`` (chat messages are rendered by the router with the chat template, tool
   turns first written as text by the tool-call parser, :mod:`.tool_parsers`), the
   sampling fields go to ``SamplingParams`` (with a forcing ``tool_choice``, the call
   grammar as its structured output), ``cache_salt`` passes through.

Failures are raised, never answered here: :class:`RouterError` (``INVALID_ARGUMENT`` naming
the field, or ``NOT_FOUND`` for the model) so they read like the router's own refusals, or
:class:`ApiError` for what has no gRPC code (a body that is not JSON).

Fields
------
Both endpoints: ``model``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``seed``, ``stop`` (string or list), ``stop_token_ids``, ``ignore_eos``,
``include_stop_str_in_output``, ``cache_salt``, ``stream``, ``stream_options``
(``include_usage``; ignored without ``stream: true``), ``repetition_penalty`` (vLLM),
``frequency_penalty``, ``presence_penalty``, ``logit_bias`` (an object of token ids as
strings to numbers), ``min_tokens``, ``allowed_token_ids`` and ``bad_words`` (vLLM),
and structured
output: ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and
``structured_outputs`` (one of them per request; see :mod:`router.openai.structured`).
Their ranges are checked by :class:`~common.sampling.SamplingParams` in the router, like
every other sampling field's.

``/v1/completions``: ``prompt`` (a string, a list of token ids, or a list holding exactly
one of those: several prompts per request are refused, send one request each),
``logprobs`` (int, 0..20).

``/v1/chat/completions``: ``messages`` (roles ``system``, ``developer`` (sent as
``system``), ``user``, ``assistant`` (with ``tool_calls``, its content may be null),
``tool`` (a result, with ``tool_call_id``; a run of them is one user turn); ``content`` a
string or a list of ``{"type": "text", "text"}`` parts, joined with ``"\\n"``),
``max_completion_tokens`` (wins over ``max_tokens``; without either the limit is
``max_model_len``, i.e. the rest of the context), ``logprobs`` (bool) and
``top_logprobs`` (0..20, needs ``logprobs: true``), ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (see :mod:`.tools`: ``"required"`` and a named function are
enforced by a grammar, which no other structured-output field may join).

Choices: ``n`` (1..16) on both, streamed or not, one ``index`` per choice (the prompt is
computed once; choice i of a seeded request draws with seed + i). ``/v1/completions``
also takes ``best_of`` (n..16, not streamed: the router generates ``best_of`` choices
and the ``n`` with the highest summed token log-probability are answered, in that
order; usage counts every generated token, as OpenAI bills) and ``echo`` (the prompt
leads each choice's text, and with ``logprobs`` its tokens lead the logprobs, the first
one ``null``). vLLM's ``prompt_logprobs`` (0..20 alternatives) on both: a list with
``null`` first, then per prompt token ``{token_id: {"logprob", "rank",
"decoded_token"}}`` for the token and its alternatives (completions: in the choice;
chat: at the top of the response; streamed: on the first chunk).

Accepted only at their neutral value (anything else is a 400 naming the field):
``suffix`` "", ``use_beam_search`` false, ``functions`` empty (use ``tools``),
``continue_final_message`` false; ``echo`` false on chat.

Ignored: ``user``, ``metadata``, ``store``, ``service_tier``, ``reasoning_effort``,
``stream_options.continuous_usage_stats``, ``skip_special_tokens``,
``spaces_between_special_tokens``, ``add_generation_prompt`` (the router always adds it),
``chat_template``/``chat_template_kwargs``, ``priority``, a message's ``name``, a tool's
``strict`` (a forcing ``tool_choice`` always follows the schemas; ``auto`` never
constrains), and any field not named in this docstring.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from common.request import MAX_CHOICES
from common.sampling import MAX_STRUCTURED_SPEC_BYTES
from protos.pdserve.v1 import api_pb2, common_pb2
from router.auth import Principal
from router.edge import unencodable_path
from router.errors import RouterError

from .structured import FIELDS as STRUCTURED_FIELDS
from .structured import structured_output
from .tool_parsers import DEFAULT_PARSER, ToolParser, tool_parser
from .tools import ToolUse, history_calls, tool_result, tool_use

UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20
CHAT_TEXT_PART_SEPARATOR = "\n"
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "user"}
"""Roles a client may send -> the role the chat template sees (a tool result is a user
turn, written by the tool-call parser)."""


class RouterLike(Protocol):
    """What this front needs from the router core (``router/core.py``)."""

    model_name: str
    max_model_len: int

    def generate(
        self, req: api_pb2.GenerateRequest, timeout: float | None = None,
        caller: Principal | None = None,
    ) -> AsyncIterator[api_pb2.GenerateResponse]: ...

    def count_sent(self, hop: str, nbytes: int) -> None:
        """Count one stream message of ``nbytes`` sent to a client on ``hop``."""


class ApiError(Exception):
    """An error answered with an HTTP status that has no gRPC code (413, 404 route, 401,
    ...); ``headers`` go with it (``WWW-Authenticate``, ``Retry-After``)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


# --------------------------------------------------------------------------- JSON


def dumps(obj: Any) -> str:
    """The front's JSON encoding, both in messages and on the wire: compact, no NaN."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# Characters that Python's ``str.splitlines`` and some clients' line readers take
# for line breaks although server-sent events break lines only at CR and LF.
_LINE_BREAKS_OUTSIDE_SSE = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def dumps_event(obj: Any) -> str:
    """``dumps`` for one server-sent event's ``data:`` line: the same JSON, with the
    Unicode line separators (NEL, U+2028, U+2029) escaped so that no client that
    splits lines more eagerly than the SSE grammar cuts an event in two."""
    return dumps(obj).translate(_LINE_BREAKS_OUTSIDE_SSE)


class _NotJson(ValueError):
    """A refusal of ours while parsing; its text is meant for the client."""


def _reject_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not valid JSON")


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (``NaN``/``Infinity`` refused), else ApiError 400.
    The message says what is wrong in words of its own, never Python's exception text."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        why = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    except _NotJson as exc:
        why = str(exc)
    except UnicodeDecodeError as exc:
        why = f"byte {exc.start} is not UTF-8 text"
    except RecursionError:
        why = "arrays or objects are nested too deeply"
    except ValueError:  # what else json.loads raises: an integer of too many digits
        why = "a number has too many digits"
    else:
        why = None
    if why is not None:
        raise ApiError(400, f"request body is not valid JSON: {why}", None, "invalid_json")
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {describe(body)}",
                       None, "invalid_json")
    where = unencodable_path(body)
    if where is not None:
        raise bad(where, f"{where}: not valid Unicode text (a lone surrogate such as "
                          "\\ud800 has no UTF-8 form); send text as UTF-8 or as escaped "
                          "surrogate pairs")
    return body


# --------------------------------------------------------------------------- fields


def bad(param: str, message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _as_float(v: int | float) -> float:
    """A JSON number as a float; an integer too large for one reads as infinity."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def describe(v: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "object"}.get(type(v), type(v).__name__)
    text = json.dumps(v) if not isinstance(v, (list, dict)) else ""
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{kind} {text}".strip()


def _token_ids(v: list[Any], name: str, lo: int = 0, hi: int = UINT32_MAX) -> list[int]:
    for i, t in enumerate(v):
        if not _is_int(t) or not lo <= t <= hi:
            raise bad(name, f"{name}[{i}] must be an integer in [{lo}, {hi}], got "
                             f"{describe(t)}")
    return list(v)


class Fields:
    """Typed reads of the JSON body. JSON ``null`` reads as absent; failures name the field."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def get(self, name: str) -> Any:
        return self.body.get(name)

    def int_(self, name: str, lo: int, hi: int) -> int | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not _is_int(v):
            raise bad(name, f"{name} must be an integer, got {describe(v)}")
        if not lo <= v <= hi:
            raise bad(name, f"{name} must be in [{lo}, {hi}], got {v}")
        return v

    def number(self, name: str) -> float | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not _is_number(v):
            raise bad(name, f"{name} must be a number, got {describe(v)}")
        return _as_float(v)

    def bool_(self, name: str) -> bool | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise bad(name, f"{name} must be true or false, got {describe(v)}")
        return v

    def str_(self, name: str) -> str | None:
        v = self.body.get(name)
        if v is None:
            return None
        if not isinstance(v, str):
            raise bad(name, f"{name} must be a string, got {describe(v)}")
        return v

    def str_list(self, name: str) -> list[str]:
        v = self.body.get(name)
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return list(v)
        raise bad(name, f"{name} must be a string or a list of strings, got {describe(v)}")

    def int_list(self, name: str, lo: int, hi: int) -> list[int]:
        v = self.body.get(name)
        if v is None:
            return []
        if not isinstance(v, list):
            raise bad(name, f"{name} must be a list of integers, got {describe(v)}")
        return _token_ids(v, name, lo, hi)


# --------------------------------------------------------------------------- neutral-only


def _eq(value: Any) -> Callable[[Any], bool]:
    """Accepts exactly ``value`` (numbers compare as numbers, booleans only as booleans)."""
    if isinstance(value, bool):
        return lambda v: v is value
    return lambda v: _is_number(v) and v == value


def _empty(v: Any) -> bool:
    return isinstance(v, (list, dict, str)) and not v


# name -> (accepts, what to say when it does not). Checked only when the field is non-null.
NEUTRAL_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_empty, "suffix is not supported"),
    "use_beam_search": (_eq(False), "beam search is not supported"),
    "functions": (_empty, "functions (deprecated by OpenAI) are not supported; use tools"),
    "continue_final_message": (_eq(False), "continue_final_message is not supported"),
}


def _check_neutral(f: Fields) -> None:
    for name, (accepts, why) in NEUTRAL_ONLY.items():
        v = f.get(name)
        if v is not None and not accepts(v):
            # allow_nan: the value is only shown (1e400 parses to inf; dumps refuses it)
            shown = json.dumps(v, ensure_ascii=False, allow_nan=True)
            raise bad(name, f"{why}; got {name}={shown}")


# --------------------------------------------------------------------------- translation


def _sampling(f: Fields, *, chat: bool, max_model_len: int) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    max_tokens = f.int_("max_tokens", 1, UINT32_MAX)
    if chat:
        max_completion = f.int_("max_completion_tokens", 1, UINT32_MAX)
        if max_completion is not None:
            max_tokens = max_completion
        elif max_tokens is None:
            # OpenAI chat has no small default: the limit is the rest of the context.
            max_tokens = max_model_len
    if max_tokens is not None:
        s.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        v = f.number(name)
        if v is not None:
            if not math.isfinite(v):
                raise bad(name, f"{name} must be finite, got {v}")
            setattr(s, name, v)
    top_k = f.int_("top_k", INT32_MIN, INT32_MAX)
    if top_k is not None:
        s.top_k = top_k
    seed = f.int_("seed", INT64_MIN, INT64_MAX)
    if seed is not None:
        s.seed = seed
    s.stop.extend(f.str_list("stop"))
    s.stop_token_ids.extend(f.int_list("stop_token_ids", 0, UINT32_MAX))
    min_tokens = f.int_("min_tokens", 0, UINT32_MAX)
    if min_tokens is not None:
        s.min_tokens = min_tokens
    for token, bias in _logit_bias(f.get("logit_bias")).items():
        s.logit_bias[token] = bias
    s.allowed_token_ids.extend(f.int_list("allowed_token_ids", 0, UINT32_MAX))
    s.bad_words.extend(f.str_list("bad_words"))
    structured = structured_output(f.body)
    if structured is not None:
        s.structured.CopyFrom(structured)
    s.ignore_eos = bool(f.bool_("ignore_eos"))
    s.include_stop_str_in_output = bool(f.bool_("include_stop_str_in_output"))
    if chat:
        want = f.bool_("logprobs")
        top = f.int_("top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        if want:
            s.logprobs = top or 0
    else:
        n = f.int_("logprobs", 0, MAX_LOGPROBS)
        if n is not None:
            s.logprobs = n
    return s


def _logit_bias(v: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (JSON keys, so strings) to finite numbers; the
    count and the ranges are :class:`~common.sampling.SamplingParams`' to check."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("logit_bias", f"logit_bias must be an object mapping token ids to "
                                 f"numbers, got {describe(v)}")
    out = {}
    for key, bias in v.items():
        # At most 10 digits before int(): a huge digit string is a ValueError there.
        if not (key.isascii() and key.isdigit() and len(key) <= 10
                and int(key) <= UINT32_MAX):
            raise bad("logit_bias", f"logit_bias keys must be token ids in [0, "
                                     f"{UINT32_MAX}], got {key[:40]!r}")
        if not _is_number(bias) or not math.isfinite(_as_float(bias)):
            raise bad("logit_bias", f"logit_bias[{key!r}] must be a finite number, got "
                                     f"{describe(bias)}")
        out[int(key)] = float(bias)
    return out


def _completion_prompt(v: Any) -> str | list[int]:
    if v is None:
        raise bad("prompt", "prompt is required")
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        if not v:
            raise bad("prompt", "prompt must not be an empty list")
        if all(_is_int(t) for t in v):
            return _token_ids(v, "prompt")
        if len(v) == 1 and isinstance(v[0], (str, list)):
            if isinstance(v[0], list) and not v[0]:
                raise bad("prompt", "prompt[0] must not be an empty list")
            if isinstance(v[0], list) and not all(_is_int(t) for t in v[0]):
                raise bad("prompt", "prompt[0] must be a list of token ids")
            return _completion_prompt(v[0])
        if all(isinstance(p, (str, list)) for p in v):
            raise bad("prompt", f"batched prompts (a list of {len(v)} prompts) are not "
                                 "supported: send one request per prompt")
    raise bad("prompt", "prompt must be a string, a list of token ids, or a list holding "
                         f"one of those; got {describe(v)}")


def chat_messages(v: Any, tools: ToolUse | None = None,
                  parser: ToolParser | None = None) -> api_pb2.ChatMessages:
    """``messages`` as the router's chat template takes them (role and text). Tool turns
    are written by ``parser`` (default: :data:`~.tool_parsers.DEFAULT_PARSER`): an
    assistant's ``tool_calls`` after its text, a run of ``tool`` messages as one user
    turn; with ``tools`` offered, the parser's tool list ends the system message (one is
    added first when there is none)."""
    if not isinstance(v, list) or not v:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    parser = parser or tool_parser(DEFAULT_PARSER)
    turns: list[tuple[str, str]] = []
    results: list[str] = []  # a run of tool messages, not written yet
    answering = False  # the last turn was an assistant's tool calls (or their results)
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"{where}.role", f"{where}.role must be a string")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"{where}.role {role!r} is not supported; use system, "
                                        "developer, user, assistant or tool")
        if m.get("function_call") is not None:
            raise bad(f"{where}.function_call", f"{where}.function_call (deprecated by "
                                                 "OpenAI) is not supported; use tool_calls")
        calls = m.get("tool_calls")
        if calls and role != "assistant":
            raise bad(f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages "
                                              "carry tool calls")
        content = _message_text(m.get("content"), where,
                                optional=role == "assistant")
        if role == "tool":
            if not answering:
                raise bad(f"{where}.role", f"{where}: a tool message answers the tool_calls "
                                            "of an assistant message; it must follow one "
                                            "(or another tool message)")
            results.append(tool_result(m, content, where))
            continue
        answering = bool(calls)
        if results:
            turns.append(("user", parser.render_results(results)))
            results = []
        if calls:
            content = parser.render_calls(content, history_calls(calls,
                                                                 f"{where}.tool_calls"))
        turns.append((CHAT_ROLES[role], content))
    if results:
        turns.append(("user", parser.render_results(results)))
    if tools is not None:
        listing = parser.system_prompt(tools.tools)
        if turns[0][0] == "system":
            turns[0] = ("system", f"{turns[0][1]}\n\n{listing}" if turns[0][1] else listing)
        else:
            turns.insert(0, ("system", listing))
    out = api_pb2.ChatMessages()
    for role, content in turns:
        out.messages.add(role=role, content=content)
    return out


def _message_text(content: Any, where: str, optional: bool) -> str:
    """A message's ``content``: a string or a list of text parts (joined); null only
    where ``optional`` (an assistant's, e.g. beside its tool calls)."""
    if content is None:
        if not optional:
            raise bad(f"{where}.content", f"{where}.content is required")
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content", f"{where}.content must be a string or a list of "
                                       f"text parts, got {describe(content)}")
    texts = []
    for j, part in enumerate(content):
        pwhere = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else describe(part)
            raise bad(pwhere, f"{pwhere}: only text parts are supported, got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"{pwhere}.text", f"{pwhere}.text must be a string")
        texts.append(text)
    return CHAT_TEXT_PART_SEPARATOR.join(texts)


class Call:
    """One parsed OpenAI request: what to send the router and how to answer."""

    def __init__(self, *, chat: bool, req: api_pb2.GenerateRequest, model: str, stream: bool,
                 include_usage: bool, logprobs: bool, tools: ToolUse | None = None,
                 tool_parser: ToolParser | None = None, n: int = 1, echo: bool = False,
                 prompt_logprobs: int | None = None) -> None:
        self.n = n
        """Choices answered; the router generates ``req.n`` (more with ``best_of``: the
        ``n`` with the highest log-probability are answered)."""
        self.echo = echo
        """Completions: the prompt leads each choice's text (and its logprobs)."""
        self.prompt_logprobs = prompt_logprobs
        """vLLM's ``prompt_logprobs`` (alternatives per prompt token), when asked for."""
        self.chat = chat
        self.tools = tools
        """None: no tools offered, the output is plain content."""
        self.tool_parser = tool_parser
        self.req = req
        self.id = req.request_id
        self.model = model
        self.created = int(time.time())
        self.stream = stream
        self.include_usage = include_usage
        self.logprobs = logprobs


def check_model(f: Fields, served: str) -> str | None:
    """The ``model`` field, which when present must name the served model (else
    NOT_FOUND)."""
    model = f.str_("model")
    if model is not None and model != served:
        raise RouterError(grpc.StatusCode.NOT_FOUND,
                          f"The model `{model}` does not exist: this server serves "
                          f"`{served}` (see GET /v1/models)", "model")
    return model


def parse_request(body: dict[str, Any], router: RouterLike, *, chat: bool,
                  tool_format: str = DEFAULT_PARSER) -> Call:
    """Validate an OpenAI request body and translate it; raises RouterError/ApiError.
    ``tool_format``: the tool-call parser's name (:data:`~.tool_parsers.PARSERS`)."""
    f = Fields(body)
    model = check_model(f, router.model_name)
    _check_neutral(f)
    stream = bool(f.bool_("stream"))
    options = f.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"stream_options must be an object, got {describe(options)}")
    include_usage = False
    if options:
        v = options.get("include_usage")
        if v is not None and not isinstance(v, bool):
            raise bad("stream_options.include_usage",
                       f"stream_options.include_usage must be true or false, got {describe(v)}")
        include_usage = bool(v) and stream
    cache_salt = f.str_("cache_salt")
    sampling = _sampling(f, chat=chat, max_model_len=router.max_model_len)
    logprobs = sampling.HasField("logprobs")
    n, generated, echo = _choices(f, chat=chat, stream=stream)
    if generated > n and not logprobs:  # best_of ranks by the tokens' log-probabilities
        sampling.logprobs = 0
    prompt_logprobs = f.int_("prompt_logprobs", 0, MAX_LOGPROBS)
    prefix = "chatcmpl-" if chat else "cmpl-"
    req = api_pb2.GenerateRequest(request_id=prefix + uuid.uuid4().hex, model=model or "",
                                  sampling=sampling, cache_salt=cache_salt or "",
                                  n=generated if generated > 1 else 0)
    if prompt_logprobs is not None or (echo and logprobs):
        req.prompt_logprobs = max(prompt_logprobs or 0,
                                  sampling.logprobs if echo and logprobs else 0)
    tools: ToolUse | None = None
    parser: ToolParser | None = None
    if chat:
        parser = tool_parser(tool_format)
        tools = tool_use(body)
        req.messages.CopyFrom(chat_messages(f.get("messages"), tools, parser))
        if tools is not None and tools.forced:
            _force_calls(req.sampling, tools, parser, body)
    else:
        if body.get("tools") or body.get("tool_choice") not in (None, "none", "auto"):
            name = "tools" if body.get("tools") else "tool_choice"
            raise bad(name, f"{name}: tool calling is a chat feature; send it to "
                             "/v1/chat/completions")
        prompt = _completion_prompt(f.get("prompt"))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
    return Call(chat=chat, req=req, model=router.model_name, stream=stream,
                include_usage=include_usage, logprobs=logprobs, tools=tools,
                tool_parser=parser, n=n, echo=echo, prompt_logprobs=prompt_logprobs)


def _choices(f: Fields, *, chat: bool, stream: bool) -> tuple[int, int, bool]:
    """(``n``: choices answered, how many the router generates (``best_of``), ``echo``)."""
    n = f.int_("n", 1, MAX_CHOICES) or 1
    if chat:
        if f.bool_("echo"):
            raise bad("echo", "echo is a /v1/completions field; a chat reply never repeats "
                               "the prompt")
        return n, n, False
    best_of = f.int_("best_of", 1, MAX_CHOICES)
    if best_of is not None and best_of < n:
        raise bad("best_of", f"best_of ({best_of}) must be at least n ({n})")
    if best_of is not None and best_of > n and stream:
        raise bad("best_of", "best_of greater than n cannot be streamed (the best choices "
                              "are known only at the end); set stream to false")
    return n, max(n, best_of or 1), bool(f.bool_("echo"))


def _force_calls(sampling: common_pb2.SamplingParams, tools: ToolUse, parser: ToolParser,
                 body: dict[str, Any]) -> None:
    """Constrain the output to calls (``tool_choice`` ``"required"`` or a named function)
    with the parser's grammar, bounded like any structured-output spec."""
    if sampling.HasField("structured"):
        given = ", ".join(n for n in STRUCTURED_FIELDS if body.get(n) is not None)
        raise bad("tool_choice", f"tool_choice {_choice_name(tools)} constrains the output "
                                  f"to tool calls; it cannot be combined with structured "
                                  f"output ({given})")
    spec = parser.grammar(tools.callable, tools.parallel)
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > MAX_STRUCTURED_SPEC_BYTES:
        raise bad("tools", f"the grammar forcing tool_choice {_choice_name(tools)} is {size} "
                            f"bytes; at most {MAX_STRUCTURED_SPEC_BYTES} are accepted: offer "
                            "fewer or smaller tools, or name one in tool_choice")
    sampling.structured.CopyFrom(common_pb2.StructuredOutput(
        kind=common_pb2.StructuredOutput.KIND_GRAMMAR, spec=spec))


def _choice_name(tools: ToolUse) -> str:
    return f"function {tools.function!r}" if tools.function else repr(tools.choice)
