"""Regenerate ``pdserve-dashboard.json`` from the metrics catalog:
``python deploy/grafana/make_dashboard.py`` (a test checks the file is current).

One row per question an operator asks: is it serving (requests, errors, in flight),
how fast (TTFT, ITL, end-to-end percentiles, tokens/s), where is the pressure (queues
and KV use per worker, the P:D pools), is the cache working (prefix hit rates, routing
reasons) and is KV moving (transfer rate, failures, migrations). Import it in Grafana
with a Prometheus data source that scrapes the router and the workers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.metrics import CATALOG, PREFIX  # noqa: E402

OUT = Path(__file__).with_name("pdserve-dashboard.json")
M = '{model=~"$model"}'
R = "[$__rate_interval]"


def q(name: str) -> str:
    assert any(s.name == name or f"{s.name}_bucket" == name for s in CATALOG), name
    return PREFIX + name


def quantiles(name: str) -> list[tuple[str, str]]:
    return [(f"p{int(p * 100)}", f"histogram_quantile({p}, sum by (le) "
             f"(rate({q(name + '_bucket')}{M}{R})))") for p in (0.5, 0.9, 0.99)]


PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Requests / s by status", "reqps",
     [("{{status}}", f"sum by (status) (rate({q('requests_total')}{M}{R}))")]),
    ("Requests in flight (router)", "short",
     [("in flight", f"sum({q('requests_in_flight')}{M})")]),
    ("Workers by role (router's view)", "short",
     [("{{role}}", f"max by (role) ({q('workers')}{M})")]),
    ("Time to first token", "s", quantiles("time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("inter_token_latency_seconds")),
    ("End-to-end request latency", "s", quantiles("e2e_request_latency_seconds")),
    ("Tokens / s", "short",
     [("output", f"sum(rate({q('generation_tokens_total')}{M}{R}))"),
      ("prompt", f"sum(rate({q('prompt_tokens_total')}{M}{R}))"),
      ("prompt, from cache", f"sum(rate({q('cached_prompt_tokens_total')}{M}{R}))")]),
    ("Queue depth per worker", "short",
     [("{{worker}} waiting", f"{q('num_requests_waiting')}{M}"),
      ("{{worker}} running", f"{q('num_requests_running')}{M}"),
      ("{{worker}} reserved", f"{q('num_requests_reserved')}{M}")]),
    ("KV cache use per worker", "percentunit",
     [("{{role}} {{worker}}", f"{q('kv_cache_usage_perc')}{M}")]),
    ("Prefix cache hit rate by role", "percentunit",
     [("{{role}}", f"sum by (role) (rate({q('prefix_cache_hits_total')}{M}{R})) / "
                   f"sum by (role) (rate({q('prefix_cache_queries_total')}{M}{R}))")]),
    ("Routing decisions / s by reason", "short",
     [("{{policy}}/{{reason}}",
       f"sum by (policy, reason) (rate({q('routing_decisions_total')}{M}{R}))")]),
    ("Prefix index: matched share of looked-up blocks (router)", "percentunit",
     [("{{backend}}",
       f"sum by (backend) (rate({q('prefix_index_matched_blocks_total')}{M}{R}))"
       f" / sum by (backend) (rate({q('prefix_index_lookup_blocks_total')}{M}{R}))")]),
    ("Prefix index lookup latency, errors", "s",
     quantiles("prefix_index_lookup_seconds")
     + [("errors / s {{op}}", f"sum by (op) (rate({q('prefix_index_errors_total')}{M}{R}))")]),
    ("KV transfer rate (decode side)", "Bps",
     [("{{worker}}", f"sum by (worker) (rate({q('kv_transfer_bytes_total')}"
                     f'{{model=~"$model",role="decode"}}{R}))')]),
    ("KV transfers / s by outcome", "short",
     [("{{role}} {{state}}", f"sum by (role, state) (rate({q('kv_transfers_total')}{M}{R}))")]),
    ("KV-channel messages refused, payload checksum failures / s (decode side)", "short",
     [("{{worker}} {{reason}}",
       f"sum by (worker, reason) (rate({q('kv_transfer_refused_total')}{M}{R}))"),
      ("{{worker}} checksum mismatch",
       f"sum by (worker) (rate({q('kv_transfer_checksum_failures_total')}{M}{R}))")]),
    ("KV transfers in flight, migrations", "short",
     [("transfers in flight", f"sum({q('kv_transfers_in_flight')}{M})"),
      ("migrations / s", f"sum(rate({q('request_migrations_total')}{M}{R}))")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 8, "x": (i % 3) * 8, "y": (i // 3) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + k), "expr": expr, "legendFormat": legend}
                        for k, (legend, expr) in enumerate(targets)],
        })
    return {
        "title": "pdserve", "uid": "pdserve-overview", "schemaVersion": 39, "version": 1,
        "editable": True, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "tags": ["pdserve", "llm-serving"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus",
             "label": "Prometheus"},
            {"name": "model", "type": "query", "label": "model", "includeAll": True,
             "multi": True, "current": {"text": "All", "value": "$__all"},
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": f"label_values({q('kv_blocks_total')}, model)", "refresh": 2},
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
