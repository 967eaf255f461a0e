"""What the chaos harness asks of a launcher (benchmarks.chaos_targets), and which
scenarios each launcher refuses: pure logic, fakes for the cluster, no processes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.chaos import ChaosOptions, run_chaos
from benchmarks.chaos_faults import NETWORK, SCENARIOS, shape_of, victim_of
from benchmarks.chaos_targets import UNSUPPORTED, Component, ProcessTarget, refused
from cluster.cli import main
from cluster.cli.options import EXIT_INVALID


def test_ray_refuses_kill_router_and_kill_redis_saying_why() -> None:
    why = refused("ray", ["none", "kill-router", "kill-decode", "kill-redis", "kill-router"])
    assert len(why) == 2
    assert why[0].startswith("kill-router is not available with --launcher ray")
    assert "one router" in why[0]
    assert why[1].startswith("kill-redis is not available with --launcher ray")
    assert "does not supervise Redis" in why[1]


def test_ray_runs_every_other_scenario_and_process_runs_all() -> None:
    assert refused("process", SCENARIOS) == []
    runnable = [s for s in SCENARIOS if s not in UNSUPPORTED["ray"]]
    assert refused("ray", runnable) == []
    assert {"stop-redis", "flush-redis", "kill-decode", "kill-mixed"} <= set(runnable)


def test_ray_refuses_the_network_faults_and_names_the_launcher_that_runs_them() -> None:
    why = refused("ray", ["none", *NETWORK])
    assert len(why) == len(NETWORK) and all("--launcher process" in w for w in why)


def test_network_faults_run_over_test_hosts_against_the_linked_decode_worker() -> None:
    target = ProcessTarget(_local_cluster())  # type: ignore[arg-type]
    for s in NETWORK:
        assert shape_of(s) == "hosts"
        victim = "redis" if s == "slow-redis" else "decode-0"
        assert [victim_of(target, s, k) for k in range(2)] == [victim, victim]
    assert {shape_of(s) for s in SCENARIOS if s not in NETWORK} == {"disagg", "mixed"}


def test_each_network_fault_is_put_on_and_taken_off_the_link() -> None:
    from benchmarks.chaos_faults import DELAY_MS, JITTER_MS, LOSS, REDIS_DELAY_MS, _impair

    calls: list[tuple] = []
    host = SimpleNamespace(cut=lambda down=True: calls.append(("cut", down)),
                           shape=lambda **kw: calls.append(("shape", kw)))
    for s in NETWORK:
        _impair(host, s, True)  # type: ignore[arg-type]
        _impair(host, s, False)  # type: ignore[arg-type]
    assert calls == [
        ("shape", {"delay_ms": DELAY_MS, "jitter_ms": JITTER_MS}), ("shape", {}),
        ("shape", {"loss": LOSS}), ("shape", {}),
        ("cut", True), ("cut", False),
        ("shape", {"delay_ms": REDIS_DELAY_MS, "jitter_ms": JITTER_MS}), ("shape", {})]


def test_cli_network_faults_need_test_hosts(monkeypatch, capsys, tmp_path) -> None:
    """Asked for where test hosts cannot be made: refused with how to run them; by
    default: skipped, saying why, and the rest runs."""
    import benchmarks.chaos
    import benchmarks.chaos_report
    import benchmarks.machine
    import cluster.testhosts
    import workers.model_store

    monkeypatch.setattr(cluster.testhosts, "unavailable", lambda: "no namespace here")
    assert main(["chaos", "--scenarios", "none,loss-kv"]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert "no namespace here" in err and "unshare -n" in err
    seen: dict = {}
    monkeypatch.setattr(workers.model_store, "resolve_model", lambda m, c: tmp_path / "m")
    monkeypatch.setattr(benchmarks.machine, "machine_line", lambda: "a machine")
    monkeypatch.setattr(benchmarks.chaos, "run_chaos",
                        lambda o, say, parse=None: seen.update(o=o) or {"shapes": []})
    monkeypatch.setattr(benchmarks.chaos_report, "write", lambda r, o, h: ("", []))
    assert main(["chaos", "--out", str(tmp_path)]) == 0
    assert "skipping the network scenarios" in capsys.readouterr().err
    assert seen["o"].scenarios == tuple(s for s in SCENARIOS if s not in NETWORK)


def test_unknown_launcher_is_named() -> None:
    assert refused("k8s", ["none"]) == ["unknown launcher 'k8s'; choose from process, ray"]


def test_run_chaos_refuses_before_starting_anything(tmp_path) -> None:
    refused_ray = ChaosOptions(model="m", out_dir=str(tmp_path), launcher="ray",
                               scenarios=("none", "kill-router"))
    with pytest.raises(ValueError, match="kill-router is not available"):
        run_chaos(refused_ray)
    no_parser = ChaosOptions(model="m", out_dir=str(tmp_path), launcher="ray",
                             scenarios=("none",))
    with pytest.raises(ValueError, match="needs parse"):
        run_chaos(no_parser)


class _Proc:
    def __init__(self, pid: int, alive: bool = True) -> None:
        self.pid, self.alive = pid, alive

    def poll(self) -> int | None:
        return None if self.alive else -9


def _local_cluster() -> SimpleNamespace:
    """A LocalCluster's surface: Redis, 1 prefill + 2 decode, two routers; decode-1 is
    dead and was restarted once."""
    procs = {"redis": _Proc(10), "prefill-0": _Proc(11), "decode-0": _Proc(12),
             "decode-1": _Proc(13, alive=False), "router": _Proc(14), "router-1": _Proc(15)}
    return SimpleNamespace(
        names=list(procs), proc=procs.__getitem__,
        restarts=lambda n: 1 if n == "decode-1" else 0,
        workers=[("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")],
        worker_addresses=["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"],
        targets=["127.0.0.1:7", "127.0.0.1:8"], target="127.0.0.1:7",
        redis_url="redis://127.0.0.1:6/0", gave_up=None)


def test_process_target_snapshot_names_roles_pids_and_addresses() -> None:
    target = ProcessTarget(_local_cluster())  # type: ignore[arg-type]
    assert target.components() == [
        Component("redis", "redis", 10, True, 0, ""),
        Component("prefill-0", "prefill", 11, True, 0, "127.0.0.1:1"),
        Component("decode-0", "decode", 12, True, 0, "127.0.0.1:2"),
        Component("decode-1", "decode", 13, False, 1, "127.0.0.1:3"),
        Component("router", "router", 14, True, 0, "127.0.0.1:7"),
        Component("router-1", "router", 15, True, 0, "127.0.0.1:8")]
    assert (target.target, target.targets) == ("127.0.0.1:7", ["127.0.0.1:7", "127.0.0.1:8"])
    assert target.redis_url == "redis://127.0.0.1:6/0" and target.gave_up is None


def test_victims_go_round_robin_over_the_components_of_their_role() -> None:
    target = ProcessTarget(_local_cluster())  # type: ignore[arg-type]
    assert [victim_of(target, "kill-decode", k) for k in range(3)] == [
        "decode-0", "decode-1", "decode-0"]
    assert [victim_of(target, "kill-router", k) for k in range(2)] == ["router", "router-1"]
    assert victim_of(target, "stop-redis", 0) == "redis"
    with pytest.raises(ValueError, match="no mixed component"):
        victim_of(target, "kill-mixed", 0)


def test_cli_refuses_a_ray_scenario_before_loading_a_model(capsys) -> None:
    assert main(["chaos", "--launcher", "ray", "--scenarios", "none,kill-redis"]) == EXIT_INVALID
    assert "kill-redis is not available with --launcher ray" in capsys.readouterr().err


def test_cli_on_ray_runs_what_ray_can_and_hands_over_the_component_parser(
        monkeypatch, tmp_path) -> None:
    import benchmarks.chaos
    import benchmarks.chaos_report
    import benchmarks.machine
    import workers.model_store
    from cluster.cli.component import component_config

    seen: dict = {}

    def fake_run(options: ChaosOptions, say: object, parse: object = None) -> dict:
        seen.update(options=options, parse=parse)
        return {"shapes": []}

    monkeypatch.setattr(workers.model_store, "resolve_model", lambda m, c: tmp_path / "m")
    monkeypatch.setattr(benchmarks.machine, "machine_line", lambda: "a machine")
    monkeypatch.setattr(benchmarks.chaos, "run_chaos", fake_run)
    monkeypatch.setattr(benchmarks.chaos_report, "write", lambda r, o, h: ("", []))
    assert main(["chaos", "--launcher", "ray", "--out", str(tmp_path)]) == 0
    options = seen["options"]
    assert options.launcher == "ray" and seen["parse"] is component_config
    assert options.scenarios == tuple(s for s in SCENARIOS if s not in UNSUPPORTED["ray"])
    assert {"kill-router", "kill-redis", *NETWORK} == set(UNSUPPORTED["ray"])


def test_kill_and_stop_signal_the_victims_current_process() -> None:
    """SIGKILL for a kill; SIGSTOP then SIGCONT for a stop (a ``sleep`` stands in for
    Redis: no worker address, so no wait for it to be busy)."""
    import asyncio
    import random
    import subprocess

    from benchmarks.chaos_faults import inject

    cluster = _local_cluster()
    sleeper = subprocess.Popen(["sleep", "30"])
    procs = {n: cluster.proc(n) for n in cluster.names} | {"redis": sleeper}
    cluster.proc = procs.__getitem__
    target = ProcessTarget(cluster)  # type: ignore[arg-type]
    try:
        note = asyncio.run(inject(target, "stop-redis", "redis", random.Random(0), (0.1, 0.1)))
        assert note == "stopped 0.1 s" and sleeper.poll() is None
        assert asyncio.run(inject(target, "kill-redis", "redis", random.Random(0), (1, 1))) == ""
        assert sleeper.wait(timeout=10) == -9
        assert not target.components()[0].running
    finally:
        sleeper.kill()
        sleeper.wait()
