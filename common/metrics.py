"""Prometheus metrics: one catalog, recorded to ``prometheus_client`` and, under Ray,
mirrored into ``ray.util.metrics`` so they also show on the Ray dashboard.

Names follow vLLM's (``vllm:num_requests_running`` -> ``pdserve:num_requests_running``,
``vllm:time_to_first_token_seconds`` -> ``pdserve:time_to_first_token_seconds``) and
Dynamo's frontend ones (requests by status, in-flight, inter-token latency), so existing
dashboards and alerts translate by prefix. Ray forbids ``:`` in names: there they are
``pdserve_...`` (and Ray's exporter adds ``ray_``).

Lifecycle: a component builds one :class:`Metrics` at start (``labels`` are constant
per process: ``model``, ``role``, ``worker``; a worker's ``role`` changes with
:meth:`Metrics.relabel`), records through :meth:`Metrics.inc`,
:meth:`Metrics.set` and :meth:`Metrics.observe` (cheap; any thread), and serves the
text format with :meth:`Metrics.serve` on ``--metrics-port`` (127.0.0.1 by default).
This module sits in the bottom layer: it imports nothing of ours.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import prometheus_client as prom

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0)
_INDEX_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Spec:
    name: str  # without the prefix
    kind: str  # counter | gauge | histogram
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


CATALOG: tuple[Spec, ...] = (
    # router (the frontend): what clients see
    Spec("requests_total", "counter", "Requests answered, by gRPC status code "
         "(OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, ...)", ("status",)),
    Spec("requests_in_flight", "gauge", "Requests admitted by the router and not finished"),
    Spec("time_to_first_token_seconds", "histogram", "Request received -> first token sent",
         buckets=_LATENCY_BUCKETS),
    Spec("inter_token_latency_seconds", "histogram", "Gap between consecutive output tokens",
         buckets=_ITL_BUCKETS),
    Spec("e2e_request_latency_seconds", "histogram", "Request received -> last token sent",
         buckets=_LATENCY_BUCKETS),
    Spec("prompt_tokens_total", "counter", "Prompt tokens of finished requests"),
    Spec("generation_tokens_total", "counter", "Output tokens of finished requests"),
    Spec("cached_prompt_tokens_total", "counter",
         "Prompt tokens whose KV came from a prefix cache (finished requests)"),
    Spec("routing_decisions_total", "counter", "Worker choices, by policy and reason "
         "(cache_hit, balance, least_work, local, ...)", ("policy", "reason")),
    Spec("prefill_placement_total", "counter", "Disaggregated prompts placed by the live "
         "rule (router/adaptive.py) or the overflow (router/dispatch.py: prefill_queue, "
         "prefill_short; kv_mismatch): where (local, remote) and why", ("where", "reason")),
    Spec("worker_stalls_total", "counter", "Workers found stalled (a prefill call or a "
         "reservation past the probe delay, then no answer to GetLoad): passed over until "
         "they answer (router/stall.py)", ("worker",)),
    Spec("planner_decisions_total", "counter", "The live planner's decisions (--autoscale): "
         "stay or switch, and why", ("action", "reason")),
    Spec("planner_predicted_goodput", "gauge", "Requests/s meeting the SLOs the planner "
         "predicts for each configuration on the last window of traffic", ("config",)),
    Spec("planner_served_share", "gauge", "The share of a recent window's requests the "
         "running configuration served within the SLOs, from the routers' logged "
         "latencies: times the arrival rate, the floor of its predicted goodput"),
    Spec("planner_served_tpot_bound", "gauge", "1 where that window's misses were the "
         "decode's (every ended request met the TTFT SLO, and more missed TPOT than are "
         "in flight or failed): the overloaded guard does not hold then; else 0"),
    Spec("planner_role_changes_total", "counter", "Role changes the planner made, by new role",
         ("role",)),
    Spec("planner_served_factor", "gauge", "The serving calibration the planner simulates "
         "with, refitted from the workers' served steps: memory and compute factors on the "
         "profile's step model, per_seq_ms the cost of a sequence, decode_min and decode_max "
         "the range of the decode steps' factors by batch size (0: none; all 0: the "
         "profile's own)",
         ("term",)),
    Spec("planner_served_steps", "gauge", "Served steps that calibration was fitted on (0: "
         "the fit was refused, too few steps or factors out of range; the profile's own)"),
    Spec("planner_move_seconds", "gauge", "Seconds a worker leaving the role took to change "
         "(drain, new KV channel end, registering again), a moving average of the planner's "
         "changes", ("role",)),
    Spec("planner_switch_seconds", "gauge", "The role changes' seconds the last switch the "
         "planner weighed would take (its cost: the capacity those changes take)"),
    Spec("planner_prefill_cap", "gauge", "The prompt tokens a worker step may compute while "
         "any request decodes, as the planner last set it on every worker (0: no cap; "
         "--prefill-tokens-while-decoding)"),
    Spec("planner_cap_decisions_total", "counter", "The live planner's decisions on that "
         "cap: keep or set, and why", ("action", "reason")),
    Spec("planner_predicted_itl_p99_ms", "gauge", "The inter-token latency p99 the planner "
         "predicts for the current configuration with each cap (0: none) on the last window",
         ("cap",)),
    Spec("planner_predicted_config_itl_p99_ms", "gauge", "The inter-token latency p99 the "
         "planner predicts for each configuration of near-best goodput on the last window, "
         "where it compared them (--autoscale-itl)", ("config",)),
    Spec("planner_predicted_headroom_goodput", "gauge", "The goodput the planner predicts "
         "for each configuration it compared at the heavier load of --autoscale-headroom "
         "(requests/s within the SLOs)", ("config",)),
    Spec("planner_decision_cpu_seconds", "gauge", "The CPU seconds the planner's thread "
         "spent on its last decision (recalibration and simulations; role changes not "
         "counted)"),
    Spec("planner_predicted_headroom_itl_p99_ms", "gauge", "The inter-token latency p99 the "
         "planner predicts for each configuration serving as much at the heavier load of "
         "--autoscale-headroom, where it compared them (--autoscale-itl)", ("config",)),
    Spec("request_migrations_total", "counter",
         "Requests moved to another worker after theirs failed mid-stream"),
    Spec("workers", "gauge", "Workers the router routes to, by role", ("role",)),
    Spec("stream_messages_total", "counter",
         "Stream messages through the router, by hop: worker (received from workers), "
         "grpc (sent to gRPC clients), http (SSE events written)", ("hop",)),
    Spec("stream_bytes_total", "counter",
         "Bytes of those messages, by hop (serialized protobuf; SSE event bytes)", ("hop",)),
    # the prefix index, as its user sees it (common/prefix_index: InstrumentedIndex)
    Spec("prefix_index_lookups_total", "counter",
         "Prefix-index lookups, by backend (redis, memory, ...)", ("backend",)),
    Spec("prefix_index_lookup_blocks_total", "counter",
         "Prompt blocks looked up in the prefix index, by backend", ("backend",)),
    Spec("prefix_index_matched_blocks_total", "counter",
         "Leading prompt blocks the best worker holds, per lookup, by backend "
         "(/ lookup_blocks = the index's hit rate)", ("backend",)),
    Spec("prefix_index_errors_total", "counter",
         "Prefix-index calls that raised, by backend and op (lookup, publish, purge, "
         "replace, blocks_of)", ("backend", "op")),
    Spec("prefix_index_slow_total", "counter",
         "Router lookups the shared index did not answer within the budget (answered from "
         "the router's routed memory; Redis skipped for a second)"),
    Spec("prefix_index_lookup_seconds", "histogram",
         "Prefix-index lookup latency (one round trip for redis), failed ones included",
         ("backend",), _INDEX_BUCKETS),
    # workers (the engines)
    Spec("num_requests_running", "gauge", "Requests in the engine's running batch"),
    Spec("num_requests_waiting", "gauge", "Requests queued for the engine"),
    Spec("num_requests_reserved", "gauge",
         "Decode role: requests holding blocks while their KV arrives"),
    Spec("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0-1)"),
    Spec("kv_blocks_free", "gauge", "Free KV blocks"),
    Spec("kv_blocks_total", "gauge", "KV blocks in the paged cache"),
    Spec("prefix_cache_queries_total", "counter",
         "Prompt tokens looked up in this worker's prefix cache"),
    Spec("prefix_cache_hits_total", "counter",
         "Prompt tokens found in this worker's prefix cache"),
    Spec("engine_generation_tokens_total", "counter", "Tokens this engine generated"),
    Spec("engine_forward_seconds_total", "counter",
         "Wall time in the model's forward (the engine thread), summed over steps"),
    Spec("engine_forward_cpu_seconds_total", "counter",
         "CPU time the engine thread itself spent in the forward (its intra-op helper "
         "threads not included)"),
    Spec("engine_thread_cpu_seconds_total", "counter",
         "CPU time of the engine thread: forward, scheduling, bookkeeping, hand-offs"),
    Spec("engine_requests_finished_total", "counter",
         "Requests this engine finished, by reason (stop, length, abort, remote)",
         ("finished_reason",)),
    Spec("kv_transfer_bytes_total", "counter", "KV bytes moved between prefill and decode"),
    Spec("kv_transfers_total", "counter",
         "KV transfers that reached a terminal state, by state "
         "(done, failed, timed_out, cancelled)", ("state",)),
    Spec("kv_transfers_in_flight", "gauge", "KV transfers not yet in a terminal state"),
    Spec("kv_transfer_refused_total", "counter",
         "KV-channel control messages a decode worker refused unacted on, by reason "
         "(bad_mac, stale, replay, unauthenticated, pairs_full, parked_full, ...)",
         ("reason",)),
    Spec("kv_transfer_checksum_failures_total", "counter",
         "KV payloads a decode worker received whole but whose checksum did not match the "
         "offer's: failed transfers (the prompt is recomputed), never decoded"),
    Spec("kv_transfer_busy_seconds_total", "counter",
         "KV ready -> landed, summed over done transfers (bytes / this = transfer rate)"),
    Spec("worker_role_changes_total", "counter",
         "Role changes this worker made in place (SetRole: drained, re-registered, weights "
         "kept), by the role it left and the one it took", ("from_role", "to_role")),
)

PREFIX = "pdserve:"
RAY_PREFIX = "pdserve_"


class Metrics:
    """The catalog bound to constant per-process labels.

    ``ray=True`` mirrors every record into ``ray.util.metrics`` (call it inside a Ray
    actor; Ray then exports them through its per-node metrics agent)."""

    def __init__(self, labels: dict[str, str] | None = None, ray: bool = False) -> None:
        self.labels = dict(labels or {})
        self.registry = prom.CollectorRegistry()
        self._prom: dict[str, object] = {}
        self._ray: dict[str, object] = {}
        const = tuple(self.labels)
        for s in CATALOG:
            keys = const + s.labels
            if s.kind == "counter":
                # prometheus_client appends _total itself
                m = prom.Counter(PREFIX + s.name.removesuffix("_total"), s.doc, keys,
                                 registry=self.registry)
            elif s.kind == "gauge":
                m = prom.Gauge(PREFIX + s.name, s.doc, keys, registry=self.registry)
            else:
                m = prom.Histogram(PREFIX + s.name, s.doc, keys, buckets=s.buckets,
                                   registry=self.registry)
            self._prom[s.name] = m
        if ray:
            self._ray = _ray_metrics(const)
        self._server: WSGIServer | None = None

    def _child(self, name: str, labels: dict[str, str]) -> object:
        m = self._prom[name]
        return m.labels(**self.labels, **labels) if (self.labels or labels) else m  # type: ignore[attr-defined]

    def _mirror(self, name: str, method: str, value: float, labels: dict[str, str]) -> None:
        m = self._ray.get(name)
        if m is not None:
            getattr(m, method)(value, tags={**self.labels, **labels})

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Add ``value`` (0 makes the series appear at 0, as Prometheus advises)."""
        if value < 0:
            return
        self._child(name, labels).inc(value)  # type: ignore[attr-defined]
        if value:
            self._mirror(name, "inc", value, labels)

    def set(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).set(value)  # type: ignore[attr-defined]
        self._mirror(name, "set", value, labels)

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._child(name, labels).observe(value)  # type: ignore[attr-defined]
        self._mirror(name, "observe", value, labels)

    def relabel(self, **labels: str) -> None:
        """Change constant labels from now on (a worker's ``role`` after a role change).
        Series recorded under the old values stay (a counter keeps what it counted
        there) except gauges, cleared: the next sample sets them under the new values,
        and a stale one would count twice in a sum. Ray tags each record, so its mirror
        follows; gauges it already exported under the old values linger there."""
        self.labels = {**self.labels, **labels}
        for s in CATALOG:
            if s.kind == "gauge":
                self._prom[s.name].clear()  # type: ignore[attr-defined]

    def text(self) -> str:
        """The Prometheus text exposition of everything recorded here."""
        return prom.generate_latest(self.registry).decode()

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on a daemon thread; returns the bound port (0: pick one).
        Raises OSError naming the address when it cannot bind."""
        try:
            server, thread = prom.start_http_server(port, host, registry=self.registry)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror or e} "
                                   "(another process's port? 0 picks a free one)") from e
        self._server = server
        self._thread: threading.Thread = thread
        bound = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _ray_metrics(const: tuple[str, ...]) -> dict[str, object]:
    from ray.util import metrics as rm

    out: dict[str, object] = {}
    for s in CATALOG:
        keys = const + s.labels
        name = RAY_PREFIX + s.name
        if s.kind == "counter":
            out[s.name] = rm.Counter(name, s.doc, keys)
        elif s.kind == "gauge":
            out[s.name] = rm.Gauge(name, s.doc, keys)
        else:
            out[s.name] = rm.Histogram(name, s.doc, list(s.buckets), keys)
    # Ray's metric objects name their record methods inc/set/observe like ours.
    return out
