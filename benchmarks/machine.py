"""What every benchmark prints about the machine it ran on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The flags that decide our kernels' speed, of those the CPU has."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]


def machine_line() -> str:
    """One line for a benchmark's header: CPU, cores, the flags that matter."""
    import os

    return f"{cpu_name()}, {os.cpu_count()} cpus, {' '.join(cpu_flags()) or 'no AVX2'}"
