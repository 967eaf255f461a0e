"""What routers and workers share: the contracts that must not drift between them.

Bottom layer: imports only :mod:`protos` (and libraries), never ``router``, ``workers``,
``cluster``, ``benchmarks`` or ``loadtest`` (``lint-imports`` checks it):

- :mod:`common.hashing`: the block-hash chain (one function, pinned by a test);
- :mod:`common.sampling`: request parameters and their limits;
- :mod:`common.wire`: protobuf <-> parameter conversion;
- :mod:`common.metrics`: the metrics catalog every component exports;
- :mod:`common.prefix_index`: the prefix-cache index (Redis and in-memory backends);
- :mod:`common.registry`: the worker registry in Redis.
"""
