"""The configurations a fixed set of workers reaches by changing roles, and the moves
between them: :func:`reachable` (all mixed, or every P:D split), :func:`current_config`
(which of them the workers' roles form now), :func:`role_changes` (which worker takes
which role, in an order that never leaves the router without a way to serve),
:func:`moves` and :func:`serving_while_moving` (what serves while they change: the
switch's cost in :class:`planner.autoscale.Autoscaler`). Pure: :mod:`cluster.autoscale`
carries the changes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .config import PoolConfig


def reachable(workers: int, threads: int, static_threshold: int,
              adaptive_itl_budget_ms: float | None = None,
              kv_offer: str = "layers",
              ttft_slo_ms: float | None = None) -> list[PoolConfig]:
    """The configurations ``workers`` workers of ``threads`` threads each reach by
    changing roles: all mixed, or every P:D split (adaptive instead of static when the
    router places prompts live, to ``ttft_slo_ms`` when it has that target; the prefill
    workers offering KV by ``kv_offer``)."""
    out = [PoolConfig("mixed", mixed_workers=workers, mixed_threads=threads)]
    kind = "adaptive" if adaptive_itl_budget_ms else "disaggregated"
    for p in range(1, workers):
        out.append(PoolConfig(kind, prefill_workers=p, decode_workers=workers - p,
                              prefill_threads=threads, decode_threads=threads,
                              local_prefill_threshold=static_threshold,
                              itl_budget_ms=adaptive_itl_budget_ms, kv_offer=kv_offer,
                              ttft_slo_ms=ttft_slo_ms if adaptive_itl_budget_ms else None))
    return out


def _sizes(config: PoolConfig) -> dict[str, int]:
    return {"mixed": config.mixed_workers, "prefill": config.prefill_workers,
            "decode": config.decode_workers}


def moves(current: PoolConfig, target: PoolConfig) -> list[str]:
    """The roles the workers that change leave, one per worker, in
    :func:`role_changes`' order (by role: mixed, prefill, decode)."""
    have, want = _sizes(current), _sizes(target)
    return [role for role in have for _ in range(max(0, have[role] - want[role]))]


def serving_while_moving(current: PoolConfig, target: PoolConfig) -> PoolConfig | None:
    """The pools that serve while the first worker of ``current -> target`` changes its
    role: ``current`` less that worker; whole requests on the workers left when they
    no longer form a prefill and a decode pool (as the router serves then). None: no
    worker is left. Later changes of the same switch are taken to serve alike (exact
    for two workers: one serves, colocated, while the other changes)."""
    leaving = moves(current, target)
    if not leaving:
        return current
    sizes = _sizes(current)
    sizes[leaving[0]] -= 1
    if sum(sizes.values()) == 0:
        return None
    if sizes["mixed"] or not (sizes["prefill"] and sizes["decode"]):
        threads = max(current.mixed_threads, current.prefill_threads, current.decode_threads)
        return PoolConfig("mixed", mixed_workers=sum(sizes.values()), mixed_threads=threads,
                          prefill_tokens_while_decoding=current.prefill_tokens_while_decoding)
    return replace(current, prefill_workers=sizes["prefill"], decode_workers=sizes["decode"])


def role_changes(roles: dict[str, str], target: PoolConfig) -> list[tuple[str, str]]:
    """``(worker, new role)`` moves taking workers (``worker -> role`` now) to ``target``'s
    pool sizes, fewest moves, in an order that never leaves the router without a way to
    serve: a worker leaving the last mixed slot goes to decode first (the router serves
    colocated on whatever workers remain while the others change)."""
    want = _sizes(target)
    if sum(want.values()) != len(roles):
        raise ValueError(f"{target.label} needs {sum(want.values())} workers, the cluster "
                         f"has {len(roles)}")
    have = {r: sorted(w for w, role in roles.items() if role == r) for r in want}
    spare = [w for r in want for w in have[r][want[r]:]]  # beyond their role's target
    missing = [r for r in ("decode", "prefill", "mixed")
               for _ in range(max(0, want[r] - len(have[r])))]
    return list(zip(spare, missing, strict=True))


def current_config(roles: dict[str, str],
                   candidates: Sequence[PoolConfig]) -> PoolConfig | None:
    """The candidate whose pool sizes the workers' roles (``worker -> role``) have now;
    None when none does (a role change half done)."""
    n = {r: sum(1 for role in roles.values() if role == r)
         for r in ("mixed", "prefill", "decode")}
    return next((c for c in candidates if _sizes(c) == n), None)
