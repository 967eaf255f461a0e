"""The offline tools of ``pdserve bench-headline`` on a committed run
(loadtest/results/headline-xeon-1206-remembered/, its runs.tgz unpacked, one seed):
``--report-only``'s table and target checks (benchmarks/headline_report.py) reproduce
the run's own report, and benchmarks.planner_replay rebuilds the planner's predictions
per decision, the remembered view's memory filled only from windows the running
configuration served whole. Pure: files and the simulator."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from benchmarks import planner_replay
from benchmarks.headline_report import ITL_RATIOS, checks, itl_p99_ratio, report
from common.cost_model import load_profile

RUN = Path(__file__).resolve().parents[2] / "loadtest/results/headline-xeon-1206-remembered"
PROFILE = RUN.parents[0] / "served-decode-table-xeon-1205/profile.json"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("headline")
    for f in RUN.glob("*.json"):
        shutil.copy(f, root)
    with tarfile.open(RUN / "runs.tgz") as t:
        t.extractall(root, members=[m for m in t.getmembers() if m.name.startswith(
            "mixed-s1-")], filter="data")
    options = json.loads((root / "options.json").read_text())
    (root / "options.json").write_text(json.dumps({**options, "seeds": [1]}))
    return root


@pytest.fixture(scope="module")
def rows(root) -> list[dict]:
    return planner_replay.replay(root, load_profile(str(PROFILE)), [15.0], 5.0)


def test_report_only_reproduces_the_runs_table(root, capsys):
    """The seed's table as the run printed it, first->second token gaps included (read
    from the per-point details), and its targets: 4 of 4 goodput points within 5% of
    the better baseline, the high-load ITL p99 targets missed."""
    summary = report(root, ("mixed",), (1,))
    out = capsys.readouterr().out
    printed = "\n".join(line for line in out.splitlines() if not line.startswith(ITL_RATIOS))
    saved = (RUN / "report.txt").read_text()
    table = saved[saved.index("seed 1"):saved.index("targets met")].strip()
    assert table in printed
    assert "missing sweeps" not in printed and (root / "headline.json").exists()
    verdicts = [checks(*(next(p for p in json.loads((
        root / f"mixed-s1-{c}-sweep.json").read_text()) if p["fraction"] == f)
        for c in ("colocated", "static", "adaptive"))) for f in (0.25, 0.5, 0.85, 1.2)]
    assert all(v["goodput >= best - 5%"] for v in verdicts)
    assert not any(v["ITL p99 <= 0.5 x colocated (high load)"] for v in verdicts[2:])
    # Seed 1's points: 4 goodput checks met, ITL p99 at low load (25%) met and at high
    # load (85%, 120%) missed; colocated never saturated (2.19 req/s served of 2.06
    # offered at 120%), so the 1.5x check applies nowhere: 5 of 7.
    assert (summary["targets_met"], summary["targets"]) == (5, 7)
    assert printed.rstrip().endswith("headline-*.png") and "targets met: 5 of 7" in printed


def test_the_itl_p99_ratio_comes_with_a_bootstrap_interval(root, tmp_path, capsys):
    """The run's own points: the ratio is A's ITL p99 over C's as the sweep reports them,
    inside its interval, and the line is printed after the table. A point whose gaps
    are all twice colocated's is 2x, its interval excluding 1x; the same run against
    itself is 1x, the interval around it; no per-request file: None."""
    summary = report(root, ("mixed",), (1,))
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith(ITL_RATIOS))
    assert line.count("%") == 5  # four points, and the 90%
    for f in (0.25, 0.5, 0.85, 1.2):
        ratio, lo, hi = itl_p99_ratio(root, "mixed", 1, "adaptive", f)
        sweep = {c: next(p for p in json.loads((
            root / f"mixed-s1-{c}-sweep.json").read_text()) if p["fraction"] == f)
            for c in ("colocated", "adaptive")}
        assert ratio == pytest.approx(sweep["adaptive"]["p99_itl_ms"]
                                      / sweep["colocated"]["p99_itl_ms"], rel=1e-6)
        assert lo <= ratio <= hi and f"{f:.0%} {ratio:.2f}x ({lo:.2f}-{hi:.2f})" in line
        assert next(r for r in summary["rows"] if r["fraction"] == f)[
            "itl_p99_ratio_interval"] == [lo, hi]
    run = json.loads((root / "mixed-s1-colocated-f0.5.json").read_text())
    times = run["details"]["token_times"]
    slow = {**run, "details": {**run["details"], "token_times": [
        [t[0] + 2 * (x - t[0]) for x in t] for t in times]}}
    for name, data in (("colocated", run), ("adaptive", slow), ("same", run)):
        (tmp_path / f"mixed-s1-{name}-f0.5.json").write_text(json.dumps(data))
    ratio, lo, hi = itl_p99_ratio(tmp_path, "mixed", 1, "adaptive", 0.5)
    assert ratio == pytest.approx(2.0) and 1.0 < lo <= 2.0 <= hi
    ratio, lo, hi = itl_p99_ratio(tmp_path, "mixed", 1, "same", 0.5)
    assert ratio == pytest.approx(1.0) and lo < 1.0 < hi
    assert itl_p99_ratio(tmp_path, "mixed", 1, "adaptive", 0.85) is None


def test_every_view_of_every_point_is_replayed(rows):
    assert {(r["fraction"], r["view"]) for r in rows} == {
        (f, v) for f in (0.25, 0.5, 0.85, 1.2) for v in planner_replay.VIEWS}
    assert all(r["decisions"] >= 1 and r["predicted"] > 0 for r in rows)
    # The adaptive cluster never split in this run: its measured ratio is two mixed
    # clusters', and mixed had its own calibration at every decision after the first
    # window (the first point's first decisions had refused fits).
    adaptive = [r for r in rows if r["view"] == "remembered"]
    assert {r["adaptive_split"] for r in adaptive} == {"mixed"}
    assert all(0.9 < r["measured"] < 1.1 for r in adaptive)
    assert [r["own"] for r in adaptive if r["fraction"] > 0.25] == ["m", "m", "m"]


def test_the_static_views_predict_the_split_within_a_factor_of_two(rows):
    """Predicted split / mixed on 15 s windows of a baseline's steps against the measured
    static / colocated ratio: off by x1.1 on average in this run, never by 2x."""
    for r in rows:
        if r["view"] in ("colocated", "static"):
            assert 0.5 < r["predicted"] / r["measured"] < 2.0, r
    print(planner_replay.report(rows))


def test_the_capped_cluster_is_colocated_with_the_planners_smallest_cap(tmp_path) -> None:
    from benchmarks.headline import HeadlineOptions, _config
    from planner.caps import prefill_caps

    o = HeadlineOptions(model="m", profile=str(PROFILE), out=str(tmp_path))
    capped, colocated = (_config(o, name, tmp_path, None) for name in ("capped", "colocated"))
    assert capped.prefill_tokens_while_decoding == prefill_caps(
        load_profile(str(PROFILE)), 1)[1] > 0
    assert colocated.prefill_tokens_while_decoding == 0
    assert capped.pool_sizes() == colocated.pool_sizes()
    assert "capped" not in o.clusters  # only when named


def test_the_split_cluster_is_the_split_the_adaptive_planner_would_switch_to(tmp_path) -> None:
    """Its pools are the planner's split's, and it has the profile: its router places
    each prompt live, as the adaptive cluster's does once split (without the profile
    the router would place by the static threshold: another configuration)."""
    from benchmarks.headline import HeadlineOptions, _config
    from planner.moves import current_config, reachable

    o = HeadlineOptions(model="m", profile=str(PROFILE), out=str(tmp_path))
    split, adaptive = (_config(o, name, tmp_path, None) for name in ("split", "adaptive"))
    assert split.pool_sizes() == {"prefill": 1, "decode": 1, "mixed": 0}
    assert split.profile == adaptive.profile == str(PROFILE)
    assert not split.autoscale and adaptive.autoscale
    planned = reachable(2, 1, adaptive.local_prefill_threshold, adaptive.itl_budget_ms,
                        adaptive.kv_offer)
    held = current_config({"a": "prefill", "b": "decode"}, planned)
    assert held is not None and held.kind == "adaptive"  # live placement, as the split's
    assert "split" not in o.clusters  # only when named
    # The adaptive cluster's planner runs rule 2b unless told not to; no other cluster plans.
    assert adaptive.autoscale_itl and not split.autoscale_itl
    goodput_only = dataclasses.replace(o, autoscale_itl=False)
    assert not _config(goodput_only, "adaptive", tmp_path, None).autoscale_itl


def test_the_clusters_take_each_point_in_turn_the_order_alternating():
    """Seed k's point j runs the clusters in sweep_order(names, k + j): A B, B A, A B, B A
    through a seed, lowest load first, and the next seed starts the other way."""
    from benchmarks.headline import schedule, sweep_order

    clusters = ("colocated", "static", "adaptive")
    assert [sweep_order(clusters, k) for k in range(3)] == [
        clusters, ("adaptive", "static", "colocated"), clusters]
    assert sweep_order(("colocated",), 1) == ("colocated",)
    pair = ("colocated", "adaptive")
    runs = [[name for _, _, turn in schedule(pair, k, (1.2, 0.25, 0.85, 0.5)) for name in turn]
            for k in range(2)]
    c, a = pair
    assert runs == [[c, a, a, c, c, a, a, c], [a, c, c, a, a, c, c, a]]
    assert [f for _, f, _ in schedule(pair, 0, (1.2, 0.25))] == [0.25, 1.2]


def test_a_low_rate_point_runs_at_least_min_sessions():
    from benchmarks.headline import HeadlineOptions, point_sessions

    o = HeadlineOptions(model="m", profile="")
    assert point_sessions(o, 0.188) == 16  # 25% of an EPYC's chat: ~85 s, not 6 sessions
    assert point_sessions(o, 0.9) == 27  # 120%: 30 s of arrivals
    assert point_sessions(dataclasses.replace(o, min_sessions=8), 0.188) == 8


def test_saturation_is_judged_at_high_load_only():
    """A 25% point whose goodput is under 80% of the offered rate (a few long prompts
    past the TTFT SLO among 20 requests) is not a saturated one; an 85% point is."""
    def point(fraction, goodput):
        return {"fraction": fraction, "rate": 1.0, "request_goodput": goodput,
                "p99_itl_ms": 50.0}

    key = "goodput >= 1.5 x colocated (saturated)"
    low, high = point(0.25, 0.7), point(0.85, 0.7)
    assert checks(low, low, low)[key] is None
    assert checks(high, high, high)[key] is False
    assert checks(high, high, point(0.85, 1.1))[key] is True
    assert checks(point(0.85, 0.9), high, high)[key] is None  # served: not saturated


def test_report_only_names_the_clusters_and_workloads_the_run_swept(root, tmp_path, capsys):
    from benchmarks.headline import HeadlineOptions, run_headline

    for f in root.glob("*.json"):
        shutil.copy(f, tmp_path)
    options = json.loads((tmp_path / "options.json").read_text())
    (tmp_path / "options.json").write_text(json.dumps(
        {**options, "clusters": ["colocated", "static", "adaptive", "capped"],
         "workloads": ["mixed"]}))
    run_headline(HeadlineOptions(model="m", profile="", seeds=(1,),  # default workloads
                                 out=str(tmp_path)), report_only=True)
    printed = capsys.readouterr().out
    assert "colocated, static, adaptive, capped; 2 workers" in printed
    assert "workloads mixed;" in printed and "chat: no calibration" not in printed


def test_report_only_tabulates_whichever_clusters_ran(root, tmp_path, capsys):
    """A run of colocated, split and adaptive (``--clusters colocated,split,adaptive``):
    a column per cluster, in the table's order, and the targets checked against
    colocated alone, said so."""
    for f in root.glob("*.json"):
        if "-static-" not in f.name:
            shutil.copy(f, tmp_path)
    static = json.loads((root / "mixed-s1-static-sweep.json").read_text())
    (tmp_path / "mixed-s1-split-sweep.json").write_text(json.dumps(
        [{**p, "cluster": "split", "request_goodput": 2 * p["request_goodput"]}
         for p in static]))
    summary = report(tmp_path, ("mixed",), (1,))
    printed = capsys.readouterr().out
    assert "missing sweeps (static): the better baseline is colocated's" in printed
    assert "goodput C / P / A" in printed and "ITL p99 ms C / P / A" in printed
    row = summary["rows"][0]
    assert row["request_goodput_split"] == 2 * static[0]["request_goodput"]
    assert "request_goodput_static" not in row
    assert summary["targets"] == 7  # the adaptive cluster's, as with static
