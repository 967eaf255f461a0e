"""The Redis backend of the prefix index: the one every router and worker shares.

The contract (every router replica and every worker reads and writes exactly this; a
test pins it). All keys of one model live under ``pdserve:{model}:``; block hashes are
the 64-bit values of :mod:`common.hashing`, written as 16 lowercase hex digits:

- ``blk:{hash}``: SET of worker ids that hold the block (computed KV, reusable);
- ``wblk:{worker}``: SET of the hashes that worker holds, so a dead or restarted worker
  is purged at once (one script, atomic);
- ``epoch:{worker}``: INT, bumped each time the worker (re)registers; a restarted worker
  purges what its previous life published before publishing anything.

Workers publish their engine's ``stored``/``evicted`` events in order, a batch per
MULTI/EXEC transaction, so a reader never sees half a batch. :meth:`RedisPrefixIndex.lookup`
takes a prompt's block hashes and answers in one round trip (a server-side script walks
the block sets and returns only the counts), per worker, how many *leading* blocks it
holds: a worker that lacks block i is not credited for any block after it, exactly what
its prefix cache could reuse.

Bottom layer: imports nothing of ours; the caller owns the Redis client.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis

_LOOKUP = """
local alive = redis.call('SMEMBERS', KEYS[1])
local counts = {}
for _, w in ipairs(alive) do counts[w] = 1 end
for i = 2, #KEYS do
  if #alive == 0 then break end
  local held = redis.call('SMISMEMBER', KEYS[i], unpack(alive))
  local still = {}
  for j, w in ipairs(alive) do
    if held[j] == 1 then
      still[#still + 1] = w
      counts[w] = i
    end
  end
  alive = still
end
local out = {}
for w, n in pairs(counts) do
  out[#out + 1] = w
  out[#out + 1] = n
end
return out
"""

_PURGE = """
local hashes = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(hashes) do
  redis.call('SREM', ARGV[1] .. h, ARGV[2])
end
redis.call('DEL', KEYS[1])
return #hashes
"""


def hash_key(block_hash: int) -> str:
    """The wire form of a block hash: 16 lowercase hex digits of the unsigned value."""
    return format(block_hash & 0xFFFFFFFFFFFFFFFF, "016x")


class RedisPrefixIndex:
    """One model's index on one Redis: a :class:`~.interface.PrefixIndexBackend`.

    Every method blocks on one round trip (``replace``: two) and raises
    ``redis.RedisError`` when Redis does not answer; thread-safe as far as the client is
    (``redis.Redis`` is: it pools connections)."""

    def __init__(self, client: redis.Redis, model: str) -> None:
        self.client = client
        self.prefix = f"pdserve:{model}:"
        self._purge = client.register_script(_PURGE)
        self._lookup = client.register_script(_LOOKUP)

    def _blk(self, h: int) -> str:
        return f"{self.prefix}blk:{hash_key(h)}"

    def _wblk(self, worker: str) -> str:
        return f"{self.prefix}wblk:{worker}"

    # -- writers (workers) --------------------------------------------------------------

    def publish(self, worker: str, stored: Iterable[int] = (), evicted: Iterable[int] = ()
                ) -> None:
        """Apply one batch of a worker's events, evictions after stores (the engine
        never evicts a block in the batch that stored it before storing it)."""
        stored, evicted = [hash_key(h) for h in stored], [hash_key(h) for h in evicted]
        if not stored and not evicted:
            return
        pipe = self.client.pipeline(transaction=True)
        for h in stored:
            pipe.sadd(f"{self.prefix}blk:{h}", worker)
        if stored:
            pipe.sadd(self._wblk(worker), *stored)
        for h in evicted:
            pipe.srem(f"{self.prefix}blk:{h}", worker)
        if evicted:
            pipe.srem(self._wblk(worker), *evicted)
        pipe.execute()

    def purge(self, worker: str) -> int:
        """Forget every block of ``worker`` at once; returns how many it had."""
        return int(self._purge(keys=[self._wblk(worker)], args=[f"{self.prefix}blk:", worker]))

    def replace(self, worker: str, held: Iterable[int]) -> None:
        """The worker's whole state, after an outage: purge, then publish ``held``."""
        self.purge(worker)
        self.publish(worker, held)

    def bump_epoch(self, worker: str) -> int:
        """A new life for ``worker`` (the registry calls it on every registration)."""
        return int(self.client.incr(f"{self.prefix}epoch:{worker}"))

    # -- readers (routers) ---------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, its number of leading blocks of ``block_hashes``; one round trip.
        Workers that hold none of the first block are absent."""
        if not block_hashes:
            return {}
        flat = self._lookup(keys=[self._blk(h) for h in block_hashes])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def blocks_of(self, worker: str) -> set[int]:
        """Every hash ``worker`` holds (tests and resync checks)."""
        return {int(h, 16) for h in self.client.smembers(self._wblk(worker))}
