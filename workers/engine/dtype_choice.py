"""What ``dtype="auto"`` means on the machine that runs the model.

bfloat16 halves the weights and the KV cache, and where the hardware computes in it
natively (a CUDA GPU; a CPU with AMX or AVX512-BF16) its GEMMs run several times faster
than float32 (~7-8x with AMX). Without native support torch emulates it, and it runs
*slower* than float32 (3.7x slower on an AVX2 machine): there ``auto`` is float32.

Plain Python (no torch): a CPU's features come from ``/proc/cpuinfo``, read by a function
a caller (a test) may replace. Resolve where the engine is built, never where it is
launched: a worker may run on another node than ``pdserve up``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

__all__ = ["BF16_CPU_FLAGS", "DTYPE_CHOICES", "DTYPES", "cpu_flags", "resolve_dtype"]

DTYPES = ("float32", "bfloat16")
"""The dtypes a model runs in."""
DTYPE_CHOICES = ("auto", *DTYPES)
"""What a user may ask for: ``auto`` becomes one of :data:`DTYPES`."""
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""x86 feature flags (as /proc/cpuinfo spells them) of native bf16 matrix math."""

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str] | None:
    """The feature flags of the first CPU listed in ``cpuinfo``; None where the file is
    missing or unreadable (macOS, Windows) or lists no flags. Reads a file; no state."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):  # x86; Arm
            return frozenset(value.split())
    return None


def resolve_dtype(
    requested: str, device: str,
    read_flags: Callable[[], frozenset[str] | None] = cpu_flags,
) -> tuple[str, str]:
    """(the dtype to run in, why) for ``requested`` on ``device`` (``cpu`` or
    ``cuda[:N]``) of this machine. An explicit dtype is kept as asked; ``auto`` is
    bfloat16 on a GPU or on a CPU whose flags (from ``read_flags``) include one of
    :data:`BF16_CPU_FLAGS`, else float32. Raises ValueError for any other ``requested``.
    """
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, "
                         f"got {requested!r}")
    if requested != "auto":
        return requested, "as asked"
    if device.startswith("cuda"):
        return "bfloat16", f"{device} is a GPU"
    flags = read_flags()
    if flags is None:
        return "float32", (f"cannot read the CPU's flags ({CPUINFO} missing); assuming no "
                           "native bf16")
    native = [f for f in BF16_CPU_FLAGS if f in flags]
    if native:
        return "bfloat16", f"CPU has {', '.join(native)}"
    return "float32", (f"CPU has neither {' nor '.join(BF16_CPU_FLAGS)}: bf16 would be "
                       "emulated, slower than float32")
