"""What the fuzzer sends: hypothesis strategies for hostile requests to the router's two
fronts, and the example types that carry them (:mod:`loadtest.fuzz` sends and checks).

Every example is bytes on the wire, so nothing a client library would refuse is out of
reach:

* HTTP (``/v1/completions``, ``/v1/chat/completions``): an OpenAI body, valid but for
  one field (three bodies in five: deep enough to reach the router and the workers) or
  hostile throughout, each field absent, valid or hostile (wrong type, out-of-range, NaN/Infinity,
  ``1e400``, 5,000-digit integers, lone surrogates and odd unicode, strings up to
  ~100 KB, nesting 10-100,000 deep, token ids past the vocabulary), plus unknown and
  duplicated keys; some 7% of bodies are not an object at all (other JSON, truncated
  JSON, UTF-16, random bytes, nothing). JSON text is written here (:func:`json_text`):
  ``json.dumps`` will not write ``NaN`` for a field of our choosing, nor raw nesting,
  nor invalid UTF-8. Headers: content types and encodings that lie.
* gRPC (``Generate``, ``Tokenize``): the request message with every field drawn from
  edges (uint32/int32/int64 limits, float NaN/inf/-0/denormals, token ids past the
  vocabulary, 100 KB salts and stop strings), serialized; about one in seven is then
  broken on the wire (invalid UTF-8 in a string field, which no Python client can send
  otherwise, unknown fields, truncation, random bytes).

Valid values are kept cheap (``max_tokens`` <= 8 mostly) so a run of thousands of
examples is bounded by the hostile part, not by generation. Bottom of the harness: no
I/O, no cluster.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import text_format
from hypothesis import strategies as st

from protos.pdserve.v1 import api_pb2, common_pb2

UINT32_MAX, INT32_MIN, INT32_MAX = 2**32 - 1, -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
HUGE_CHARS = 100_000
"""The longest string sent (characters): big enough to cross every per-field limit a
server should have, small enough that 10,000 examples stay minutes."""


# --------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class HttpExample:
    """One HTTP request: POST ``body`` with ``headers`` to the endpoint's path."""

    body: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def shape(self) -> str:
        """What sets this example apart beyond its body: its content coding."""
        return f"Content-Encoding: {self.headers.get('Content-Encoding', 'identity')}"

    def describe(self, limit: int = 600) -> str:
        head = "".join(f"-H '{k}: {v}' " for k, v in self.headers.items())
        body = self.body.decode("utf-8", "backslashreplace")
        return f"{head}--data-binary {shorten(body, limit)!r}"


@dataclass(frozen=True)
class GrpcExample:
    """One gRPC request as its serialized bytes (possibly not a valid message): the
    message it was made from and, if it was then broken on the wire, how."""

    payload: bytes
    message: Any
    broken: str = ""

    @property
    def shape(self) -> str:
        """Well-formed, or how it was broken (the first words of ``broken``)."""
        return " ".join(self.broken.split()[:2]) if self.broken else "well-formed"

    def describe(self, limit: int = 600) -> str:
        text = text_format.MessageToString(self.message, as_one_line=True)
        text = f"{type(self.message).__name__}({text})"
        return shorten(f"{text} + {self.broken}" if self.broken else text, limit)


def shorten(text: str, limit: int = 600) -> str:
    """``text`` with runs of one repeated piece (up to 8 characters) written as
    ``<'piece' x N>`` and the rest cut at ``limit``: how an example reads in a report."""
    def run(m: re.Match[str]) -> str:
        unit = m.group(1)
        return f"<{unit!r} x {len(m.group(0)) // len(unit)}>"

    text = re.sub(r"(.{1,8}?)\1{15,}", run, text, flags=re.S)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


# --------------------------------------------------------------------------- JSON text


@dataclass(frozen=True)
class Raw:
    """JSON text written verbatim: ``NaN``, ``1e400``, ``[[[...]]]``, a bad literal."""

    text: str


MISSING = Raw("<missing>")
"""A field value that means: leave the field out."""


def json_text(value: Any, ascii_only: bool = True) -> str:
    """``value`` as JSON text, :class:`Raw` pieces verbatim; an object given as a list of
    ``(key, value)`` pairs (a :class:`Pairs`) may repeat keys. With ``ascii_only`` every
    non-ASCII character, lone surrogates included, is a ``\\u`` escape (valid JSON);
    otherwise the text is meant to be encoded with ``surrogatepass``."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{json_text(k, ascii_only)}:{json_text(v, ascii_only)}"
                              for k, v in value.items if v is not MISSING) + "}"
    if isinstance(value, dict):
        return json_text(Pairs(list(value.items())), ascii_only)
    if isinstance(value, list):
        return "[" + ",".join(json_text(v, ascii_only) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return json.dumps(value, ensure_ascii=ascii_only)


@dataclass(frozen=True)
class Pairs:
    """A JSON object as ordered pairs, so a key may repeat."""

    items: list[tuple[str, Any]]


def encode(text: str, ascii_only: bool) -> bytes:
    return text.encode("ascii") if ascii_only else text.encode("utf-8", "surrogatepass")


# --------------------------------------------------------------------------- strings

ODD_PIECES = (
    "\ud800", "\udfff", "\ud83d", "\udc00", "\x00", "\x1b[2J", "\u202e", "\ufeff",
    "\uffff", "\ufffe", "\U0010ffff", "\u0301", "\u200d", "\u2028", "🦀", "👩‍👩‍👧", "ｷ",
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "\r\n", "\\", '"', "%s%n", "{0}",
    "</s>", "' OR 1=1 --", "\n\n\n", " ",
)
"""Pieces strings are built from: surrogates (only the HTTP front can receive them),
control and format characters, the model's special tokens, quoting and format chars."""

SURROGATES = re.compile("[\ud800-\udfff]")


def odd_text(surrogates: bool = True, max_pieces: int = 6) -> st.SearchStrategy[str]:
    chars = st.characters(exclude_categories=() if surrogates else ("Cs",))
    pieces = ODD_PIECES if surrogates else tuple(p for p in ODD_PIECES
                                                 if not SURROGATES.search(p))
    return st.lists(st.one_of(st.sampled_from(pieces), st.text(chars, max_size=6),
                              st.text(max_size=10)),
                    max_size=max_pieces).map("".join)


def huge_text(surrogates: bool = True) -> st.SearchStrategy[str]:
    """1,000 to HUGE_CHARS characters: a short piece repeated (hypothesis cannot draw
    100 KB one character at a time, nor should it)."""
    return st.tuples(odd_text(surrogates, 3).filter(bool),
                     st.integers(1_000, HUGE_CHARS)).map(
        lambda t: (t[0] * (t[1] // len(t[0]) + 1))[:t[1]])


def hostile_text(surrogates: bool = True) -> st.SearchStrategy[str]:
    return weighted((1, st.just("")), (6, odd_text(surrogates)), (1, huge_text(surrogates)))


PLAIN = st.sampled_from(["Hello", "The quick brown fox", "def main():\n", "1, 2, 3,", "hi"])

# --------------------------------------------------------------------------- JSON values

HOSTILE_NUMBERS: tuple[Any, ...] = (
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"),
    Raw("1e-400"), Raw("-0"), Raw("0.0"), Raw("1" * 5000), Raw("-" + "9" * 5000),
    0, -1, INT32_MAX, INT32_MAX + 1, INT32_MIN - 1, UINT32_MAX, UINT32_MAX + 1, INT64_MAX,
    INT64_MAX + 1, INT64_MIN, INT64_MIN - 1, 10**30, 1.5, -0.5, 1e308, 5e-324, 0.999999,
)


def hostile_number() -> st.SearchStrategy[Any]:
    return st.one_of(st.sampled_from(HOSTILE_NUMBERS), st.integers(), st.floats())


def deep(max_depth: int = HUGE_CHARS) -> st.SearchStrategy[Raw]:
    """Arrays or objects nested 10 to ``max_depth`` deep, as raw text."""
    return st.tuples(st.integers(10, max_depth), st.booleans()).map(
        lambda t: Raw("[" * t[0] + "]" * t[0]) if t[1]
        else Raw('{"a":' * t[0] + "1" + "}" * t[0]))


def any_json(surrogates: bool = True) -> st.SearchStrategy[Any]:
    """Any JSON value: the wrong type for whatever field it lands in."""
    leaves = st.one_of(st.none(), st.booleans(), hostile_number(), hostile_text(surrogates))
    return st.one_of(
        st.recursive(leaves, lambda kids: st.one_of(
            st.lists(kids, max_size=4),
            st.dictionaries(odd_text(surrogates, 2), kids, max_size=4)), max_leaves=8),
        deep())


def token_ids(vocab: int | None, json_edges: bool) -> st.SearchStrategy[Any]:
    """A token id: mostly inside the vocabulary, else at and past its edges."""
    v = vocab or 32_000
    edges = [v - 1, v, v + 1, 2 * v, INT32_MAX, UINT32_MAX]
    if json_edges:
        edges += [-1, UINT32_MAX + 1, 2**64, 1.0, True, "5", None]
    return weighted((3, st.integers(0, v - 1)), (1, st.sampled_from(edges)))


def weighted(*options: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """``one_of`` with weights (hypothesis folds repeated ``one_of`` branches into one)."""
    strategies = [s for _, s in options]
    return st.sampled_from([i for i, (w, _) in enumerate(options) for _ in range(w)]).flatmap(
        lambda i: strategies[i])


def long_list(elem: st.SearchStrategy[Any], lo: int, hi: int) -> st.SearchStrategy[list]:
    """``lo`` to ``hi`` elements: a few drawn ones repeated (cheap to draw at any length)."""
    return st.tuples(st.lists(elem, min_size=1, max_size=8), st.integers(lo, hi)).map(
        lambda t: (t[0] * (t[1] // len(t[0]) + 1))[:t[1]])


def either(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any],
           surrogates: bool = True) -> st.SearchStrategy[Any]:
    """Valid three times in five, hostile or any JSON value otherwise."""
    return weighted((3, valid), (1, hostile), (1, any_json(surrogates)))


# --------------------------------------------------------------------------- HTTP bodies


Field = tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]
"""A body field's (valid values, hostile values)."""


def _fields(chat: bool, vocab: int | None, model: str) -> dict[str, Field]:
    num = hostile_number()
    bools = (st.booleans(), st.sampled_from([0, 1, "true", "yes", None]))
    ids = token_ids(vocab, json_edges=True)
    budget = (st.integers(1, 8), st.one_of(hostile_number(), st.just(MISSING)))
    fields: dict[str, Field] = {
        "model": (st.just(model), hostile_text()),
        "max_tokens": budget,
        "temperature": (st.sampled_from([0, 0.0, 0.7, 1, 1e-6, 2.0]), num),
        "top_p": (st.floats(0.01, 1.0), num),
        "top_k": (st.integers(-1, 50), num),
        "min_p": (st.floats(0.0, 1.0), num),
        "seed": (st.integers(0, 2**32), num),
        "stop": (st.one_of(PLAIN, st.lists(PLAIN, max_size=3)),
                 st.one_of(hostile_text(), st.lists(hostile_text(), max_size=5))),
        "stop_token_ids": (st.lists(ids, max_size=3), long_list(ids, 100, 2000)),
        "ignore_eos": bools,
        "include_stop_str_in_output": bools,
        "cache_salt": (PLAIN, hostile_text()),
        "stream": bools,
        "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                           st.dictionaries(hostile_text(), any_json(), max_size=2)),
        "n": (st.integers(1, 3), num),
        "prompt_logprobs": (st.integers(0, 2), num),
        "bad_words": (st.lists(st.sampled_from(["the", "a b", " end"]), max_size=2),
                      st.one_of(hostile_text(), st.lists(hostile_text(), max_size=200))),
        "logit_bias": (st.just({}), st.dictionaries(st.text(max_size=5), num, max_size=3)),
        "response_format": (st.just({"type": "text"}),
                            st.fixed_dictionaries({"type": hostile_text()})),
        "user": (PLAIN, hostile_text()),
    }
    if chat:
        fields |= {"messages": _messages(),
                   "logprobs": (st.booleans(), hostile_number()),
                   "top_logprobs": (st.integers(0, 5), hostile_number()),
                   "max_completion_tokens": budget,
                   "tools": (st.just([]), any_json()),
                   "tool_choice": (st.sampled_from(["none", "auto"]), any_json()),
                   "echo": (st.just(False), num)}
    else:
        fields |= {"prompt": _prompt(vocab),
                   "logprobs": (st.integers(0, 5), hostile_number()),
                   "suffix": (st.just(""), hostile_text()),
                   "echo": (st.booleans(), num),
                   "best_of": (st.integers(3, 4), num)}
    return fields


def _prompt(vocab: int | None) -> Field:
    ids = st.lists(token_ids(vocab, json_edges=False), min_size=1, max_size=40)
    valid = st.one_of(PLAIN, ids, PLAIN.map(lambda p: [p]), ids.map(lambda i: [i]))
    hostile = st.one_of(
        hostile_text(), st.lists(token_ids(vocab, json_edges=True), max_size=40),
        long_list(token_ids(vocab, json_edges=False), 400, 5000),
        st.lists(st.one_of(PLAIN, ids), min_size=2, max_size=4), st.just([]), st.just([[]]),
        deep(), st.just(MISSING))
    return valid, hostile


def _message() -> st.SearchStrategy[Any]:
    roles = st.one_of(st.sampled_from(["user", "system", "assistant", "developer"]),
                      st.sampled_from(["tool", "function", "", "USER"]), hostile_text())
    text = st.one_of(PLAIN, hostile_text())
    parts = st.lists(st.one_of(
        st.fixed_dictionaries({"type": st.just("text"), "text": text}),
        st.fixed_dictionaries({"type": st.sampled_from(["image_url", "", "text"]),
                               "text": any_json()}), any_json()), max_size=3)
    content = weighted((6, text), (2, parts), (1, any_json()), (1, st.just(MISSING)))
    extra = st.dictionaries(st.sampled_from(["name", "tool_calls", "function_call", "x"]),
                            any_json(), max_size=2)
    return weighted((4, st.tuples(roles, content, extra).map(
        lambda t: Pairs([("role", t[0]), ("content", t[1]), *t[2].items()]))),
        (1, any_json()))


def _messages() -> Field:
    valid = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": PLAIN}),
                     min_size=1, max_size=2)
    hostile = weighted((6, st.lists(_message(), min_size=1, max_size=6)), (1, st.just([])),
                       (1, st.just(MISSING)))
    return valid, hostile


def _targeted(fields: dict[str, Field], head: str) -> st.SearchStrategy[Pairs]:
    """Valid but for one field: deep enough to reach the router and the workers."""
    optional = sorted(set(fields) - {head, "max_tokens"})

    def build(names: list[str], target: str) -> st.SearchStrategy[Pairs]:
        valid = [st.tuples(st.just(n), fields[n][0])
                 for n in (head, "max_tokens", *names) if n != target]
        bad = (st.tuples(hostile_text(), any_json()) if target == "<unknown>" else
               st.tuples(st.just(target), weighted((4, fields[target][1]), (1, any_json()))))
        return st.tuples(*valid, bad).map(lambda pairs: Pairs(list(pairs)))

    return st.tuples(st.lists(st.sampled_from(optional), unique=True, max_size=6),
                     st.sampled_from([*sorted(fields), "<unknown>"])).flatmap(
        lambda t: build(*t))


def _chaos(fields: dict[str, Field], head: str) -> st.SearchStrategy[Pairs]:
    """Every field anything, plus unknown and repeated keys."""
    def field(n: str) -> st.SearchStrategy[tuple[str, Any]]:
        return st.tuples(st.just(n), either(*fields[n]))

    names = st.lists(st.sampled_from(sorted(set(fields) - {head, "max_tokens"})),
                     unique=True, max_size=8)
    unknown = st.lists(st.tuples(hostile_text(), any_json()), max_size=2)
    dupes = st.lists(st.tuples(st.sampled_from(sorted(fields)), any_json()), max_size=1)
    return st.tuples(field(head), field("max_tokens"),
                     names.flatmap(lambda ns: st.tuples(*[field(n) for n in ns])),
                     unknown, dupes).map(lambda t: Pairs([t[0], t[1], *t[2], *t[3], *t[4]]))


def _object_body(chat: bool, vocab: int | None, model: str) -> st.SearchStrategy[Pairs]:
    fields = _fields(chat, vocab, model)
    head = "messages" if chat else "prompt"
    return weighted((3, _targeted(fields, head)), (2, _chaos(fields, head)))


def _not_an_object(chat: bool, vocab: int | None, model: str) -> st.SearchStrategy[bytes]:
    some_body = _object_body(chat, vocab, model).map(lambda p: json_text(p).encode())
    return st.one_of(
        any_json().map(lambda v: json_text(v).encode()),
        st.binary(max_size=200), st.just(b""), st.just(b"null"),
        st.tuples(some_body, st.floats(0, 1)).map(lambda t: t[0][:int(len(t[0]) * t[1])]),
        some_body.map(lambda b: b + b"}garbage"),
        some_body.map(lambda b: b"\xef\xbb\xbf" + b),
        some_body.map(lambda b: b.decode().encode("utf-16")))


CONTENT_TYPES = ("application/json", "text/plain", "", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/json; charset=latin-1",
                 "application/json; charset=utf-16", "\u00e9/\u00e9")


def http_examples(chat: bool, vocab: int | None = None,
                  model: str = "") -> st.SearchStrategy[HttpExample]:
    """Hostile bodies (and headers) for ``/v1/chat/completions`` (``chat``) or
    ``/v1/completions``. ``vocab``: the served vocabulary size, for ids at its edge."""
    bodies = weighted((5, st.tuples(_object_body(chat, vocab, model), st.booleans()).map(
        lambda t: encode(json_text(t[0], t[1]), t[1]))), (1, _not_an_object(chat, vocab, model)))
    content_type = weighted((5, st.just("application/json")), (1, st.sampled_from(CONTENT_TYPES)))
    encoding = weighted((10, st.none()), (1, st.sampled_from(["gzip", "deflate", "br", "x"])))

    def make(t: tuple[bytes, str, str | None]) -> HttpExample:
        headers = {"Content-Type": t[1]}
        if t[2]:
            headers["Content-Encoding"] = t[2]
        return HttpExample(t[0], headers)

    return st.tuples(bodies, content_type, encoding).map(make)


# --------------------------------------------------------------------------- gRPC

FLOAT_EDGES = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-45, 1e-6, 3.4e38, 1e39, -1.0,
               0.5, 1.0, 1.0000001, 2.0)


def _proto_floats(valid: st.SearchStrategy[float]) -> st.SearchStrategy[float | None]:
    return weighted((1, st.none()), (3, valid), (1, st.sampled_from(FLOAT_EDGES)))


def _sampling_proto(vocab: int | None) -> st.SearchStrategy[common_pb2.SamplingParams]:
    uint = st.one_of(st.integers(0, 64), st.sampled_from([UINT32_MAX, INT32_MAX + 1, 2**20]))
    text = st.one_of(PLAIN, hostile_text(surrogates=False))
    kw = st.fixed_dictionaries({}, optional={
        "max_tokens": weighted((12, st.integers(1, 8)), (1, st.just(0)), (1, uint)),
        "temperature": _proto_floats(st.sampled_from([0.0, 0.7, 1.0])),
        "top_p": _proto_floats(st.floats(0.0, 1.0, width=32, exclude_min=True)),
        "top_k": st.one_of(st.integers(-1, 50), st.sampled_from([INT32_MIN, INT32_MAX])),
        "min_p": _proto_floats(st.floats(0.0, 1.0, width=32)),
        "seed": st.one_of(st.integers(0, 100), st.sampled_from([INT64_MIN, INT64_MAX, -1])),
        "stop": st.lists(text, max_size=4),
        "stop_token_ids": st.one_of(st.lists(token_ids(vocab, json_edges=False), max_size=4),
                                    long_list(token_ids(vocab, json_edges=False), 100, 2000)),
        "ignore_eos": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "logprobs": st.one_of(st.integers(0, 21), uint),
    })
    return kw.map(lambda d: common_pb2.SamplingParams(
        **{k: v for k, v in d.items() if v is not None}))


def _chat_proto() -> st.SearchStrategy[api_pb2.ChatMessages]:
    role = st.one_of(st.sampled_from(["user", "system", "assistant", "developer", "", "tool"]),
                     hostile_text(surrogates=False))
    content = st.one_of(PLAIN, hostile_text(surrogates=False))
    return st.lists(st.tuples(role, content), max_size=5).map(
        lambda ms: api_pb2.ChatMessages(messages=[
            api_pb2.ChatMessage(role=r, content=c) for r, c in ms]))


def _grpc_text() -> st.SearchStrategy[str]:
    return st.one_of(st.just(""), PLAIN, hostile_text(surrogates=False))


def generate_requests(vocab: int | None = None,
                      model: str = "") -> st.SearchStrategy[api_pb2.GenerateRequest]:
    ids = st.one_of(st.lists(token_ids(vocab, json_edges=False), max_size=40),
                    long_list(token_ids(vocab, json_edges=False), 400, 5000))
    prompt = st.one_of(
        st.fixed_dictionaries({"text": weighted((2, PLAIN), (1, _grpc_text()))}),
        st.fixed_dictionaries({"token_ids": ids.map(lambda i: api_pb2.TokenIds(ids=i))}),
        st.fixed_dictionaries({"messages": _chat_proto()}), st.just({}))
    head = st.fixed_dictionaries({}, optional={
        "request_id": _grpc_text(), "cache_salt": _grpc_text(),
        "model": st.one_of(st.just(model), _grpc_text()),
        "sampling": _sampling_proto(vocab)})
    return st.tuples(head, prompt).map(lambda t: api_pb2.GenerateRequest(**t[0], **t[1]))


def tokenize_requests(model: str = "") -> st.SearchStrategy[api_pb2.TokenizeRequest]:
    prompt = st.one_of(st.fixed_dictionaries({"text": _grpc_text()}),
                       st.fixed_dictionaries({"messages": _chat_proto()}), st.just({}))
    head = st.fixed_dictionaries({}, optional={"model": st.one_of(st.just(model), _grpc_text())})
    return st.tuples(head, prompt).map(lambda t: api_pb2.TokenizeRequest(**t[0], **t[1]))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field on the wire (strings, bytes, sub-messages)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


BAD_UTF8 = (b"\xed\xa0\x80", b"\xff", b"\xc3", b"a\xe2\x82", b"\xf4\x90\x80\x80", b"\xc0\xaf")
"""Lone surrogate (CESU-8), invalid byte, truncated sequences, past U+10FFFF, overlong."""


def _broken(string_fields: tuple[int, ...], chat_field: int) -> st.SearchStrategy[Any]:
    """A function of the serialized message that breaks it on the wire."""
    bad = st.tuples(st.sampled_from(BAD_UTF8), st.text(max_size=4)).map(
        lambda t: t[1].encode() + t[0])
    in_string = st.tuples(st.sampled_from(string_fields), bad).map(
        lambda t: (f"field {t[0]} = invalid UTF-8 {t[1]!r}",
                   lambda raw: raw + _field(t[0], t[1])))
    in_chat = bad.map(lambda b: (
        f"messages[0].content = invalid UTF-8 {b!r}",
        lambda raw: raw + _field(chat_field, _field(1, _field(1, b"user") + _field(2, b)))))
    unknown = st.tuples(st.integers(16, 2**29 - 1), st.binary(max_size=8)).map(
        lambda t: (f"unknown field {t[0]}", lambda raw: raw + _field(t[0], t[1])))
    cut = st.floats(0.05, 0.95).map(
        lambda f: (f"truncated to {f:.0%}", lambda raw: raw[:max(1, int(len(raw) * f))]))
    noise = st.binary(min_size=1, max_size=64).map(
        lambda b: (f"random bytes {b!r}", lambda raw: b))
    return st.one_of(in_string, in_string, in_chat, unknown, cut, noise)


def _as_example(msg: Any, breakage: Any) -> GrpcExample:
    raw = msg.SerializeToString()
    if breakage is None:
        return GrpcExample(raw, msg)
    how, apply = breakage
    return GrpcExample(apply(raw), msg, how)


def grpc_examples(method: str, vocab: int | None = None,
                  model: str = "") -> st.SearchStrategy[GrpcExample]:
    """``method``: ``Generate`` or ``Tokenize``. About six in seven are well-formed messages."""
    if method == "Generate":
        msgs: st.SearchStrategy[Any] = generate_requests(vocab, model)
        breakage = _broken((1, 2, 3, 7), chat_field=5)
    elif method == "Tokenize":
        msgs, breakage = tokenize_requests(model), _broken((1, 2), chat_field=3)
    else:
        raise ValueError(f"method must be Generate or Tokenize, got {method!r}")
    return st.tuples(msgs, weighted((4, st.none()), (1, breakage))).map(
        lambda t: _as_example(*t))
