"""``pdserve chaos``'s CI scenario set: one fault of each type on a tiny model, under
steady load, with the real launcher, its supervision, two routers and the resuming
client. Fails on any wrong, missing or duplicated token, any client-visible failure,
any leaked KV block or a component that does not come back. Recovery times are
reported, not held to (a shared 2-core CI box makes them noise); the long run in the
README is what holds them to 10 s."""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import ChaosOptions, run_chaos
from benchmarks.chaos_report import failed_checks, write
from cluster.cli.chaos import QUICK

CI_SCENARIOS = ("none", "kill-decode", "kill-prefill", "kill-router", "kill-redis",
                "stop-decode", "flush-redis", "flip-kv", "cancel")


def _run(tiny_checkpoints, tmp_path, scenarios: tuple[str, ...], title: str
         ) -> tuple[str, dict[str, dict]]:
    """Run ``scenarios`` once each on the tiny llama (``--quick``); fail on any missed
    target but recovery times; the one cluster shape and its rows by scenario, each row
    having run its load (over 20 requests)."""
    options = ChaosOptions(model=str(tiny_checkpoints["llama"]), out_dir=str(tmp_path),
                           scenarios=scenarios, faults=1, block_size=4,
                           **QUICK)  # type: ignore[arg-type]
    report = run_chaos(options, print)
    md, _ = write(report, tmp_path, title)
    print(md)
    missed = [m for m in failed_checks(report) if "recovered in" not in m]
    assert not missed, missed
    [shape] = report["shapes"]
    rows = {r["scenario"]: r for r in shape["rows"]}
    assert set(rows) == set(scenarios)
    assert all(r["sent"] > 20 for r in rows.values()), {s: r["sent"] for s, r in rows.items()}
    return shape["shape"], rows


def test_ci_scenarios_lose_no_token_and_leak_no_block(tiny_checkpoints, tmp_path) -> None:
    _, rows = _run(tiny_checkpoints, tmp_path, CI_SCENARIOS, "CI chaos")
    for killed in ("kill-decode", "kill-prefill", "kill-router", "kill-redis"):
        assert rows[killed]["restarts"] == 1, (killed, rows[killed])
    assert rows["kill-router"]["resumes"] > 0  # streams that lost their router resumed
    assert rows["cancel"]["cancelled"] > 0
    assert rows["flip-kv"]["failed_transfers"] > 0  # corrupted KV was refused, recomputed
    assert json.loads((tmp_path / "chaos.json").read_text())["missed"] is not None


def test_network_faults_lose_no_token_and_leak_no_block(tiny_checkpoints, tmp_path) -> None:
    """The network scenarios, once each: the cluster spread over test hosts; a decode
    worker's link (its KV arrives over it) slowed, made lossy, then cut for a while, and
    Redis's link slowed, under load. Every stream token-exact, nothing failed, nothing
    leaked, the link really dropped frames while lossy."""
    from benchmarks.chaos_faults import NETWORK
    from cluster.testhosts import unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no test hosts: {why}")
    shape, rows = _run(tiny_checkpoints, tmp_path, NETWORK, "CI chaos: network")
    assert shape == "hosts"
    assert all(r["restarts"] == 0 for r in rows.values())
    [note] = [n for n in rows["loss-kv"]["notes"] if "frames dropped" in n]
    assert int(note.split(", ")[-1].split()[0]) > 0, note
