"""``pdserve bench-multinode``'s own logic: link conditions, shaping all-or-nothing, the
tables' ratios, and the transfer bench's mode list (no hosts, no cluster)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.multinode import (
    Condition,
    LinkRow,
    SweepRow,
    _no_nan,
    apply,
    link_table,
    parse_condition,
    parse_conditions,
    parse_kv_offers,
    pool_rounds,
    private_netns_argv,
    sweep_table,
)
from benchmarks.transfer import parse_modes
from cluster.testhosts import HostsError


@pytest.mark.parametrize("text, rate, delay_ms, name", [
    ("none", None, 0.0, "unshaped"),
    (" Unshaped ", None, 0.0, "unshaped"),
    ("rate=1gbit", "1gbit", 0.0, "tbf 1gbit"),
    ("100mbit", "100mbit", 0.0, "tbf 100mbit"),
    ("delay=10ms", None, 10.0, "netem delay 10 ms"),
    ("1ms", None, 1.0, "netem delay 1 ms"),
    ("2.5", None, 2.5, "netem delay 2.5 ms"),
    ("delay=500us", None, 0.5, "netem delay 0.5 ms"),
    ("delay=1s", None, 1000.0, "netem delay 1000 ms"),
    ("rate=100mbit+delay=1ms", "100mbit", 1.0, "tbf 100mbit + netem delay 1 ms"),
])
def test_conditions_parse(text, rate, delay_ms, name):
    c = parse_condition(text)
    assert (c.rate, c.delay_ms, c.name) == (rate, delay_ms, name)
    assert c.shaped == (rate is not None or delay_ms > 0)


@pytest.mark.parametrize("text", ["rate=fast", "delay=soon", "speed=1gbit", "delay=0ms",
                                  "1gbit+2gbit", "1ms+delay=2ms", "rate=1ms", ""])
def test_bad_conditions_are_refused(text):
    with pytest.raises(ValueError):
        parse_condition(text)


def test_condition_lists():
    assert parse_conditions("none,rate=1gbit,delay=1ms") == (
        Condition(), Condition("1gbit"), Condition(delay_ms=1.0))
    with pytest.raises(ValueError, match="twice"):
        parse_conditions("none,unshaped")
    with pytest.raises(ValueError, match="twice"):
        parse_conditions("1ms,delay=1ms")
    with pytest.raises(ValueError):
        parse_conditions(" , ")


class _Host:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, []

    def shape(self, rate=None, delay_ms=0.0):
        self.calls.append((rate, delay_ms))
        if self.fail and delay_ms:
            raise HostsError("tc netem is not available here")


def test_shaping_is_all_or_nothing():
    ok, bad = _Host(), _Host(fail=True)
    assert apply([ok, bad], Condition("1gbit")) is None
    assert ok.calls == bad.calls == [("1gbit", 0.0)]
    ok.calls.clear(), bad.calls.clear()
    why = apply([ok, bad], Condition(delay_ms=10.0))
    assert why == "tc netem is not available here"
    # the first host was shaped before the second failed: both end unshaped
    assert ok.calls == [(None, 10.0), (None, 0.0)]
    assert bad.calls == [(None, 10.0), (None, 0.0)]


def test_link_rates_and_ratios():
    r = LinkRow("tbf 1gbit", "float32", 10**9,
                {"raw": [3.0, 1.0, 2.0], "direct": [4.0], "gather": []})
    assert r.gbps("raw") == pytest.approx(0.5)  # the median time, 2 s
    assert r.vs_raw("direct") == pytest.approx(0.5)
    assert math.isnan(r.vs_raw("gather"))
    table = link_table([r, LinkRow("netem delay 1 ms", unavailable="no sch_netem")])
    row, missing = table.splitlines()[2:]
    assert row.split("|")[4:7] == [" 0.500 ", " 0.250 ", " 50% "]
    assert "| — | — |" in row
    assert "not available: no sch_netem" in missing
    assert missing.count("|") == table.splitlines()[0].count("|")


def test_sweep_ratios_are_against_the_unshaped_row():
    rows = [SweepRow("unshaped", [0.1, 0.3, 0.2], [0.02, 0.04], 2_000_000, 0.01),
            SweepRow("tbf 100mbit", [0.25], [0.2], 1_000_000, 0.1),
            SweepRow("netem delay 1 ms", unavailable="no sch_netem")]
    lines = sweep_table(rows).splitlines()
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]
    # one protocol: no baseline to hold the gap against
    assert cells == ["", "tbf 100mbit", "1", "250.0", "1.25", "200.0", "6.67", "—", "0.010"]
    base = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert base == ["", "unshaped", "3", "200.0", "1.00", "30.0", "1.00", "—", "0.200"]
    assert "not available: no sch_netem" in lines[4]
    assert lines[4].count("|") == lines[0].count("|")
    # without an unshaped row there is nothing to compare with
    alone = [c.strip() for c in sweep_table(rows[1:2]).splitlines()[2].split("|")[1:-1]]
    assert alone[4] == alone[6] == "—"


def test_sweep_gaps_are_against_the_last_protocol_in_the_same_condition():
    rows = [SweepRow("unshaped", [0.7], [0.03], kv_offer="layers"),
            SweepRow("tbf 1gbit", [0.8], [0.06], kv_offer="layers"),
            SweepRow("unshaped", [0.7], [0.06], kv_offer="after"),
            SweepRow("tbf 1gbit", [0.7], [0.24], kv_offer="after")]
    lines = sweep_table(rows).splitlines()
    assert "gap / after" in lines[0]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
    # the gap against `after` in the same condition; the unshaped ratios within a protocol
    assert [c[0] for c in cells] == ["layers", "layers", "after", "after"]
    assert [c[7] for c in cells] == ["0.50", "0.25", "1.00", "1.00"]
    assert [c[6] for c in cells] == ["1.00", "2.00", "1.00", "4.00"]
    assert cells[1][4] == "1.14"


def test_kv_offer_lists():
    assert parse_kv_offers(" layers, After ") == ("layers", "after")
    with pytest.raises(ValueError, match="unknown KV offer protocol 'fast'"):
        parse_kv_offers("layers,fast")
    with pytest.raises(ValueError, match="twice"):
        parse_kv_offers("after,after")
    with pytest.raises(ValueError, match="no KV offer"):
        parse_kv_offers(" , ")


def test_results_are_strict_json():
    out = _no_nan({"a": [1.0, math.nan], "b": (math.nan, {"c": math.nan}), "d": "x"})
    assert out == {"a": [1.0, None], "b": [None, {"c": None}], "d": "x"}
    json.dumps(out, allow_nan=False)


def test_rerun_in_a_private_namespace_keeps_the_arguments():
    argv = private_netns_argv(["python", "-m", "cluster.cli", "bench-multinode",
                               "--conditions", "none, rate=1gbit"])
    assert argv[:3] == ["unshare", "-n", "sh"]
    assert argv[-2:] == ["--conditions", "none, rate=1gbit"]  # no shell re-splitting
    assert argv[4] == 'ip link set lo up && exec "$@"'


def test_transfer_modes():
    assert parse_modes("gather,raw,direct") == ("raw", "direct", "gather")
    with pytest.raises(ValueError, match="include raw"):
        parse_modes("direct")
    with pytest.raises(ValueError, match="unknown"):
        parse_modes("raw,teleport")


def test_rounds_pool_into_one_row_per_protocol_and_condition():
    rows = [SweepRow("unshaped", [0.7], [0.03], 10, 0.5, kv_offer="layers"),
            SweepRow("unshaped", [0.8], [0.06], 20, 1.0, kv_offer="after"),
            SweepRow("netem delay 1 ms", unavailable="no sch_netem", kv_offer="after"),
            SweepRow("unshaped", [0.9, 1.0], [0.05, 0.01], 30, 0.5, kv_offer="layers"),
            SweepRow("unshaped", [0.6], [0.08], 20, 1.0, kv_offer="after"),
            SweepRow("netem delay 1 ms", unavailable="no sch_netem", kv_offer="after")]
    pooled = pool_rounds(rows)
    assert [(r.kv_offer, r.condition) for r in pooled] == [
        ("layers", "unshaped"), ("after", "unshaped"), ("after", "netem delay 1 ms")]
    layers = pooled[0]
    assert layers.ttft_s == [0.7, 0.9, 1.0] and layers.gap_s == [0.03, 0.05, 0.01]
    assert (layers.kv_bytes, layers.kv_busy_s) == (40, 1.0)
    assert layers.gap_p50 == pytest.approx(0.03)
    assert pooled[2].unavailable == "no sch_netem" and not pooled[2].gap_s
    # available in one round: its requests are the row's, not "not available"
    mixed = pool_rounds([SweepRow("tbf 1gbit", unavailable="tc failed", kv_offer="after"),
                         SweepRow("tbf 1gbit", [0.7], [0.2], kv_offer="after")])
    assert mixed[0].unavailable is None and mixed[0].gap_s == [0.2]
    assert rows[0].ttft_s == [0.7]  # the rounds' own rows are left as they were
