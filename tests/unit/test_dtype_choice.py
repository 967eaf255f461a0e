"""``dtype="auto"``: bfloat16 only where the hardware computes in it natively."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine.dtype_choice import cpu_flags, resolve_dtype
from workers.engine.params import EngineConfig

AVX2 = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}


def flags(value: frozenset[str] | None):  # noqa: ANN201 - a flags reader
    return lambda: value


def never_read() -> frozenset[str]:
    raise AssertionError("the CPU's flags were read, but nothing needed them")


def test_auto_picks_bfloat16_on_a_cpu_with_amx_or_avx512_bf16() -> None:
    assert resolve_dtype("auto", "cpu", flags(SAPPHIRE_RAPIDS)) == (
        "bfloat16", "CPU has amx_bf16, avx512_bf16")
    dtype, reason = resolve_dtype("auto", "cpu", flags(AVX2 | {"avx512_bf16"}))
    assert dtype == "bfloat16" and "avx512_bf16" in reason
    dtype, reason = resolve_dtype("auto", "cpu", flags(AVX2 | {"amx_bf16"}))
    assert dtype == "bfloat16" and "amx_bf16" in reason


def test_auto_picks_float32_on_a_cpu_without_native_bf16() -> None:
    dtype, reason = resolve_dtype("auto", "cpu", flags(AVX2 | {"avx512f"}))
    assert dtype == "float32"
    assert "amx_bf16" in reason and "avx512_bf16" in reason and "emulated" in reason


def test_auto_picks_float32_where_the_cpu_flags_cannot_be_read() -> None:
    dtype, reason = resolve_dtype("auto", "cpu", flags(None))
    assert dtype == "float32" and "/proc/cpuinfo" in reason


def test_auto_picks_bfloat16_on_a_gpu_without_reading_cpu_flags() -> None:
    assert resolve_dtype("auto", "cuda", never_read) == ("bfloat16", "cuda is a GPU")
    assert resolve_dtype("auto", "cuda:1", never_read)[0] == "bfloat16"


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_explicit_dtype_passes_through_unchanged(dtype: str, device: str) -> None:
    assert resolve_dtype(dtype, device, never_read) == (dtype, "as asked")


@pytest.mark.parametrize("bad", ["float16", "fp32", "AUTO", ""])
def test_unknown_dtype_is_refused_naming_the_allowed_values(bad: str) -> None:
    with pytest.raises(ValueError, match=r"auto, float32, bfloat16, got") as e:
        resolve_dtype(bad, "cpu", never_read)
    assert repr(bad) in str(e.value)
    with pytest.raises(ValueError, match=r"dtype must be one of auto, float32, bfloat16"):
        EngineConfig(model="m", dtype=bad)


def test_cpu_flags_reads_the_first_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 amx_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx2", "amx_bf16"})
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # Arm spells it so
    assert cpu_flags(info) == frozenset({"fp", "asimd", "bf16"})
    info.write_text("processor\t: 0\n")
    assert cpu_flags(info) is None
    assert cpu_flags(tmp_path / "missing") is None


def test_engine_config_defaults_to_auto_and_resolves_to_a_concrete_dtype() -> None:
    config = EngineConfig(model="m")
    assert config.dtype == "auto"
    resolved, reason = config.resolved()
    assert resolved.dtype in ("float32", "bfloat16") and reason
    assert resolved.model == "m" and config.dtype == "auto"  # a new config; this one kept
    assert EngineConfig(model="m", dtype="float32").resolved() == (
        EngineConfig(model="m", dtype="float32"), "as asked")
