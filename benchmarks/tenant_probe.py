"""``pdserve bench-tenant-probe``: can one tenant tell, from timing, what another cached?

A shared prefix cache is a timing side channel: a prompt another client sent recently
comes back faster (its KV is reused). This benchmark plays the attack and scores it.

One run, real processes on loopback, the default model, two clusters one after the other
(1 prefill + 1 decode worker each, one thread per worker):

1. **shared**: no API keys, so every client shares one prefix cache (pdserve before
   tenant salting; any server without per-tenant cache isolation);
2. **tenant-salted**: an API-key file with a ``victim`` and an ``attacker`` tenant, so
   each tenant's requests are salted with its tenant id (the default with keys).

In each, the victim sends ``--secrets`` prompts of ``--prompt-tokens`` random token ids
(seeded). Then the attacker probes, in a shuffled order, each secret prompt (a "hit" if
the cache leaks) and as many fresh prompts of the same length (certain misses), with
``max_tokens=1``, one request at a time, timing each request end to end at the client
(that is its TTFT plus one token). The attack's score is the **AUC** of the rule "faster
means the victim sent it": the probability that a random secret probe came back faster
than a random fresh probe (ties count half). 0.5 is a coin toss; 1.0 reads the victim's
cache perfectly. The attacker also sees ``usage.prompt_tokens_details.cached_tokens``,
reported beside it. Target (issue 14): AUC <= 0.55 with tenant salting.

Prints the workload, the machine and a table; ``--out`` writes the JSON.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from benchmarks.machine import cpu_name
from cluster.local import LocalCluster, LocalClusterConfig, free_port

VICTIM_KEY = "sk-probe-victim-" + "v" * 24
ATTACKER_KEY = "sk-probe-attacker-" + "a" * 24


@dataclass(frozen=True)
class TenantProbeOptions:
    model: str
    secrets: int = 24
    prompt_tokens: int = 384
    seed: int = 0
    out: str | None = None


def auc(hits: list[float], misses: list[float]) -> float:
    """P(a random hit is faster than a random miss), ties half (Mann-Whitney U / n*m)."""
    if not hits or not misses:
        raise ValueError("auc needs at least one hit and one miss")
    wins = sum((h < m) + 0.5 * (h == m) for h in hits for m in misses)
    return wins / (len(hits) * len(misses))


def _complete(url: str, key: str | None, ids: list[int]) -> tuple[float, int]:
    """One /v1/completions request: (seconds end to end, cached_tokens it reported)."""
    body = json.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers=headers)
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    elapsed = time.perf_counter() - t0
    details = out.get("usage", {}).get("prompt_tokens_details") or {}
    return elapsed, int(details.get("cached_tokens") or 0)


def _attack(url: str, victim_key: str | None, attacker_key: str | None,
            secrets: list[list[int]], fresh: list[list[int]], rng: random.Random) -> dict:
    for ids in secrets:
        _complete(url, victim_key, ids)
    probes = [("hit", ids) for ids in secrets] + [("miss", ids) for ids in fresh]
    rng.shuffle(probes)
    times: dict[str, list[float]] = {"hit": [], "miss": []}
    cached: dict[str, int] = {"hit": 0, "miss": 0}
    for kind, ids in probes:
        seconds, n = _complete(url, attacker_key, ids)
        times[kind].append(seconds)
        cached[kind] += n
    return {"auc": auc(times["hit"], times["miss"]),
            "hit_ms_median": 1e3 * sorted(times["hit"])[len(times["hit"]) // 2],
            "miss_ms_median": 1e3 * sorted(times["miss"])[len(times["miss"]) // 2],
            "attacker_cached_tokens_on_secrets": cached["hit"],
            "attacker_cached_tokens_on_fresh": cached["miss"]}


def _prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    # Ids from a range every supported tokenizer has as ordinary tokens; distinct first
    # tokens so no two prompts share a cached block.
    return [[1000 + i] + [rng.randrange(1000, 20000) for _ in range(length - 1)]
            for i in range(n)]


def run(o: TenantProbeOptions) -> dict:
    rng = random.Random(o.seed)
    report = {
        "workload": f"{o.secrets} secret + {o.secrets} fresh prompts of {o.prompt_tokens} "
                    "tokens, max_tokens 1, one request at a time, 1 prefill + 1 decode",
        "model": Path(o.model).name,
        "machine": f"{cpu_name()}, {os.cpu_count()} cpus",
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="pdserve-probe-") as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(f"{VICTIM_KEY} victim\n{ATTACKER_KEY} attacker\n")
        keys.chmod(0o600)
        for mode, api_keys in (("shared", None), ("tenant-salted", str(keys))):
            prompts = _prompts(rng, 2 * o.secrets, o.prompt_tokens)
            secrets, fresh = prompts[: o.secrets], prompts[o.secrets:]
            cfg = LocalClusterConfig(model=o.model, port=free_port(), http_port=free_port(),
                                     metrics_port=None, kv_cache_gb=1.0,
                                     threads_per_worker=1, api_keys=api_keys)
            with LocalCluster(cfg) as cluster:
                cluster.wait_ready()
                url = cluster.http_url
                assert url is not None
                victim, attacker = (VICTIM_KEY, ATTACKER_KEY) if api_keys else (None, None)
                _complete(url, victim, _prompts(random.Random(-1), 1, 64)[0])  # warm-up
                report["modes"][mode] = _attack(url, victim, attacker, secrets, fresh, rng)
    _print(report)
    if o.out:
        Path(o.out).parent.mkdir(parents=True, exist_ok=True)
        Path(o.out).write_text(json.dumps(report, indent=2))
    return report


def _print(report: dict) -> None:
    print(f"cross-tenant cache probing: {report['workload']}; model {report['model']}; "
          f"{report['machine']}")
    print(f"  {'mode':15}{'AUC':>7}{'hit ms p50':>12}{'miss ms p50':>13}"
          f"{'cached tokens seen (secret/fresh)':>36}")
    for mode, r in report["modes"].items():
        seen = (f"{r['attacker_cached_tokens_on_secrets']}/"
                f"{r['attacker_cached_tokens_on_fresh']}")
        print(f"  {mode:15}{r['auc']:7.3f}{r['hit_ms_median']:12.1f}"
              f"{r['miss_ms_median']:13.1f}{seen:>36}")
    print("  AUC: P(a secret probe is faster than a fresh one); 0.5 = no leak (target <= 0.55 "
          "tenant-salted)")
