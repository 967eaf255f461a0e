"""The KV cache formats a worker can store, by name and by wire code. Plain Python.

``auto`` stores K/V in the model's dtype; the others are quantized row formats defined
(encoding, scales, byte layout) in :mod:`workers.models.kv_format`. The codes travel in
KV transfer headers, so they are fixed forever: add at the end, never renumber.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "nvfp4")
FORMAT_CODES = {name: code for code, name in enumerate(KV_CACHE_DTYPES)}
CODE_FORMATS = dict(enumerate(KV_CACHE_DTYPES))


def check_kv_cache_dtype(name: str) -> str:
    """``name`` if it is a known format, else ValueError naming the choices."""
    if name not in FORMAT_CODES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return name
