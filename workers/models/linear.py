"""The GEMMs of the decoder: weights in the form the fastest available kernel wants.

:class:`LinearOps` is a pair: ``prepare`` turns a weight ``[out, in]`` into what
``apply(x, weight, bias)`` takes, once, when the model is built. :data:`TORCH_LINEAR`
is ``F.linear`` on the plain weight (any device). :func:`onednn_linear` (CPU) reorders
each weight once into oneDNN's blocked layout, so no GEMM repacks its weight on every
call: measured on a 2-core Xeon (AVX-512, AMX), SmolLM2's 120 layer GEMMs per step took
1.4-1.6x less time at 8-40 tokens in fp32 and 1.4-1.6x less at every size in bf16; at
one token and at hundreds (prefill) fp32 was unchanged. The reordered weight replaces
the plain one (no extra memory).

Both compute the same product up to summation order (fp32: ~1e-5 relative), like any
two GEMM kernels; greedy output still equals Hugging Face's (tests/integration).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class LinearOps:
    name: str
    prepare: Callable[[torch.Tensor], torch.Tensor]
    apply: Linear


TORCH_LINEAR = LinearOps("torch", lambda w: w, F.linear)

_BATCH_HINT = 64
"""Tokens per GEMM the blocked layout is tuned for (a step's decode batch plus a prefill
chunk; measured best of 1/8/64 on both dtypes)."""


def onednn_linear() -> LinearOps | None:
    """oneDNN GEMMs on pre-reordered weights; None where this torch has no oneDNN CPU
    backend (then the caller keeps :data:`TORCH_LINEAR`)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        reorder = torch.ops.mkldnn._reorder_linear_weight
        pointwise = torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None

    def prepare(w: torch.Tensor) -> torch.Tensor:
        return reorder(w.contiguous(), _BATCH_HINT)

    def apply(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return pointwise(x, w, bias, "none", [], "")

    return LinearOps("onednn", prepare, apply)
