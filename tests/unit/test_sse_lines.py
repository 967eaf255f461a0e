"""Server-sent events with text that holds Unicode line separators: the front escapes
NEL, U+2028 and U+2029 in every event (router/openai/protocol.py ``dumps_event``) so
that a client splitting lines with ``str.splitlines`` still reads one JSON event, and
the fuzz checker (loadtest/fuzz_checks.py) splits lines as the SSE grammar does (CR,
LF, CRLF), so a raw separator inside valid JSON is not taken for a broken stream."""

from __future__ import annotations

import json

from loadtest.fuzz_checks import check_http
from router.openai.responses import SSE_DONE, sse
from router.openai.responses_events import sse_event

TEXT = "a\u2028b\x85c\u2029d\u00e9\n"


def _chunk(content: str, finish: str | None = None) -> dict:
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


def test_chat_event_survives_splitlines_and_round_trips():
    wire = sse(_chunk(TEXT)).decode()
    lines = wire.splitlines()
    assert lines == [lines[0], ""] and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["content"] == TEXT
    assert "\u00e9" in lines[0]  # other characters stay raw UTF-8


def test_responses_event_survives_splitlines_and_round_trips():
    wire = sse_event({"type": "response.output_text.delta", "delta": TEXT}).decode()
    event, data, blank = wire.splitlines()
    assert event == "event: response.output_text.delta" and blank == ""
    assert json.loads(data[6:])["delta"] == TEXT


def test_fuzz_checker_reads_raw_separators_as_the_sse_grammar_does():
    raw = json.dumps(_chunk(TEXT, "length"), ensure_ascii=False)
    assert "\u2028" in raw
    body = f"data: {raw}\r\n\r\n".encode() + SSE_DONE
    assert check_http(200, "text/event-stream", body) == []


def test_fuzz_checker_still_finds_a_cut_event():
    cut = json.dumps(_chunk("abc", "length"))[:-5]
    body = f"data: {cut}\n\n".encode() + SSE_DONE
    [(kind, status, message)] = check_http(200, "text/event-stream", body)
    assert (kind, status) == ("bad answer", "200") and "not JSON" in message
