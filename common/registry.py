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

Readers trust nothing they read: anyone who can write to Redis can write an entry, and
the router dials the addresses it finds. :func:`parse_entry` checks each entry (JSON
object, known fields of the right types, a role, a ``host:port`` address, sane numbers,
the id it is filed under, this registry's model) and :meth:`WorkerRegistry.live` skips
one that fails, logging why once per entry; a bad entry never ends discovery of the
good ones.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields

import redis

from .prefix_index import RedisPrefixIndex

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "mixed")
_MAX_COUNT = 2**40  # blocks, epochs, load counters: anything above is not a real worker
_MAX_BLOCK_SIZE = 2**16
_MAX_ADDRESS = 255


class MalformedEntry(ValueError):
    """A registry entry that is not a worker of this model; the message says why."""


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str  # unique per model; the gRPC address is a natural choice
    role: str
    address: str
    total_blocks: int = 0
    block_size: int = 0
    epoch: int = 0
    model: str = ""  # the registry's model; register() fills it in
    kv_address: str = ""  # decode workers: their KV receiver's HOST:PORT (prefill sends there)


@dataclass(frozen=True)
class LiveWorker:
    info: WorkerInfo
    load: dict


class WorkerRegistry:
    def __init__(self, client: redis.Redis, model: str) -> None:
        self.client, self.model = client, model
        self.index = RedisPrefixIndex(client, model)
        self.prefix = self.index.prefix
        self._warned: set[tuple[str, bytes]] = set()

    def _alive(self, worker: str) -> str:
        return f"{self.prefix}alive:{worker}"

    def register(self, info: WorkerInfo, load: dict, ttl_s: float) -> WorkerInfo:
        """(Re)register: new epoch, purge the previous life's blocks, publish info."""
        epoch = self.index.bump_epoch(info.worker_id)
        self.index.purge(info.worker_id)
        info = WorkerInfo(**{**asdict(info), "epoch": epoch, "model": self.model})
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

    def emptied(self, reader: str, ttl_s: int = 3600) -> bool:
        """Whether Redis lost this registry's keys since ``reader`` last asked (it came
        back empty after a restart, or was flushed): ``reader``'s own marker key, set
        when missing, was missing. True on a reader's first call. One per reader (a
        router's id): a marker shared by several readers would tell only the first."""
        key = f"{self.prefix}reader:{reader}"
        pipe = self.client.pipeline()
        pipe.set(key, 1, nx=True, ex=ttl_s)
        pipe.expire(key, ttl_s)
        created, _ = pipe.execute()
        return bool(created)

    def live(self) -> list[LiveWorker]:
        """Workers whose heartbeat is current; the dead ones are removed on the way,
        malformed ones skipped (and logged once). Raises only Redis's errors."""
        entries = self.client.hgetall(f"{self.prefix}workers")
        if not entries:
            return []
        keys = sorted(entries)
        loads = self.client.mget([self._alive(k.decode(errors="replace")) for k in keys])
        out = []
        for key, load in zip(keys, loads, strict=True):
            if load is None:  # expired: dead (or never a worker; junk goes too)
                try:
                    self.deregister(key.decode())
                except UnicodeDecodeError:
                    self.client.hdel(f"{self.prefix}workers", key)
                continue
            try:
                out.append(parse_entry(key, entries[key], load, self.model))
            except MalformedEntry as e:
                self._warn_once(key, entries[key], str(e))
        return out

    def _warn_once(self, key: bytes, entry: bytes, why: str) -> None:
        # Keyed by the entry, not its load: a heartbeat rewrites the load every second.
        seen = (key.decode(errors="replace"), entry)
        if seen in self._warned:
            return
        if len(self._warned) > 1024:  # bounded: someone may be writing junk in a loop
            self._warned.clear()
        self._warned.add(seen)
        log.warning("worker registry: skipping entry %r of model %r: %s", seen[0][:200],
                    self.model, why)


def parse_entry(key: bytes, entry: bytes, load: bytes, model: str) -> LiveWorker:
    """One registry entry (``workers`` field ``key`` -> ``entry``, live load ``load``)
    as a :class:`LiveWorker`, or :class:`MalformedEntry` saying what is wrong."""
    try:
        worker = key.decode()
        data = json.loads(entry)
        live = json.loads(load)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise MalformedEntry(f"not JSON: {type(e).__name__}") from None
    if not isinstance(data, dict):
        raise MalformedEntry(f"entry is a {type(data).__name__}, not an object")
    known = {f.name: f for f in fields(WorkerInfo)}
    values = {k: v for k, v in data.items() if k in known}  # newer fields: ignored
    missing = sorted({"worker_id", "role", "address", "model"} - values.keys())
    if missing:
        raise MalformedEntry(f"missing {', '.join(missing)}")
    for name in ("worker_id", "role", "address", "model"):
        if not isinstance(values[name], str):
            raise MalformedEntry(f"{name} is a {type(values[name]).__name__}, not a string")
    for name, top in (("total_blocks", _MAX_COUNT), ("block_size", _MAX_BLOCK_SIZE),
                      ("epoch", _MAX_COUNT)):
        v = values.get(name, 0)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
            raise MalformedEntry(f"{name}={v!r}: want an integer in [0, {top}]")
    info = WorkerInfo(**values)
    if info.model != model:
        raise MalformedEntry(f"it serves model {info.model[:100]!r}")
    if info.worker_id != worker:
        raise MalformedEntry(f"filed under {worker[:100]!r} but names {info.worker_id[:100]!r}")
    if info.role not in ROLES:
        raise MalformedEntry(f"role {info.role[:20]!r}: want one of {', '.join(ROLES)}")
    _check_address(info.address)
    if not isinstance(info.kv_address, str):
        raise MalformedEntry(f"kv_address is a {type(info.kv_address).__name__}, not a string")
    if info.kv_address:
        _check_address(info.kv_address)
    if not isinstance(live, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            and 0 <= v <= _MAX_COUNT for k, v in live.items()):  # NaN and inf fail too
        raise MalformedEntry("load: want an object of numbers in "
                             f"[0, {_MAX_COUNT}] (running, waiting, free_blocks...)")
    return LiveWorker(info, live)


def _check_address(address: str) -> None:
    """``host:port`` (an IPv6 host in brackets), nothing else: the router dials it."""
    host, sep, port = address.rpartition(":")
    if (not sep or not host or len(address) > _MAX_ADDRESS or not port.isdigit()
            or not 0 < int(port) < 65536
            or any(c.isspace() or c in "/@?#" for c in host)):
        raise MalformedEntry(f"address {address[:100]!r}: want HOST:PORT")
