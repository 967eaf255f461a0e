"""A SmolLM2-135M-shaped checkpoint with seeded random weights, for a machine the real
weights cannot travel to (the device tool carries 64 MiB; the fp32 weights are 538 MB).

    python make_model.py CONFIG_DIR OUT_DIR

CONFIG_DIR holds the converted default model's config, generation config and tokenizer
files (no weights). The weights are drawn with the tiny test models' initialiser
(``tests/tiny_models._init_weights``: peaky greedy logits, so greedy comparisons with
Hugging Face mean something). Speed depends on the shapes only, so the engine bench's
tok/s and floors hold for the real model; its perplexity and tokens do not.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from tiny_models import _init_weights  # noqa: E402


def main(src: Path, out: Path) -> None:
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    special = sorted({i for i in (config.bos_token_id, config.eos_token_id,
                                  config.pad_token_id, config.unk_token_id) if i is not None})
    with torch.no_grad():
        _init_weights(model, torch.Generator().manual_seed(0), special)
    model.eval().save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
