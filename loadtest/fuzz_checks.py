"""What a fuzz run must find true of every answer, victim and worker, checked on what
came back (:mod:`loadtest.fuzz` sends; this module judges and tallies). Pure: no I/O.

Properties, and how each is checked:

* **No 5xx.** HTTP: status < 500, and no ``server_error``/``timeout_error`` event in an
  SSE stream. gRPC: no code in :data:`SERVER_FAULT`, the codes HTTP maps to 5xx (Google's
  mapping, as ``router/errors.py``): UNKNOWN, INTERNAL, DATA_LOSS (500), UNIMPLEMENTED
  (501) and UNAVAILABLE (503). pdserve refuses overload with RESOURCE_EXHAUSTED (429), so
  UNAVAILABLE under a fuzz run means a worker failed because of a request. Client faults
  (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAUTHENTICATED, ...) are fine.
* **No exception text** (:data:`EXCEPTION_TEXT`) in any error a client sees: HTTP error
  bodies and SSE error events, gRPC status details. Generated text is not checked.
* **Answers are whole** (counted as "bad answers"): a 200 body is JSON with a finish
  reason, an SSE stream ends with ``[DONE]`` after a finish reason or an error event, a
  gRPC stream that ends OK carries a finish reason, every HTTP error body is OpenAI
  error JSON; no request is dropped, times out (the run's ``request_timeout_s``) or goes
  unanswered.
* **Victims unhurt:** every victim run returns exactly the reference tokens, finishing
  on length.
* **No leak:** after each endpoint every serving worker is idle (nothing running,
  waiting, reserved or in transfer) with every KV block free, and the same workers
  serve as before (:mod:`loadtest.fuzz` waits for it and notes what is not).

Failures are grouped by signature (endpoint, kind, status, the start of the message
with numbers and hex ids folded); each group keeps its smallest example of each shape
(content coding, way of breaking a message), up to KEEP, so a report lists every
distinct bug once with reproducers (several: a server that answers every internal
error alike folds different bugs into one signature).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc

KEEP = 5
"""Examples kept per failure signature: the smallest of each shape, smallest first."""

SERVER_FAULT = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                          grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED,
                          grpc.StatusCode.UNAVAILABLE})
"""gRPC codes that count as a 5xx: the server's fault (see the module docstring)."""

EXCEPTION_TEXT = re.compile(
    r"Traceback \(most recent call last\)"
    r"|File \"[^\"]*\", line \d+"
    r"|\.py\"|\.pyx?:\d+"
    r"|<class '"
    r"|\b[A-Z][A-Za-z0-9_]*(?:Error|Exception)\b"
    r"|maximum recursion depth"
    r"|set_int_max_str_digits")
"""What only an exception (or its traceback) writes: a trace, a source file, a class
name like ``ValueError``, gRPC's ``Unexpected <class '...'>``, and Python's own words
for a recursion or integer-size limit (str() of the exception, not a message for
users)."""

# --------------------------------------------------------------------------- the report


@dataclass
class Failure:
    endpoint: str
    kind: str
    """``5xx``, ``exception text``, ``bad answer`` or ``victim``."""
    status: str
    message: str
    example: str = ""
    size: int = 0
    shape: str = ""
    """What sets the example apart beyond its body (its content coding, how a message was
    broken): a signature keeps its smallest example of each shape."""

    @property
    def signature(self) -> tuple[str, str, str, str]:
        folded = re.sub(r"\b[0-9a-f]{6,}\b|\d+", "N", self.message)  # ids, sizes, offsets
        return self.endpoint, self.kind, self.status, folded[:72]

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "kind": self.kind, "status": self.status,
                "message": self.message, "example": self.example, "example_bytes": self.size}


@dataclass
class EndpointReport:
    endpoint: str
    examples: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    """``2xx``/``4xx``/``5xx`` (HTTP) or the gRPC code name -> count."""
    server_errors: int = 0
    exception_text: int = 0
    bad_answers: int = 0
    victims: int = 0
    victims_hurt: int = 0
    leaked_blocks: int = 0
    settle_problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    failures: dict[tuple[str, ...], tuple[int, list[Failure]]] = field(default_factory=dict)
    """signature -> (how many times, its KEEP smallest examples, smallest first)."""

    @property
    def ok(self) -> bool:
        return not self.failures and not self.settle_problems

    def add(self, failure: Failure) -> None:
        counter = {"5xx": "server_errors", "exception text": "exception_text",
                   "bad answer": "bad_answers", "victim": "victims_hurt"}.get(failure.kind)
        if counter:
            setattr(self, counter, getattr(self, counter) + 1)
        n, kept = self.failures.get(failure.signature, (0, []))
        smallest: dict[str, Failure] = {}
        for f in sorted([*kept, failure], key=lambda f: f.size):
            smallest.setdefault(f.shape, f)
        self.failures[failure.signature] = (n + 1, list(smallest.values())[:KEEP])

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "examples": self.examples,
                "statuses": dict(self.statuses), "server_errors": self.server_errors,
                "exception_text": self.exception_text, "bad_answers": self.bad_answers,
                "victim_runs": self.victims, "victims_hurt": self.victims_hurt,
                "leaked_blocks": self.leaked_blocks, "settle_problems": self.settle_problems,
                "seconds": round(self.seconds, 2), "ok": self.ok,
                "failures": [{**fs[0].to_json(), "count": n,
                              "more_examples": [f.to_json() for f in fs[1:]]}
                             for n, fs in self.failures.values()]}


@dataclass
class FuzzReport:
    endpoints: list[EndpointReport]
    model: str = ""
    vocab_size: int = 0
    reference_tokens: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.endpoints)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "model": self.model, "vocab_size": self.vocab_size,
                "victim_reference_tokens": self.reference_tokens,
                "endpoints": [e.to_json() for e in self.endpoints]}

    def table(self) -> str:
        head = ("endpoint", "examples", "2xx/OK", "4xx", "5xx", "exc text", "bad", "victims",
                "hurt", "leaked", "seconds")
        rows = [head]
        for e in self.endpoints:
            ok_n = e.statuses.get("2xx", 0) + e.statuses.get("OK", 0)
            client = e.statuses.get("4xx", 0) + sum(
                n for s, n in e.statuses.items() if s not in ("2xx", "4xx", "5xx", "OK")
                and s not in {c.name for c in SERVER_FAULT})
            rows.append((e.endpoint, e.examples, ok_n, client, e.server_errors,
                         e.exception_text, e.bad_answers, e.victims, e.victims_hurt,
                         e.leaked_blocks, f"{e.seconds:.1f}"))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
        return "\n".join("  ".join(str(v).rjust(w) if i else str(v).ljust(w)
                                   for i, (v, w) in enumerate(zip(r, widths, strict=True)))
                         for r in rows)

    def describe_failures(self, limit: int = 600) -> str:
        """Every distinct failure once: endpoint, kind, status, count, message, and its
        smallest example of each shape."""
        lines = []
        for e in self.endpoints:
            lines += [f"{e.endpoint}: {p}" for p in e.settle_problems]
            for n, (f, *more) in e.failures.values():
                lines.append(f"{f.endpoint}: {f.kind} ({f.status}) x{n}: {f.message[:300]}")
                lines += [f"    example: {g.example[:limit]}" for g in (f, *more) if g.example]
        return "\n".join(lines) or "no failures"


# --------------------------------------------------------------------------- checking


def exception_text(text: str) -> str | None:
    """The exception-like part of ``text`` with some context, or None."""
    m = EXCEPTION_TEXT.search(text)
    return None if m is None else text[max(0, m.start() - 60):m.end() + 60]


def check_http(status: int, content_type: str, body: bytes) -> list[tuple[str, str, str]]:
    """(kind, status, message) for every property this HTTP answer breaks."""
    text = body.decode("utf-8", "replace")
    out: list[tuple[str, str, str]] = []
    if status >= 400:
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            out.append(("bad answer", str(status), f"error body is not OpenAI error JSON: "
                                                   f"{text[:200]!r}"))
            message = text
        if status >= 500:
            out.append(("5xx", str(status), str(message)[:500]))
        leak = exception_text(text)
        if leak:
            out.append(("exception text", str(status), leak))
        return out
    if status != 200:
        return [("bad answer", str(status), f"unexpected status {status}: {text[:200]!r}")]
    if content_type.startswith("text/event-stream"):
        return _check_sse(text)
    try:
        finish = json.loads(text)["choices"][0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError):
        return [("bad answer", "200", f"200 body is not a completion: {text[:200]!r}")]
    return [] if finish else [("bad answer", "200", "200 body has no finish_reason")]


def _check_sse(text: str) -> list[tuple[str, str, str]]:
    # The SSE grammar ends lines at CR, LF or CRLF only; str.splitlines also breaks
    # at NEL, U+2028 and U+2029, which may stand raw inside an event's JSON.
    lines = re.split(r"\r\n|\r|\n", text)
    events = [line[5:].strip() for line in lines if line.startswith("data:")]
    if not events or events[-1] != "[DONE]":
        return [("bad answer", "200", f"SSE stream does not end with [DONE]: {text[-200:]!r}")]
    out: list[tuple[str, str, str]] = []
    finished = False
    for data in events[:-1]:
        try:
            event = json.loads(data)
        except ValueError:
            return [("bad answer", "200", f"SSE event is not JSON: {data[:200]!r}")]
        error = event.get("error") if isinstance(event, dict) else None
        if error is not None:
            finished = True
            if isinstance(error, dict) and error.get("type") in ("server_error", "timeout_error"):
                out.append(("5xx", "200+sse", str(error.get("message"))[:500]))
            leak = exception_text(data)
            if leak:
                out.append(("exception text", "200+sse", leak))
            continue
        for choice in event.get("choices") or []:
            finished = finished or bool(choice.get("finish_reason"))
    if not finished:
        out.append(("bad answer", "200", "SSE stream ended without a finish_reason"))
    return out


def check_grpc(code: grpc.StatusCode, details: str, finished: bool
               ) -> list[tuple[str, str, str]]:
    """(kind, status, message) for every property this gRPC answer breaks."""
    out: list[tuple[str, str, str]] = []
    if code in SERVER_FAULT:
        out.append(("5xx", code.name, details[:500]))
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        out.append(("bad answer", code.name, "no answer within the request timeout"))
    elif code == grpc.StatusCode.OK and not finished:
        out.append(("bad answer", "OK", "the stream ended without a finish reason"))
    leak = exception_text(details)
    if leak:
        out.append(("exception text", code.name, leak))
    return out
