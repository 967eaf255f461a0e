"""A worker's Prometheus metrics, sampled from the engine loop and its KV channel end.

Lifecycle: built by the server once the engine runs; :meth:`WorkerMetrics.sample` runs
every ``interval_s`` on the server's event loop (a task from :meth:`run`): gauges take
the engine's last load snapshot, counters advance by what the engine's and the channel's
totals grew since the previous sample. Nothing is recorded on the engine thread's hot
path beyond :class:`workers.engine_loop.EngineCounters`' integer additions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.metrics import Metrics

from .engine_loop import EngineLoop
from .transfer import ChannelStats

TERMINAL = ("done", "failed", "timed_out", "cancelled")


class WorkerMetrics:
    def __init__(self, metrics: Metrics, loop: EngineLoop,
                 transfer_stats: Callable[[], ChannelStats | None]) -> None:
        self.metrics, self._loop, self._transfer_stats = metrics, loop, transfer_stats
        self._seen: dict[str, float] = {}

    def _advance(self, key: str, total: float, name: str, **labels: str) -> None:
        """Increment ``name`` by how much ``total`` grew since the last sample."""
        grew = total - self._seen.get(key, 0.0)
        self._seen[key] = total
        self.metrics.inc(name, grew, **labels)

    def sample(self) -> None:
        m, load, c = self.metrics, self._loop.load(), self._loop.counters
        m.set("num_requests_running", load.running)
        m.set("num_requests_waiting", load.waiting)
        m.set("num_requests_reserved", load.reserved)
        m.set("kv_blocks_free", load.free_blocks)
        m.set("kv_blocks_total", load.total_blocks)
        used = load.total_blocks - load.free_blocks
        m.set("kv_cache_usage_perc", used / load.total_blocks if load.total_blocks else 0.0)
        self._advance("gen", c.generation_tokens, "engine_generation_tokens_total")
        self._advance("fwd", c.forward_s, "engine_forward_seconds_total")
        self._advance("fwd_cpu", c.forward_cpu_s, "engine_forward_cpu_seconds_total")
        self._advance("thread_cpu", c.thread_cpu_s, "engine_thread_cpu_seconds_total")
        self._advance("queries", c.prompt_tokens, "prefix_cache_queries_total")
        self._advance("hits", c.cached_prompt_tokens, "prefix_cache_hits_total")
        for reason, n in list(c.finished.items()):
            self._advance(f"finished/{reason}", n, "engine_requests_finished_total",
                          finished_reason=reason)
        stats = self._transfer_stats()
        if stats is None:
            return
        self._advance("bytes", stats.bytes_moved, "kv_transfer_bytes_total")
        self._advance("busy", stats.busy_s, "kv_transfer_busy_seconds_total")
        self._advance("checksum", stats.checksum_failures,
                      "kv_transfer_checksum_failures_total")
        for state in TERMINAL:
            self._advance(f"xfer/{state}", stats.entered.get(state, 0), "kv_transfers_total",
                          state=state)
        m.set("kv_transfers_in_flight", stats.in_flight)
        for reason, n in list(stats.refused.items()):  # reasons: a fixed set in the receiver
            self._advance(f"refused/{reason}", n, "kv_transfer_refused_total", reason=reason)

    async def run(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass
        self.sample()
