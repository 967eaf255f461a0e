"""Which C++ errors crash the process on this machine? Each probe runs in its own
interpreter (a segfault ends only that probe) and prints ok (the RuntimeError came
back to Python) or the exit status.

    python throw_probe.py [CACHE_DIR]

Probes: the paged decode kernel's block-id check on each code path; a fused op's dtype
check (another source file of the same library); a trivial TORCH_CHECK in an extension
built by ``load_inline`` with torch's default flags and with ours (-O3 -march=native
-fopenmp); our library rebuilt with the AVX-512 flags named instead of -march=native.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

CASE = """
import torch, sys
sys.path.insert(0, 'tests/unit')
from workers.engine import kernels
{setup}
kernels.load({cache!r})
assert kernels.available(), kernels.unavailable_reason()
q = torch.randn(2, 4, 16); k = torch.randn(8, 16, 2, 16); v = torch.randn(8, 16, 2, 16)
table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
lens = torch.tensor([20, 3], dtype=torch.int32)
bad = table.clone(); bad[0, 1] = 8
ok = kernels.paged_decode_attention(q, k, v, table, lens, 1.0, isa={isa!r})
try:
    {call}
except RuntimeError as e:
    print('raised:', str(e).splitlines()[0][:90])
"""
BAD_BLOCK = "kernels.paged_decode_attention(q, k, v, bad, lens, 1.0, isa={isa!r})"
BAD_DTYPE = "kernels.rms_norm(torch.zeros(2, 16, dtype=torch.int32), torch.zeros(16), 1e-5)"
INLINE = """
import torch, tempfile
from torch.utils.cpp_extension import load_inline
src = 'void boom(int64_t n) {{ TORCH_CHECK(n < 0, "n = ", n, " is outside"); }}'
m = load_inline(name='probe_{tag}', cpp_sources=[src], functions=['boom'],
                extra_cflags={flags!r}, build_directory=tempfile.mkdtemp(), verbose=False)
try:
    m.boom(3)
except RuntimeError as e:
    print('raised:', str(e).splitlines()[0][:90])
"""
NAMED_ISA = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma",
             "-mf16c", "-fopenmp", "-std=c++17")


def probes(cache: str) -> dict[str, str]:
    out = {}
    for isa in ("avx512", "avx2", "scalar"):
        out[f"ours {isa}: block id past the cache"] = CASE.format(
            setup="", cache=cache, isa=isa, call=BAD_BLOCK.format(isa=isa))
    out["ours: fused op, wrong dtype"] = CASE.format(setup="", cache=cache, isa="scalar",
                                                     call=BAD_DTYPE)
    out["load_inline, torch's flags"] = INLINE.format(tag="plain", flags=[])
    out["load_inline, -O3 -march=native -fopenmp"] = INLINE.format(
        tag="native", flags=["-O3", "-march=native", "-fopenmp"])
    out["load_inline, libstdc++ and libgcc linked static"] = INLINE.format(
        tag="static", flags=[]).replace(
        "verbose=False)", "verbose=False, extra_ldflags=['-static-libstdc++', '-static-libgcc'])")
    out["ours built with named AVX-512 flags: block id"] = CASE.format(
        setup=f"kernels.CFLAGS = {NAMED_ISA!r}", cache=tempfile.mkdtemp(), isa="avx512",
        call=BAD_BLOCK.format(isa="avx512"))
    return out


def main() -> None:
    cache = sys.argv[1] if len(sys.argv) > 1 else None
    for name, code in probes(cache).items():
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code],
                           capture_output=True, text=True, timeout=240)
        said = [ln for ln in r.stdout.splitlines() if ln.startswith("raised:")]
        verdict = said[0] if r.returncode == 0 and said else f"exit {r.returncode}"
        print(f"{name:48} {verdict}  ({time.perf_counter() - t:.1f}s)", flush=True)
        if r.returncode != 0:
            print("  " + "\n  ".join(r.stderr.strip().splitlines()[-8:]), flush=True)


if __name__ == "__main__":
    main()
