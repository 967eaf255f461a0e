"""Pre-quantized int8 checkpoints: write one from a normal checkpoint, read one back.

A pre-quantized directory is the source checkpoint with every decoder-layer projection
(:data:`QUANTIZED_PROJECTIONS` of ``model.layers.N``) stored as ``<name>.weight`` int8
``[out, in]`` plus ``<name>.weight_scale`` float32 ``[out]`` (row ``i`` of the weight is
``weight[i] * weight_scale[i]``, :func:`~workers.models.linear.quantize_int8`), every
other tensor (embeddings, norms, biases, an untied LM head) as the source stored it, and
``config.json`` marked ``"quantization_config": {"quant_method": "pdserve-int8", ...}``;
the tokenizer and generation files are copied. A plain transformers load refuses the
unknown quant method, which is what it should do: the int8 values alone are not the
model.

:func:`load_model` loads it for the engine: transformers' ``from_pretrained`` of the
directory with the mark removed from the config builds the model and its unquantized
tensors (the int8 projections load as their integer values cast to the model dtype,
exact, and are not used), and :func:`read_int8_weights` reads the projections' int8
values and scales straight from the safetensors files. Plain Python + torch.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from workers.models.linear import Int8Weight, quantize_int8

QUANT_METHOD = "pdserve-int8"
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj",
                         "gate_proj", "up_proj", "down_proj")
_PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.("
                         + "|".join(QUANTIZED_PROJECTIONS) + r")$")
_SCALE = ".weight_scale"
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.msgpack", "*.h5")


def is_quantized_projection(module_name: str) -> bool:
    """Whether ``--quantization int8`` stores this module's weight as int8."""
    return _PROJECTION.match(module_name) is not None


def quantization_of(model_dir: str | Path) -> str | None:
    """``"int8"`` for a directory :func:`save_quantized` wrote, None for a plain one.
    ValueError for another quantization method (not ours to load)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(f"{model_dir}: quantization method {method!r} is not supported "
                         f"(only {QUANT_METHOD!r}, written by `pdserve quantize`)")
    return "int8"


def save_quantized(src: str | Path, out: str | Path) -> dict[str, int]:
    """Write ``src`` (a local checkpoint directory) to ``out`` with its decoder-layer
    projections in int8; returns counts (``quantized`` projections, ``tensors`` in all,
    ``bytes`` of the safetensors file). ``out`` must not exist or be empty."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src, out = Path(src), Path(out)
    if quantization_of(src) is not None:
        raise ValueError(f"{src} is already quantized")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    tensors: dict[str, torch.Tensor] = {}
    quantized = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if is_quantized_projection(name):
                w = quantize_int8(module.weight)
                tensors[f"{name}.weight"], tensors[f"{name}{_SCALE}"] = w.q, w.scale
                quantized += 1
        for name, t in model.state_dict().items():
            tensors.setdefault(name, t)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: transformers re-ties it at load
    # safetensors refuses tensors that share memory: give each its own.
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors.index.json") \
                and not any(f.match(p) for p in _WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": QUANT_METHOD, "bits": 8, "symmetric": True,
        "granularity": "per_output_channel", "scale_suffix": _SCALE,
        "modules": list(QUANTIZED_PROJECTIONS),
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"quantized": quantized, "tensors": len(tensors),
            "bytes": (out / "model.safetensors").stat().st_size}


def read_int8_weights(model_dir: str | Path) -> dict[str, Int8Weight]:
    """Every int8 projection of a pre-quantized directory, by module name."""
    from safetensors import safe_open

    weights: dict[str, Int8Weight] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            for key in keys:
                if key.endswith(_SCALE):
                    name = key[: -len(_SCALE)]
                    q = f.get_tensor(f"{name}.weight")
                    if q.dtype != torch.int8:
                        raise ValueError(f"{path}: {name}.weight is {q.dtype}, not int8")
                    weights[name] = Int8Weight(q.contiguous(),
                                               f.get_tensor(key).to(torch.float32))
    if not weights:
        raise ValueError(f"{model_dir}: marked {QUANT_METHOD} but holds no "
                         f"'*{_SCALE}' tensor")
    return weights


def load_model(model_dir: str | Path, dtype: torch.dtype
               ) -> tuple[torch.nn.Module, dict[str, Int8Weight]]:
    """(the transformers model, its int8 projections by module name) of a pre-quantized
    directory; the model's own copies of those projections are placeholders."""
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    cfg = AutoConfig.from_pretrained(model_dir)
    del cfg.quantization_config
    # The scales are "unexpected keys" to transformers; read_int8_weights takes them.
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, dtype=dtype)
    finally:
        hf_logging.set_verbosity(level)
    return hf, read_int8_weights(model_dir)
