"""The prefix-cache index: which worker holds which KV block, and how much of a prompt.

Lifecycle. A worker's engine emits ``stored``/``evicted`` block events; its KV publisher
writes them to the shared :class:`RedisPrefixIndex` (``workers/kv_publisher.py``), and
the registry purges a worker that died or restarted (``common/registry.py``). A router
hashes each prompt into blocks (:mod:`common.hashing`), asks its index how many leading
blocks each worker holds, lets its policy choose, and records where it sent the prompt.

- :mod:`.interface`: :class:`PrefixIndexBackend`, the five methods and their rules;
- :mod:`.redis_backend`: :class:`RedisPrefixIndex`, the shared one (its key layout is a
  contract, pinned by ``tests/integration/test_prefix_index.py``);
- :mod:`.memory`: :class:`MemoryPrefixIndex`, in-process, with optional expiry; a
  router's record of where it routed, and the index of tests and single-process tools;
- :mod:`.wrappers`: :class:`LayeredIndex` (several read as one), :class:`FailSoftIndex`
  (a remote one that is down answers ``{}``), :class:`InstrumentedIndex` (metrics).

``tests/contract/test_prefix_index_contract.py`` runs one suite against every backend.
Bottom layer: imports nothing of ours but :mod:`common.metrics` (for types).
"""

from .interface import PrefixIndexBackend
from .memory import MemoryPrefixIndex
from .redis_backend import RedisPrefixIndex, hash_key
from .wrappers import FailSoftIndex, InstrumentedIndex, LayeredIndex

__all__ = [
    "FailSoftIndex",
    "InstrumentedIndex",
    "LayeredIndex",
    "MemoryPrefixIndex",
    "PrefixIndexBackend",
    "RedisPrefixIndex",
    "hash_key",
]
