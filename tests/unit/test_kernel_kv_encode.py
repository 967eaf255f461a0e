"""The native KV row encoder (``kernels.quantize_kv_rows``) against its reference.

The reference is ``KVFormat.quantize`` (pure torch, ``workers/models/kv_format.py``):
the kernel must write the same bytes for every input, so each case compares byte for
byte: random rows of log-uniform magnitudes, and adversarial ones (zeros, negative zeros,
a single nonzero, all-equal rows, huge and tiny and subnormal magnitudes, values on the
FP8 range edges and on E2M1 midpoints times a candidate scale, where the nvfp4 scale
search ties). Skipped when the extension cannot be built here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from workers.engine import kernels
from workers.models.kv_format import FORMAT_CODES, KVFormat

QUANTIZED = ("fp8_e4m3", "fp8_e5m2", "nvfp4")
DTYPES = (torch.float32, torch.bfloat16)
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@pytest.fixture(scope="module")
def encode():
    cache = os.environ.get("PDSERVE_TEST_CACHE_DIR")
    if not kernels.available(Path(cache) / "kernels" if cache else None):
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    return kernels.quantize_kv_rows


def check(encode, x: torch.Tensor, name: str) -> None:
    ref = KVFormat(name, x.shape[-1], x.dtype).quantize(x)
    got = encode(x, FORMAT_CODES[name])
    assert got.dtype == torch.uint8 and got.shape == ref.shape
    bad = (got != ref).any(-1).reshape(-1)
    if bad.any():
        i = int(bad.nonzero()[0])
        row = x.reshape(-1, x.shape[-1])[i]
        pytest.fail(f"{name} {x.dtype}: {int(bad.sum())} of {bad.numel()} rows differ; "
                    f"first row {i}: {row.tolist()}\n got {got.reshape(-1, got.shape[-1])[i]}"
                    f"\n ref {ref.reshape(-1, ref.shape[-1])[i]}")


def log_uniform(shape, g: torch.Generator, lo: float = -12.0, hi: float = 12.0):
    """Random signs and magnitudes 2**U(lo, hi) per element, times a per-row 2**U(lo, hi)."""
    mag = torch.exp2(torch.empty(shape).uniform_(lo, hi, generator=g))
    row = torch.exp2(torch.empty(*shape[:-1], 1).uniform_(lo, hi, generator=g))
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    return mag * row * sign


def adversarial_rows(dim: int, g: torch.Generator) -> torch.Tensor:
    """Rows of ``dim`` float32 values built to sit on the reference's edges."""
    rows = []
    tiny = torch.finfo(torch.float32).tiny
    rows.append(torch.zeros(dim))
    rows.append(torch.full((dim,), -0.0))
    z = torch.zeros(dim)
    z[::3] = -0.0
    z[1] = 1.0
    rows.append(z)
    for v in (1.0, -3.0, 1e-30, 1e30, -1e30, 7.0, 448.0, 57344.0, 2688.0, 6.0, tiny,
              tiny / 8, 1e-45, 3e38):
        one = torch.zeros(dim)
        one[dim // 2] = v
        rows.append(one)
        rows.append(torch.full((dim,), v))  # all equal
    # amax exactly fmax * 2**e (and just above / below) for many e: frexp's edges
    for fmax in (448.0, 57344.0):
        for e in range(-150, 112, 7):
            base = fmax * 2.0**e
            for v in (base, base * (1 + 2**-23), base * (1 - 2**-24)):
                r = torch.randn(dim, generator=g) * base / 8
                r[0] = v
                rows.append(r)
    # values exactly on E2M1 midpoints / levels times a scale the search will try
    for s in (1.0, 0.5, 0.001953125, 0.013671875, 1.125, 13.0, 448.0, 2**-9, 2**-8 * 3):
        for pts in (MIDPOINTS, LEVELS):
            vals = torch.tensor(pts * (dim // len(pts) + 1))[:dim] * s
            sign = torch.randint(0, 2, (dim,), generator=g) * 2 - 1
            rows.append(vals * sign)
            rows.append(vals.flip(0))
    # group maxima around the E4M3 rounding of amax / 6 (candidate search ties)
    for b in range(0, 0x7F, 3):
        sc = float(torch.tensor(b, dtype=torch.uint8).view(torch.float8_e4m3fn).float())
        for amax in (6 * sc, 6 * sc * 1.0625, 6 * sc * 0.9375, 5 * sc, 3.5 * sc):
            r = torch.randint(-12, 13, (dim,), generator=g).float() * sc / 2
            r[::16] = amax
            rows.append(r.clamp(-amax, amax))
    # subnormal float32 inputs
    rows.append(torch.randn(dim, generator=g) * tiny / 4)
    rows.append(torch.randn(dim, generator=g) * 1e-42)
    return torch.stack(rows)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(32, 3, 64), (513, 2, 16), (5, 4, 128), (16,), (1, 1, 32)])
def test_random_rows_match_reference(encode, name, dtype, shape):
    g = torch.Generator().manual_seed(hash((name, str(dtype), shape)) % 2**31)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    check(encode, x, name)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", (*DTYPES, torch.float16), ids=str)
def test_log_uniform_magnitudes(encode, name, dtype):
    g = torch.Generator().manual_seed(1234)
    lo, hi = (-20.0, 12.0) if dtype == torch.float16 else (-60.0, 60.0)
    for dim in (16, 64, 128):
        x = log_uniform((4000 * 16 // dim, dim), g, lo, hi).to(dtype)
        check(encode, x, name)
    # narrow ranges: many groups whose scale search is close
    x = log_uniform((3000, 64), g, -2.0, 2.0).to(dtype)
    check(encode, x, name)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_adversarial_rows(encode, name, dtype):
    g = torch.Generator().manual_seed(7)
    for dim in (16, 64):
        x = adversarial_rows(dim, g)
        if dtype == torch.float32:
            check(encode, x, name)
        else:
            finite = x.abs().amax(-1) < 3e38  # bf16 holds 3e38; keep rows bf16 keeps finite
            check(encode, x[finite].to(dtype), name)


def test_every_e4m3_scale_and_tie(encode):
    """Groups whose values are E2M1 levels and midpoints of every E4M3 scale (and its
    neighbours), so all three candidates' errors meet and argmin's tie rule decides."""
    g = torch.Generator().manual_seed(3)
    scales = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pts = torch.tensor(MIDPOINTS + LEVELS + (6.0,))
    rows = []
    for s in scales.tolist():
        for _ in range(4):
            perm = pts[torch.randperm(16, generator=g)]
            sign = torch.randint(0, 2, (16,), generator=g) * 2 - 1
            rows.append(perm * s * sign)
            rows.append(perm * s * (1 + 2**-20))
    x = torch.stack(rows)
    check(encode, x, "nvfp4")
    check(encode, x.to(torch.bfloat16), "nvfp4")


def test_non_contiguous_input(encode):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(8, 64, 6, generator=g)
    x = base.transpose(1, 2)  # [8, 6, 64], last dim strided
    for name in QUANTIZED:
        assert torch.equal(encode(x, FORMAT_CODES[name]),
                           KVFormat(name, 64, x.dtype).quantize(x.contiguous()))


def test_errors(encode):
    with pytest.raises(RuntimeError, match="head_dim"):
        encode(torch.zeros(4, 24), FORMAT_CODES["nvfp4"])
    for code in (0, 4, -1):
        with pytest.raises(RuntimeError, match="kv_format"):
            encode(torch.zeros(4, 32), code)
    with pytest.raises(RuntimeError, match="float32"):
        encode(torch.zeros(4, 32, dtype=torch.float64), 1)


def test_empty_and_threads(encode):
    assert encode(torch.zeros(0, 3, 64), 3).shape == (0, 3, 36)
    g = torch.Generator().manual_seed(9)
    x = log_uniform((2048, 3, 64), g, -8.0, 8.0).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for name in QUANTIZED:
            check(encode, x, name)
    finally:
        torch.set_num_threads(threads)


def test_dyadic_grid_ties(encode):
    """Groups of small integers times a power of two: their errors are exact, so the three
    candidates' errors often tie (nearest vs one down, one down vs one up), and only the
    same sums in the same order with argmin's first-wins rule give the same scale."""
    g = torch.Generator().manual_seed(11)
    k = torch.randint(-48, 49, (60000, 16), generator=g).float()
    x = k * 2.0 ** torch.randint(-12, 4, (60000, 1), generator=g).float()
    # the reference really ties here (as computed by KVFormat's own helpers)
    from workers.models import kv_format as kvf

    amax = x.abs().amax(-1, keepdim=True)
    bits = (amax / 6).clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    cand = torch.cat([bits, (bits - 1).clamp(min=0), (bits + 1).clamp(max=0x7E)], -1)
    s = cand.to(torch.uint8).view(torch.float8_e4m3fn).float().unsqueeze(-1)
    codes = kvf._e2m1_codes(x.unsqueeze(-2), s)
    err = ((kvf._e2m1_table(x.device)[codes] * s - x.unsqueeze(-2)) ** 2).sum(-1)
    assert ((err[:, 0] == err[:, 1]) & (cand[:, 0] != cand[:, 1])).sum() > 10
    assert ((err[:, 1] == err[:, 2]) & (cand[:, 1] != cand[:, 2])
            & (err[:, 1] < err[:, 0])).sum() > 5
    check(encode, x.reshape(-1, 4, 64), "nvfp4")
    check(encode, x.reshape(-1, 4, 64).to(torch.bfloat16), "nvfp4")


@pytest.mark.parametrize("name", QUANTIZED)
def test_inf_and_nan(encode, name):
    """Not values a model should write, but the bytes still match: torch's amax and clamp
    propagate NaN, frexp(NaN) gives exponent 0, a NaN group scale wins nvfp4's argmin."""
    g = torch.Generator().manual_seed(13)
    rows = []
    for v in (float("inf"), float("-inf"), float("nan"), -float("nan")):
        for pos in (0, 3, 17, 31):
            r = torch.randn(32, generator=g)
            r[pos] = v
            rows.append(r)
        rows.append(torch.full((32,), v))
    x = torch.stack(rows)
    check(encode, x, name)
    check(encode, x.to(torch.bfloat16), name)
