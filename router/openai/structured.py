"""Structured-output fields of an OpenAI body -> one ``common_pb2.StructuredOutput``.

Accepted (at most one of them per request; each names itself in a 400):

- ``response_format`` (OpenAI): ``{"type": "text"}`` (unconstrained),
  ``{"type": "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`` (the output always follows the schema, ``strict`` or not);
- vLLM's ``guided_json`` (a schema object, or its JSON text), ``guided_regex`` (a
  pattern), ``guided_choice`` (a list of strings), ``guided_grammar`` (a context-free
  grammar: llguidance's Lark dialect, or a GBNF grammar, which llguidance's converter
  turns into Lark on the worker);
- vLLM's ``structured_outputs``: an object with one of ``json``, ``regex``, ``choice``,
  ``grammar`` (as above) or ``json_object: true``.

Tool calls forced by ``tool_choice`` use the same grammar kind (:mod:`.tools`); they
cannot be combined with these fields.

Only shapes are checked here; :class:`~common.sampling.SamplingParams` bounds the spec's
size and syntax in the router, and the worker compiles it (a schema that does not
compile is a 400 naming ``structured``).
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from protos.pdserve.v1 import common_pb2
from router.errors import RouterError

Kind = common_pb2.StructuredOutput


def _bad(param: str, message: str) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs")
"""The body fields that ask for structured output."""

_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
"""The keys of ``structured_outputs`` this front takes."""


def structured_output(body: dict[str, Any]) -> common_pb2.StructuredOutput | None:
    """The one structured-output request of ``body``, or None (JSON null is absent)."""
    found = [(name, body[name]) for name in FIELDS if body.get(name) is not None]
    parsed = [(name, _parse(name, v)) for name, v in found]
    parsed = [(name, s) for name, s in parsed if s is not None]
    if len(parsed) > 1:
        names = ", ".join(name for name, _ in parsed)
        raise _bad(parsed[1][0], f"only one structured-output field may be set, got {names}")
    return parsed[0][1] if parsed else None


def _parse(name: str, v: Any) -> common_pb2.StructuredOutput | None:
    if name == "response_format":
        return _response_format(v)
    if name == "structured_outputs":
        return _structured_outputs(v)
    return _guided(name, v)


def _response_format(v: Any) -> common_pb2.StructuredOutput | None:
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Kind(kind=Kind.KIND_JSON_OBJECT)
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _bad("response_format", "response_format json_schema needs "
                                          "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return Kind(kind=Kind.KIND_JSON_SCHEMA, spec=_dumps(spec["schema"]))
    raise _bad("response_format", "response_format must be {\"type\": \"text\"}, "
                                  "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                                  f"\"json_schema\": {{...}}}}; got type {kind!r}")


def _guided(name: str, v: Any, label: str | None = None) -> common_pb2.StructuredOutput:
    """``name``: a ``guided_*`` field or a key of ``structured_outputs`` (``label``)."""
    param = "structured_outputs" if label else name
    label = label or name
    if name in ("guided_json", "json"):
        if isinstance(v, str):  # the schema's JSON text: SamplingParams checks its syntax
            return Kind(kind=Kind.KIND_JSON_SCHEMA, spec=v)
        if not isinstance(v, dict):
            raise _bad(param, f"{label} must be a JSON schema (an object or its JSON text)")
        return Kind(kind=Kind.KIND_JSON_SCHEMA, spec=_dumps(v))
    if name in ("guided_regex", "regex"):
        if not isinstance(v, str) or not v:
            raise _bad(param, f"{label} must be a non-empty string (a regular expression)")
        return Kind(kind=Kind.KIND_REGEX, spec=v)
    if name in ("guided_grammar", "grammar"):
        if not isinstance(v, str) or not v.strip():
            raise _bad(param, f"{label} must be a non-empty string (a grammar in "
                              "llguidance's Lark dialect, or GBNF)")
        return Kind(kind=Kind.KIND_GRAMMAR, spec=v)
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise _bad(param, f"{label} must be a non-empty list of non-empty strings")
    return Kind(kind=Kind.KIND_CHOICE, spec=_dumps(v))


def _structured_outputs(v: Any) -> common_pb2.StructuredOutput | None:
    if not isinstance(v, dict):
        raise _bad("structured_outputs", "structured_outputs must be an object")
    given = {k: x for k, x in v.items() if x is not None and x is not False}
    unknown = sorted(set(given) - set(_OUTPUTS_KEYS))
    if unknown:
        raise _bad("structured_outputs", f"structured_outputs.{unknown[0]} is not supported; "
                                         f"use one of {', '.join(_OUTPUTS_KEYS)}")
    if len(given) > 1:
        raise _bad("structured_outputs", "structured_outputs takes one of "
                                         f"{', '.join(_OUTPUTS_KEYS)}; got {', '.join(given)}")
    if not given:
        return None
    [(key, x)] = given.items()
    if key == "json_object":
        return Kind(kind=Kind.KIND_JSON_OBJECT)
    return _guided(key, x, f"structured_outputs.{key}")


def _dumps(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
