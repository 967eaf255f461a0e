"""The worker registry in Redis: who serves, in which role, at which address, how loaded.

Contract (beside :mod:`common.prefix_index`, under the same ``pdserve:{model}:``):

- ``workers``: HASH worker id -> JSON :class:`WorkerInfo` (static: role, addresses,
  capacity, epoch);
- ``alive:{worker}``: JSON of the worker's live load, with a TTL that the worker's
  heartbeat refreshes. A worker whose ``alive`` key expired is dead: the first reader
  that notices removes it from ``workers`` and purges its index entries, so a crashed
  worker vanishes within one TTL.

Registration bumps the worker's epoch and purges what an earlier life of the same id
published (a restarted worker starts with an empty cache). JSON, never pickle.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import redis

from .prefix_index import RedisPrefixIndex


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str  # unique per model; the gRPC address is a natural choice
    role: str
    address: str
    total_blocks: int = 0
    block_size: int = 0
    epoch: int = 0


@dataclass(frozen=True)
class LiveWorker:
    info: WorkerInfo
    load: dict


class WorkerRegistry:
    def __init__(self, client: redis.Redis, model: str) -> None:
        self.client = client
        self.index = RedisPrefixIndex(client, model)
        self.prefix = self.index.prefix

    def _alive(self, worker: str) -> str:
        return f"{self.prefix}alive:{worker}"

    def register(self, info: WorkerInfo, load: dict, ttl_s: float) -> WorkerInfo:
        """(Re)register: new epoch, purge the previous life's blocks, publish info."""
        epoch = self.index.bump_epoch(info.worker_id)
        self.index.purge(info.worker_id)
        info = WorkerInfo(**{**asdict(info), "epoch": epoch})
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(f"{self.prefix}workers", info.worker_id, json.dumps(asdict(info)))
        pipe.set(self._alive(info.worker_id), json.dumps(load), px=int(ttl_s * 1000))
        pipe.execute()
        return info

    def heartbeat(self, worker: str, load: dict, ttl_s: float) -> bool:
        """Refresh the TTL with the current load. False when the entry is gone (expired
        or purged by a reader): the worker must register again."""
        ok = self.client.set(self._alive(worker), json.dumps(load), px=int(ttl_s * 1000),
                             xx=True)
        return bool(ok) and bool(self.client.hexists(f"{self.prefix}workers", worker))

    def deregister(self, worker: str) -> None:
        self.index.purge(worker)
        pipe = self.client.pipeline(transaction=True)
        pipe.hdel(f"{self.prefix}workers", worker)
        pipe.delete(self._alive(worker))
        pipe.execute()

    def live(self) -> list[LiveWorker]:
        """Workers whose heartbeat is current; the dead ones are removed on the way."""
        entries = self.client.hgetall(f"{self.prefix}workers")
        if not entries:
            return []
        ids = sorted(k.decode() for k in entries)
        loads = self.client.mget([self._alive(w) for w in ids])
        out = []
        for worker, load in zip(ids, loads, strict=True):
            if load is None:
                self.deregister(worker)
                continue
            info = WorkerInfo(**json.loads(entries[worker.encode()]))
            out.append(LiveWorker(info, json.loads(load)))
        return out
