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

The lookup is on every request's path (``pdserve bench-routing`` times it), and inside a
script what costs is each command call and each string crossing between Redis and Lua,
not the set lookups in C. So the script checks runs of blocks with one ``SINTER`` (in C:
who holds every block of the run) and doubles the run while nobody drops out; only a
run where some worker stops holding is walked block by block, asking about those
workers alone. The hashes go as one argument (the key names are built in the script,
as ``_PURGE`` builds its own) and the counts come back as one JSON string: redis-py
packs and parses each argument and reply item in Python, and 128 of each cost the client
about as much as the whole script costs Redis.

Bottom layer: imports nothing of ours; the caller owns the Redis client.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence

import redis

_LOOKUP = """
local blk, hashes = ARGV[1] .. 'blk:', ARGV[2]
local n = #hashes / 16
local call, sub, unpack = redis.call, string.sub, unpack
local keys, built = {}, 0
local function build(last)  -- the key names of blocks 1..last, each built once
  for i = built + 1, last do keys[i] = blk .. sub(hashes, 16 * i - 15, 16 * i) end
  if last > built then built = last end
end
build(1)
-- alive: the workers that hold every block up to pos (a value equal to the current
-- run's last block marks those that hold the whole run too); left: how many there are
local alive, left = {}, 0
for _, w in ipairs(call('SMEMBERS', keys[1])) do alive[w] = true; left = left + 1 end
local counts, pos, run = {}, 1, 8
while left > 0 and pos < n do
  local last = math.min(pos + run, n)
  build(last)
  -- mark who of the alive holds every block of the run; the others drop out in it
  local kept = 0
  for _, w in ipairs(call('SINTER', unpack(keys, pos + 1, last))) do
    if alive[w] then alive[w] = last; kept = kept + 1 end
  end
  if kept < left then
    local lost, k = {}, 0
    for w, mark in pairs(alive) do
      if mark ~= last then k = k + 1; lost[k] = w; alive[w] = nil end
    end
    local i = pos + 1
    while k > 0 and i <= last do  -- each one's first missing block, walking the run
      local held = call('SMISMEMBER', keys[i], unpack(lost, 1, k))
      local still = 0
      for j = 1, k do
        if held[j] == 1 then still = still + 1; lost[still] = lost[j]
        else counts[lost[j]] = i - 1 end
      end
      k, i = still, i + 1
    end
    left, run = kept, 8
  else
    run = math.min(run * 2, 32)
  end
  pos = last
end
for w in pairs(alive) do counts[w] = pos end
return cjson.encode(counts)
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
        try:  # every hash_key, joined, in one C call
            wire = struct.pack(f">{len(block_hashes)}Q", *block_hashes).hex()
        except struct.error:  # a value outside [0, 2**64): hash_key masks it
            wire = "".join(map(hash_key, block_hashes))
        return json.loads(self._lookup(args=[self.prefix, wire]))

    def blocks_of(self, worker: str) -> set[int]:
        """Every hash ``worker`` holds (tests and resync checks)."""
        return {int(h, 16) for h in self.client.smembers(self._wblk(worker))}
