"""Is the bf16 slowdown at batch 16-32 on 16 threads oneDNN's reordered-weight path
(workers.models.linear.onednn_linear, batch hint 64) or oneDNN itself? Times SmolLM2's four
layer GEMMs (fused QKV 576->960, O 576->576, fused gate/up 576->3072, down 1536->576) per
layer, for F.linear on plain weights and _linear_pointwise on weights reordered with
batch hints 1, 16, 64 and M, at M = 1..256 rows, fp32 and bf16, 16 and 2 threads.
(Made lint-clean after it ran: the same timings, closures bound explicitly.)"""
import time

import torch

reorder = torch.ops.mkldnn._reorder_linear_weight
pointwise = torch.ops.mkldnn._linear_pointwise
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def timed(fn, reps):
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


torch.manual_seed(0)
for threads in sorted({torch.get_num_threads(), 2}, reverse=True):
    torch.set_num_threads(threads)
    print(f"threads {threads}: us per layer (4 GEMMs), lower is better")
    print(f"{'dtype':9} {'M':>4} {'F.linear':>9} "
          + " ".join(f"{h:>8}" for h in ("hint1", "hint16", "hint64", "hintM")))
    for dt in (torch.float32, torch.bfloat16):
        ws = [torch.randn(n, k, dtype=dt) for k, n in SHAPES]
        packed = {h: [reorder(w, h) for w in ws] for h in (1, 16, 64)}
        for m in (1, 8, 16, 24, 32, 48, 64, 128, 256):
            xs = [torch.randn(m, k, dtype=dt) for k, _ in SHAPES]
            reps = 60 if m <= 64 else 20
            row = [timed(lambda xs=xs, ws=ws: [torch.nn.functional.linear(x, w)
                                               for x, w in zip(xs, ws, strict=True)], reps)]
            pm = [reorder(w, m) for w in ws]
            for p in (packed[1], packed[16], packed[64], pm):
                row.append(timed(lambda p=p, xs=xs: [pointwise(x, w, None, "none", [], "")
                                                     for x, w in zip(xs, p, strict=True)],
                                 reps))
            print(f"{str(dt)[6:]:9} {m:4} " + " ".join(f"{v:8.1f}" for v in row), flush=True)
