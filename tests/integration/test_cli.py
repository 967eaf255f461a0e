"""The ``pdserve`` command line, as users and scripts call it."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_offline_json(tiny_checkpoints) -> None:
    r = pdserve("generate", "--offline", "--model", str(tiny_checkpoints["llama"]),
                "--max-tokens", "5", "--ignore-eos", "--threads", "1", "--kv-cache-gb", "0.01",
                "--json", "Hello there")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "finish_reason", "usage",
                        "ttft_s", "e2e_s"}
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(out["prompt_token_ids"]),
                            "completion_tokens": 5, "cached_tokens": 0}
    assert 0 < out["ttft_s"] <= out["e2e_s"]


def test_generate_rejects_bad_parameters_clearly(tiny_checkpoints) -> None:
    """Each bad value in a command of its own, the commands side by side (each spends
    its seconds importing torch)."""
    cases = [("--max-tokens", "0", "max_tokens"), ("--temperature", "-1", "temperature"),
             ("--top-p", "2", "top_p")]
    with ThreadPoolExecutor(len(cases)) as pool:
        runs = list(pool.map(lambda case: pdserve(
            "generate", "--offline", "--model", str(tiny_checkpoints["llama"]), case[0],
            case[1], "hi"), cases))
    for (flag, _, field), r in zip(cases, runs, strict=True):
        assert r.returncode == 2 and f"invalid request: {field}:" in r.stderr, (flag, r.stderr)


def test_missing_model_directory_is_explained(tmp_path) -> None:
    r = pdserve("generate", "--offline", "--model", str(tmp_path / "nope"), "hi")
    assert r.returncode != 0 and "nope" in r.stderr and "Traceback" not in r.stderr


def test_status_exits_nonzero_until_a_router_serves() -> None:
    from cluster.local import free_port

    r = pdserve("status", "--target", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert r.returncode == 1 and "not serving" in r.stderr and "pdserve up" in r.stderr


def test_status_and_generate_against_a_running_cluster(cluster) -> None:
    r = pdserve("status", "--target", cluster.target, "--json")
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["model"] == "llama" and status["workers"][0]["serving"] is True
    r = pdserve("generate", "--target", cluster.target, "--max-tokens", "4", "--ignore-eos",
                "--json", "Hello there")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 4 and out["usage"]["completion_tokens"] == 4
    assert out["prompt_token_ids"] and 0 < out["ttft_s"] <= out["e2e_s"]
    r = pdserve("generate", "--target", cluster.target, "--top-p", "0", "hi")
    assert r.returncode == 2 and "top_p" in r.stderr
    for _ in range(2):  # the second is a prefix-cache hit
        r = pdserve("generate", "--target", cluster.target, "--max-tokens", "2", "--json",
                    "The same long prompt, twice, so that its blocks are cached. " * 4)
        assert r.returncode == 0, r.stderr
    r = pdserve("status", "--target", cluster.target)
    assert r.returncode == 0 and "prefix hit" in r.stdout
    status = json.loads(pdserve("status", "--target", cluster.target, "--json").stdout)
    worker = status["workers"][0]
    assert 0 < int(worker["cachedPromptTokens"]) < int(worker["promptTokens"])


@pytest.mark.parametrize("pools", [["--prefill", "1"], ["--decode", "2"], ["--mixed", "0"]])
def test_up_rejects_pools_that_cannot_serve(pools: list[str]) -> None:
    r = pdserve("up", *pools)
    assert r.returncode == 2 and r.stderr.startswith("pdserve up: ") and "Traceback" not in r.stderr


def test_bench_against_a_running_cluster(cluster, tmp_path) -> None:
    out = tmp_path / "bench.json"
    r = pdserve("bench", "--target", cluster.target, "--num-requests", "8", "--input-len", "24",
                "--output-len", "6", "--request-rate", "50", "--slo-ttft-ms", "60000",
                "--slo-tpot-ms", "60000", "--max-token-id", "300", "--no-progress",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "Successful requests:" in r.stdout and "TTFT" in r.stdout
    m = json.loads(out.read_text())
    assert m["completed"] == 8 and m["failed"] == 0 and m["total_output_tokens"] == 48
    assert m["total_input_tokens"] == 8 * 24 and m["request_goodput"] > 0
    assert 0 < m["median_ttft_ms"] <= m["median_e2el_ms"] and m["mean_itl_ms"] > 0


def test_bench_sweep_writes_a_point_per_rate_and_the_curve(cluster, tmp_path) -> None:
    prefix = tmp_path / "sweep"
    r = pdserve("bench", "--target", cluster.target, "--num-requests", "4", "--input-len", "16",
                "--output-len", "3", "--sweep-rates", "20,5", "--slo-ttft-ms", "60000",
                "--max-token-id", "300", "--no-progress", "--out", str(prefix))
    assert r.returncode == 0, r.stderr
    curve = json.loads((tmp_path / "sweep-sweep.json").read_text())
    assert [p["request_rate"] for p in curve] == [5.0, 20.0]  # low to high
    assert all(p["completed"] == 4 and p["request_goodput"] > 0 for p in curve)
    assert (tmp_path / "sweep-rate5.json").exists() and (tmp_path / "sweep-rate20.json").exists()
    r = pdserve("bench", "--target", cluster.target, "--sweep-rates", "fast")
    assert r.returncode == 2 and "--sweep-rates" in r.stderr


def test_bench_over_openai_http_matches_grpc_counts_and_plots(cluster, tmp_path) -> None:
    """The same workload through the router's OpenAI HTTP front and its gRPC API: the
    same requests and tokens are counted, both runs write their plots, and --compare
    tabulates them side by side."""
    runs = {}
    for name, target in (("grpc", cluster.target), ("http", cluster.http_url)):
        out = tmp_path / f"{name}.json"
        r = pdserve("bench", "--target", target, "--num-requests", "6", "--input-len", "20",
                    "--output-len", "5", "--request-rate", "30", "--max-token-id", "300",
                    "--no-progress", "--out", str(out))
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(out.read_text())
        assert out.with_suffix(".png").stat().st_size > 10_000
    assert runs["http"]["backend"] == "openai" and runs["grpc"]["backend"] == "grpc"
    for m in runs.values():
        assert m["completed"] == 6 and m["failed"] == 0 and m["total_output_tokens"] == 30
        assert m["total_input_tokens"] == 6 * 20 and m["mean_ttft_ms"] > 0
        assert len(m["details"]["ttfts"]) == 6
    assert runs["grpc"]["details"]["queue"], "the gRPC backend samples the server's queues"
    r = pdserve("bench", "--compare", str(tmp_path / "grpc.json"), str(tmp_path / "http.json"),
                "--out", str(tmp_path / "cmp.png"))
    assert r.returncode == 0, r.stderr
    assert "median_ttft_ms" in r.stdout and "x)" in r.stdout
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


def test_bench_multi_turn_conversations_reuse_their_history(cluster, tmp_path) -> None:
    out = tmp_path / "mt.json"
    r = pdserve("bench", "--target", cluster.target, "--workload", "multi-turn",
                "--num-requests", "2", "--turns", "3", "--input-len", "100", "--output-len", "4",
                "--max-token-id", "300", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())
    assert m["completed"] == 6 and m["failed"] == 0
    # turn k's prompt holds turn k-1's whole prompt: the prefix cache serves its whole
    # blocks (prompts of 100, 204, 308 tokens: 0, 192, 256 cached at the default 64)
    assert m["cached_token_ratio"] > 0.2


def test_bench_draws_prompt_ids_from_the_served_vocabulary(cluster, tmp_path) -> None:
    """The tiny model's vocabulary is 384 ids: the harness asks the server which ids are
    ordinary tokens (gRPC Tokenize, HTTP /tokenize) and every request succeeds; with
    ids past the vocabulary every request fails, and so does the run, in one line."""
    for name, target in (("grpc", cluster.target), ("http", cluster.http_url)):
        out = tmp_path / f"{name}.json"
        r = pdserve("bench", "--target", target, "--num-requests", "4", "--input-len", "16",
                    "--output-len", "3", "--no-progress", "--out", str(out))
        assert r.returncode == 0, r.stderr
        assert "ordinary tokens of" in r.stderr
        m = json.loads(out.read_text())
        assert m["completed"] == 4 and m["failed"] == 0 and m["total_input_tokens"] == 64
    r = pdserve("bench", "--target", cluster.target, "--num-requests", "3", "--input-len", "8",
                "--output-len", "2", "--max-token-id", "30000", "--no-progress")
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pdserve bench: 3 of 3 requests failed (first error: ")
    assert last.endswith("; exit 1") and "Traceback" not in r.stderr
    r = pdserve("bench", "--target", cluster.target, "--num-requests", "3", "--input-len", "8",
                "--output-len", "2", "--max-token-id", "30000", "--max-failed-fraction", "1",
                "--no-progress")
    assert r.returncode == 0, r.stderr


def test_bench_against_a_dead_port_fails_fast_in_one_line() -> None:
    import time

    from cluster.local import free_port

    port = free_port()
    for target, extra in ((f"127.0.0.1:{port}", ()), (f"http://127.0.0.1:{port}", ()),
                          (f"http://127.0.0.1:{port}", ("--max-token-id", "300"))):
        started = time.monotonic()
        r = pdserve("bench", "--target", target, "--num-requests", "2", "--no-progress", *extra)
        assert r.returncode == 1, (target, r.stderr)
        assert time.monotonic() - started < 30
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("pdserve bench: ") and last.endswith("; exit 1"), r.stderr
        assert f"127.0.0.1:{port}" in last and "Traceback" not in r.stderr


def test_worker_flags_reach_its_transfer_channel(tiny_checkpoints) -> None:
    """`pdserve worker`'s KV channel settings land in the TransferConfig it serves with
    (both ends of an early offer wait by them)."""
    from cluster.cli import build_parser
    from cluster.cli.component import worker_config

    model = str(tiny_checkpoints["llama"])
    args = build_parser().parse_args(["worker", "--role", "prefill", "--model", model,
                                      "--kv-offer", "step", "--kv-offer-timeout-s", "7.5",
                                      "--transfer-timeout-s", "12"])
    transfer = worker_config(args).transfer
    assert (transfer.offer, transfer.early_go_timeout_s, transfer.data_timeout_s) == (
        "step", 7.5, 12.0)
    defaults = worker_config(build_parser().parse_args(
        ["worker", "--role", "decode", "--model", model])).transfer
    assert (defaults.offer, defaults.early_go_timeout_s) == ("layers", 60.0)
