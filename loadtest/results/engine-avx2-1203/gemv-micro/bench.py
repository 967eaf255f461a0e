import time, torch, statistics, sys
from torch.utils.cpp_extension import load
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
m = load("gemvb", ["/tmp/gemv/k.cpp"], extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], build_directory="/tmp/gemv", verbose=False)
from workers.engine import kernels
kernels.load()
f32 = torch.ops.pdserve_kernels.f32_gemv
H, I = 576, 1536
shapes = [(960, H), (H, H), (2 * I, H), (H, I)]
torch.manual_seed(0)
layers = [[torch.randn(n, k) for n, k in shapes] for _ in range(30)]
packed = [[m.pack4(w) for w in L] for L in layers]
nbytes = sum(w.numel() * 4 for L in layers for w in L)
x = {k: torch.randn(1, k) for _, k in shapes}
for L, P in zip(layers[:1], packed[:1]):
    for w, p in zip(L, P):
        ref = f32(x[w.shape[1]], w, None)
        got = m.packed_gemv(x[w.shape[1]][0], p, w.shape[0], w.shape[1], 0)
        row = m.row_gemv(x[w.shape[1]][0], w)
        assert torch.allclose(ref[0], got, rtol=1e-4, atol=1e-3), (ref[0]-got).abs().max()
        assert torch.allclose(ref[0], row, rtol=1e-4, atol=1e-3)
flat = torch.cat([w.reshape(-1) for L in layers for w in L])
def t_read(): m.readsum(flat)
def t_cur():
    for L in layers:
        for w in L: f32(x[w.shape[1]], w, None)
def t_row():
    for L in layers:
        for w in L: m.row_gemv(x[w.shape[1]][0], w)
def mk(pf):
    def f():
        for L, P in zip(layers, packed):
            for w, p in zip(L, P): m.packed_gemv(x[w.shape[1]][0], p, w.shape[0], w.shape[1], pf)
    return f
cases = [("read", t_read), ("current", t_cur), ("row", t_row), ("packed", mk(0)), ("packed pf128", mk(1)), ("packed pf256", mk(2)), ("packed pf512", mk(3))]
res = {n: [] for n, _ in cases}
for rep in range(int(sys.argv[2]) if len(sys.argv) > 2 else 7):
    for n, f in cases:
        t = time.perf_counter(); f(); res[n].append(time.perf_counter() - t)
print(f"threads {torch.get_num_threads()}, {nbytes/1e6:.0f} MB of layer weights")
for n, v in res.items():
    med = statistics.median(v[1:])
    print(f"{n:14s} {med*1e3:7.1f} ms  {nbytes/med/1e9:5.1f} GB/s  (min {min(v[1:])*1e3:.1f})")
