"""What every benchmark prints about the machine it ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from workers.engine.dtype_choice import cpu_flags


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line() -> str:
    """One line for a benchmark's header: CPU, cores, the flags that matter."""
    have = cpu_flags() or frozenset()
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in have]
    return f"{cpu_name()}, {os.cpu_count()} cpus, {' '.join(shown) or 'no AVX2'}"
