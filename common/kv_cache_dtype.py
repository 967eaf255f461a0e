"""The KV cache formats a worker can store, by name and by wire code. Plain Python.

``auto`` stores K/V in the model's dtype; the others are quantized row formats defined
(encoding, scales, byte layout) in :mod:`workers.models.kv_format`. The codes travel in
KV transfer headers, so they are fixed forever: add at the end, never renumber.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "nvfp4")
FORMAT_CODES = {name: code for code, name in enumerate(KV_CACHE_DTYPES)}
CODE_FORMATS = dict(enumerate(KV_CACHE_DTYPES))


def compared_kv_dtypes(spec: str | None) -> tuple[str, ...]:
    """The formats a comparison runs (``pdserve eval-kv``, ``bench-kv``): ``auto``, the
    reference, first, then those of the comma-separated ``spec`` (None or empty: all).
    ValueError names unknown ones."""
    names = [n for n in (spec or ",".join(KV_CACHE_DTYPES)).split(",") if n and n != "auto"]
    bad = sorted(set(names) - set(KV_CACHE_DTYPES))
    if bad:
        raise ValueError(f"unknown KV cache dtypes {bad}; choose from "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return ("auto", *names)


def check_compared_kv_dtypes(kv_dtypes: tuple[str, ...]) -> None:
    """ValueError unless ``kv_dtypes`` is what :func:`compared_kv_dtypes` gives: ``auto``
    first, then known formats."""
    if compared_kv_dtypes(",".join(kv_dtypes)) != tuple(kv_dtypes):
        raise ValueError(f"kv_dtypes must start with auto (the reference), then known "
                         f"formats, got {kv_dtypes}")


def check_kv_cache_dtype(name: str) -> str:
    """``name`` if it is a known format, else ValueError naming the choices."""
    if name not in FORMAT_CODES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return name
