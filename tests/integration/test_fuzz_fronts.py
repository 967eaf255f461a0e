"""The trust boundary, fuzzed: hostile requests (``loadtest/fuzz_inputs.py``) thrown at
the HTTP and gRPC fronts of a real disaggregated cluster (tiny llama, one prefill and one
decode worker) while a victim request runs, and ``loadtest/fuzz_checks.py``'s properties:
no 5xx, no exception text, whole answers, every victim token-exact, no block leaked.

Hypothesis runs derandomized (the same examples every run), without a database or a
deadline. ``make test`` sends EXAMPLES per endpoint; ``pdserve fuzz --examples 10000``
runs the long version against any running cluster. The checker itself is pinned first,
in milliseconds, so a fuzz run that passes means the properties held, not that the
checks were blind.
"""

from __future__ import annotations

import json

import grpc
import pytest
from cluster_helpers import assert_cluster_idle, start

from loadtest import fuzz
from loadtest.fuzz_checks import check_grpc, check_http
from loadtest.fuzz_inputs import MISSING, Pairs, Raw, json_text, shorten

EXAMPLES = 150
"""Per endpoint: 600 in all, 35-45 s on 2 shared cores with the cluster's start."""


def kinds(problems: list[tuple[str, str, str]]) -> set[str]:
    return {k for k, _, _ in problems}


def test_checker_flags_server_errors_exception_text_and_cut_answers() -> None:
    def http(status: int, body: bytes, content_type: str = "application/json") -> set[str]:
        return kinds(check_http(status, content_type, body))

    def rpc(code: grpc.StatusCode, details: str = "", finished: bool = False) -> set[str]:
        return kinds(check_grpc(code, details, finished))

    sse = "text/event-stream"
    assert http(500, b'{"error":{"message":"internal error: ValueError: bad"}}') == {
        "5xx", "exception text"}
    assert http(400, b'{"error":{"message":"temperature must be finite, got inf"}}') == set()
    assert http(500, b"500 Internal Server Error", "text/plain") == {"5xx", "bad answer"}
    assert http(400, b'{"error":{"message":"maximum recursion depth exceeded"}}') == {
        "exception text"}
    done = b'data: {"choices":[{"text":"a","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    assert http(200, done, sse) == set()
    assert http(200, done[:-15], sse) == {"bad answer"}
    assert http(200, b'data: {"error":{"message":"x","type":"server_error"}}\n\n'
                     b"data: [DONE]\n\n", sse) == {"5xx"}
    assert http(200, b'{"choices":[{}]}') == {"bad answer"}
    assert rpc(grpc.StatusCode.UNKNOWN, "Unexpected <class 'google.protobuf.message."
               "DecodeError'>: Error parsing") == {"5xx", "exception text"}
    for fine in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.NOT_FOUND):
        assert rpc(fine, "prompt: must contain at least 1 token") == set()
    assert rpc(grpc.StatusCode.UNAVAILABLE, "no decode worker could take it") == {"5xx"}
    assert rpc(grpc.StatusCode.OK, finished=False) == {"bad answer"}
    assert rpc(grpc.StatusCode.OK, finished=True) == set()


def test_json_text_writes_what_json_dumps_will_not() -> None:
    body = Pairs([("t", float("nan")), ("t", Raw("1e400")), ("s", "\ud800"),
                  ("gone", MISSING), ("d", Raw("[" * 3 + "]" * 3))])
    assert json_text(body) == '{"t":NaN,"t":1e400,"s":"\\ud800","d":[[[]]]}'
    assert json_text({"s": "\ud800"}, ascii_only=False).encode("utf-8", "surrogatepass") == (
        b'{"s":"\xed\xa0\x80"}')
    assert shorten("x" * 70_000) == "<'x' x 70000>"


@pytest.fixture(scope="module")
def pd_cluster(tiny_checkpoints, tmp_path_factory):
    c = start(tiny_checkpoints["llama"], tmp_path_factory.mktemp("fuzz-logs"), prefill=1,
              decode=1)
    yield c
    c.stop()


@pytest.mark.parametrize("endpoint", list(fuzz.ENDPOINTS))
def test_hostile_requests_get_no_5xx_no_exception_text_hurt_no_victim_and_leak_nothing(
        pd_cluster, endpoint: str) -> None:
    report = fuzz.run(fuzz.FuzzConfig(target=pd_cluster.target, http_url=pd_cluster.http_url,
                                      endpoints=(endpoint,), examples=EXAMPLES))
    [er] = report.endpoints
    assert er.examples == EXAMPLES and er.victims >= 1 and report.vocab_size > 0
    if not report.ok:  # the table and every distinct failure, not the report's repr
        pytest.fail(f"\n{report.table()}\n{report.describe_failures()}", pytrace=False)
    assert_cluster_idle(pd_cluster)


def test_pdserve_fuzz_prints_the_table_writes_json_and_exits_by_the_result(
        pd_cluster, tmp_path, capsys) -> None:
    from cluster.cli import main
    from cluster.cli.fuzz import read_key_file

    keys = tmp_path / "keys"
    keys.write_text("# KEY TENANT [admin]\n\nsk-fuzz-tenant-0000000001 acme\n"
                    "sk-fuzz-admin-00000000002 ops admin  # the one for GetStatus\n")
    assert read_key_file(str(keys)) == ("sk-fuzz-tenant-0000000001", "sk-fuzz-admin-00000000002")
    out = tmp_path / "fuzz.json"
    rc = main(["fuzz", "--target", pd_cluster.target, "--http", pd_cluster.http_url,
               "--examples", "20", "--endpoints", "grpc-tokenize", "--api-key-file", str(keys),
               "--json", str(out)])
    report = json.loads(out.read_text())
    [row] = report["endpoints"]
    assert row["endpoint"] == "grpc-tokenize" and row["examples"] == 20
    assert rc == (0 if report["ok"] else 1)
    assert "grpc-tokenize" in capsys.readouterr().out
    assert main(["fuzz", "--endpoints", "nope"]) == 2
