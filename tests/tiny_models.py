"""Tiny, deterministic, locally built checkpoints for tests.

Nothing here touches the network: the tokenizer is a byte-level BPE trained on an
embedded English/code corpus and the models are randomly initialised from configs.

Typical use from a fixture::

    tok_dir = train_tokenizer(tmp / "tokenizer")
    ckpt = build_tiny_model("qwen2", tmp / "qwen2", tok_dir)
    model = AutoModelForCausalLM.from_pretrained(ckpt)  # fp32; dtype=torch.bfloat16 also works
    tok = AutoTokenizer.from_pretrained(ckpt)

The model sizes are deliberately odd (head_dim 12/20, GQA ratio 3, hidden size that is not
``heads * head_dim`` for some archs, intermediate sizes like 100/97) so that implementations
which silently assume "nice" shapes fail loudly. Weights are re-initialised by this module
(not by transformers' ``_init_weights``) with scales chosen so that greedy decoding has a
comfortable top-1/top-2 logit margin and does not collapse into repeating a single token;
RMSNorm weights and attention biases are perturbed away from 1/0 so that an implementation
which ignores them does not accidentally match.

Run ``python tests/tiny_models.py`` for a self-check that prints margins and timings.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3", "mistral")

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

# Qwen2's pre-tokenizer split pattern (GPT-4 style, single digits).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Embedded so that the tokenizer is identical on every machine and Python version.
_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. The weather today is mild, with light winds from the west and a chance of "
    "rain in the evening. People walked along the river, talking about the market, the school, "
    "and the new library that opened in the centre of the town last spring.",
    "Once upon a time there was a small village at the edge of a great forest. Every morning "
    "the baker opened his shop before the sun came up, and the smell of fresh bread drifted "
    "through the narrow streets. The children would run past on their way to school, and the "
    "baker would wave to them and call out their names one by one.",
    "Large language models are trained to predict the next token in a sequence of text. During "
    "inference, the prompt is first processed in a single forward pass called prefill, which "
    "fills the key and value cache. Then the model produces one token at a time in the decode "
    "phase, reading the cache and appending to it. Serving systems often split these two phases "
    "across different pools of workers, because prefill is compute bound while decode is "
    "limited by memory bandwidth.",
    "def fibonacci(n: int) -> int:\n"
    "    if n < 2:\n"
    "        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
    "class Counter:\n"
    "    def __init__(self) -> None:\n"
    "        self.value = 0\n\n"
    "    def increment(self, step: int = 1) -> int:\n"
    "        self.value += step\n"
    "        return self.value\n\n\n"
    "for index in range(10):\n"
    "    print(index, fibonacci(index))\n",
    "Question: What is the capital of France?\nAnswer: The capital of France is Paris.\n"
    "Question: How many days are there in a week?\nAnswer: There are seven days in a week.\n"
    "Question: What colour is the sky on a clear day?\nAnswer: The sky is blue on a clear day.\n",
    "In the history of science, many important discoveries were made by accident. A researcher "
    "might be looking for one thing and find something else entirely, something that changes "
    "the way we think about the world. Careful observation, patience, and a willingness to be "
    "surprised are among the most valuable qualities that anyone working in a laboratory can "
    "have. Numbers such as 3.14159, 2.71828, 1024 and 65536 appear again and again.",
    "Hello! How are you today? I am fine, thank you. Could you please help me with a question "
    "about my account? Of course, I would be happy to help. What seems to be the problem? "
    "I cannot log in, and the page says that my password is not correct. Let us reset it.",
)

# Per-architecture sizes. Every arch uses GQA with ratio 3 and a non power of two head_dim.
# ``hidden_size`` differs from ``heads * head_dim`` where the HF config allows an explicit
# head_dim (llama, qwen3, mistral); Qwen2 derives head_dim = hidden_size // heads.
_SPECS: dict[str, dict[str, Any]] = {
    "llama": dict(
        hidden_size=60,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=12,
        num_hidden_layers=2,
        intermediate_size=100,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen2": dict(
        hidden_size=120,
        num_attention_heads=6,
        num_key_value_heads=2,
        num_hidden_layers=3,
        intermediate_size=97,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "qwen3": dict(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=20,
        num_hidden_layers=2,
        intermediate_size=112,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rms_norm_eps=1e-6,
    ),
    "mistral": dict(
        hidden_size=72,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=12,
        num_hidden_layers=3,
        intermediate_size=100,
        tie_word_embeddings=False,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
    ),
}

MAX_POSITION_EMBEDDINGS = 512

# Initialisation scales (see _init_weights); tuned with the self-check at the bottom.
_EMBED_STD = 0.5
_TIED_EMBED_STD = 0.1
_FINAL_NORM = 2.0
_TIED_FINAL_NORM = 6.0
_SPECIAL_ROW_SCALE = 0.5
_LINEAR_GAIN = 1.0
_QK_GAIN = 1.5
_LM_HEAD_STD_FACTOR = 1.5  # logit std ~= this factor (times final-norm weight)
_NORM_JITTER = 0.15
_BIAS_STD = 0.3


def tiny_arch_spec(arch: str) -> dict[str, Any]:
    """Return a copy of the size spec used for ``arch`` (for tests that want to assert shapes)."""
    if arch not in _SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    spec = dict(_SPECS[arch])
    spec.setdefault("head_dim", spec["hidden_size"] // spec["num_attention_heads"])
    spec["max_position_embeddings"] = MAX_POSITION_EMBEDDINGS
    return spec


def train_tokenizer(out_dir: Path, vocab_size: int = 384) -> Path:
    """Train a deterministic byte-level BPE tokenizer and save it with ``save_pretrained``.

    Special tokens ``<|endoftext|>`` (ids 0; also bos/eos/pad), ``<|im_start|>`` (1) and
    ``<|im_end|>`` (2) come first, then the 256 byte symbols, then the learned merges. A ChatML
    chat template is attached. Byte-level, so any UTF-8 text encodes; input is NFC-normalised
    (as Qwen2's tokenizer does), so ``decode(encode(text)) == unicodedata.normalize("NFC", text)``
    -- i.e. an exact round trip for any NFC text (ASCII, "héllo 日本", emoji, ...).

    Args:
        out_dir: Directory to write ``tokenizer.json``/``tokenizer_config.json`` etc. into.
        vocab_size: Target vocabulary size including the special tokens (>= 259 + a few merges).

    Returns:
        ``out_dir``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be >= {len(SPECIAL_TOKENS) + 256}, got {vocab_size}")

    tok = Tokenizer(models.BPE())
    # Exactly the pipeline transformers' Qwen2Tokenizer hard-codes: AutoTokenizer forces that
    # class for model_type "qwen2" whatever tokenizer_config.json says, so using it everywhere
    # keeps tokenization identical across all four checkpoints and plain `tokenizers` loading.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    fast.chat_template = CHATML_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def _tokenizer_files(tokenizer_dir: Path) -> Iterable[Path]:
    for p in sorted(Path(tokenizer_dir).iterdir()):
        if p.is_file():
            yield p


@torch.no_grad()
def _init_weights(
    model: torch.nn.Module, generator: torch.Generator, special_ids: list[int]
) -> None:
    """Re-initialise every parameter with scales that give peaky but varied greedy decoding.

    Transformers' own init (N(0, 0.02)) yields nearly flat logits, so greedy argmax between two
    implementations flips on float noise. Here instead:

    * embeddings / untied lm_head: random directions with *equal row norms* (so no single token
      is a universal argmax attractor); embedding row RMS is _EMBED_STD (_TIED_EMBED_STD when
      tied, smaller so the current token's own embedding does not dominate the residual and
      cause endless repetition); lm_head row RMS is _LM_HEAD_STD_FACTOR / sqrt(hidden).
      Special-token rows are scaled by _SPECIAL_ROW_SCALE so EOS is rarely the greedy choice.
    * linear weights: N(0, gain / sqrt(fan_in)); q/k use _QK_GAIN for sharper attention.
    * RMSNorm weights (incl. Qwen3 q_norm/k_norm): mean 1, jitter _NORM_JITTER; the final
      norm has mean _FINAL_NORM (_TIED_FINAL_NORM when tied), which sets the logit scale.
    * biases (Qwen2 q/k/v): N(0, _BIAS_STD), i.e. clearly non-zero.
    """

    def normal_(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float32) * std + mean)

    tied = bool(model.config.tie_word_embeddings)
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        if name.endswith("bias"):
            normal_(param, _BIAS_STD)
        elif "norm" in name:
            # model.norm (final) gets a larger scale: it directly multiplies the logits.
            mean = 1.0
            if name == "model.norm.weight":
                mean = _TIED_FINAL_NORM if tied else _FINAL_NORM
            normal_(param, _NORM_JITTER * mean, mean=mean)
        elif "embed_tokens" in name:
            std = _TIED_EMBED_STD if tied else _EMBED_STD
            normal_(param, std)
            # Equal row norms: no single token acts as a universal argmax attractor.
            param.mul_(std * math.sqrt(param.shape[1]) / param.norm(dim=1, keepdim=True))
            param[special_ids] *= _SPECIAL_ROW_SCALE
        elif name.startswith("lm_head"):
            std = _LM_HEAD_STD_FACTOR / math.sqrt(param.shape[1])
            normal_(param, std)
            param.mul_(std * math.sqrt(param.shape[1]) / param.norm(dim=1, keepdim=True))
            param[special_ids] *= _SPECIAL_ROW_SCALE
        elif param.dim() == 2:
            gain = _QK_GAIN if (".q_proj." in name or ".k_proj." in name) else _LINEAR_GAIN
            normal_(param, gain / math.sqrt(param.shape[1]))
        else:  # pragma: no cover - no other parameter kinds in these archs
            raise RuntimeError(f"unexpected parameter {name} {tuple(param.shape)}")


def _make_config(arch: str, vocab_size: int, bos: int, eos: int, pad: int) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    spec = dict(_SPECS[arch])
    rope_theta = spec.pop("rope_theta")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        initializer_range=0.02,  # unused: _init_weights overrides, kept for the record
        use_cache=True,
        **spec,
    )
    if arch == "llama":
        return LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, sliding_window=None, **common)
    if arch == "qwen3":
        return Qwen3Config(
            attention_bias=False, use_sliding_window=False, sliding_window=None, **common
        )
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def build_tiny_model(arch: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Build a randomly initialised tiny ``arch`` checkpoint (fp32 safetensors) in ``out_dir``.

    The tokenizer files from ``tokenizer_dir`` are copied in, so ``out_dir`` loads with both
    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. bos/eos/pad
    ids in ``config.json`` and ``generation_config.json`` match the tokenizer. The weights depend
    only on ``arch`` and ``seed`` (and the tokenizer's vocab size).

    Args:
        arch: One of :data:`ARCHS`.
        out_dir: Destination directory (created if needed).
        tokenizer_dir: Directory written by :func:`train_tokenizer`.
        seed: Seed for the weights.

    Returns:
        ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    if arch not in _SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    tokenizer_dir = Path(tokenizer_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    assert bos is not None and eos is not None and pad is not None
    config = _make_config(arch, len(tok), bos, eos, pad)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed * 1000 + ARCHS.index(arch))
    _init_weights(model, generator, sorted(set(tok.all_special_ids)))
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, do_sample=False
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for f in _tokenizer_files(tokenizer_dir):
        shutil.copyfile(f, out_dir / f.name)
    return out_dir


def build_all(root: Path, seed: int = 0, archs: Iterable[str] = ARCHS) -> dict[str, Path]:
    """Train the tokenizer into ``root/tokenizer`` and build every arch into ``root/<arch>``.

    Returns a mapping ``{"tokenizer": path, arch: path, ...}``.
    """
    root = Path(root)
    tok_dir = train_tokenizer(root / "tokenizer")
    out: dict[str, Path] = {"tokenizer": tok_dir}
    for arch in archs:
        out[arch] = build_tiny_model(arch, root / arch, tok_dir, seed=seed)
    return out


# ----------------------------------------------------------------------------- self-check


def _greedy_stats(model_dir: Path, prompts: list[str], max_new_tokens: int = 32) -> dict[str, Any]:
    """Greedy-generate from ``prompts`` with HF and measure top1-top2 logit margins."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    margins: list[float] = []
    rel: list[float] = []
    generated: list[list[int]] = []
    eos_count = 0
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # keep going past EOS so every step is measured
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[0, ids.shape[1] :].tolist()
        generated.append(new)
        for step_logits in out.logits:
            # raw logits (before min_new_tokens masks EOS): would greedy have picked EOS?
            eos_count += int(int(step_logits[0].argmax()) == tok.eos_token_id)
            top = step_logits[0].float().topk(2).values
            m = float(top[0] - top[1])
            margins.append(m)
            rel.append(m / float(step_logits[0].float().std()))
    margins_t = torch.tensor(margins)
    rel_t = torch.tensor(rel)
    return {
        "min_margin": float(margins_t.min()),
        "median_margin": float(margins_t.median()),
        "min_rel_margin": float(rel_t.min()),
        "median_rel_margin": float(rel_t.median()),
        "distinct_tokens": len({t for g in generated for t in g}),
        "distinct_per_prompt": [len(set(g)) for g in generated],
        "eos_generated": eos_count,
        "steps": len(margins),
        "sample": tok.decode(generated[0]),
    }


def _self_check() -> None:
    import hashlib
    import tempfile
    import time

    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    prompts = [
        "The quick brown fox",
        "Once upon a time",
        "def fibonacci(n):",
        "Question: What is the capital of France?\nAnswer:",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        paths = build_all(Path(tmp) / "a")
        build_s = time.perf_counter() - t0
        print(f"build (tokenizer + {len(ARCHS)} models): {build_s:.2f}s")

        # Determinism: a second build is byte-identical.
        paths_b = build_all(Path(tmp) / "b")

        def digest(d: Path) -> str:
            h = hashlib.sha256()
            for f in sorted(d.iterdir()):
                h.update(f.name.encode())
                h.update(f.read_bytes())
            return h.hexdigest()

        for key in paths:
            assert digest(paths[key]) == digest(paths_b[key]), f"{key} build not deterministic"
        print("determinism: OK (byte-identical rebuild)")

        tok = AutoTokenizer.from_pretrained(str(paths["tokenizer"]))
        raw = Tokenizer.from_file(str(paths["tokenizer"] / "tokenizer.json"))
        texts = [
            "héllo 日本",
            "Hello, world!\n\tx = 1  ",
            "emoji 🙂 and ñ\r\n  trailing ",
            "it's 12345 o'clock",
            "<|im_start|>user\nhi<|im_end|>\n",
        ]
        for text in texts:
            ids = tok(text).input_ids
            assert ids == raw.encode(text).ids, text
            assert tok.decode(ids) == text, (text, tok.decode(ids))
        assert tok("<|im_end|>").input_ids == [tok.convert_tokens_to_ids(IM_END)]
        chat_msgs = [{"role": "user", "content": "hi"}]
        chat = tok.apply_chat_template(chat_msgs, tokenize=False, add_generation_prompt=True)
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", chat
        print(
            f"tokenizer: vocab={len(tok)} bos=eos=pad={tok.eos_token_id} "
            f"im_start={tok.convert_tokens_to_ids(IM_START)} "
            f"im_end={tok.convert_tokens_to_ids(IM_END)} round-trip OK"
        )

        for arch in ARCHS:
            d = paths[arch]
            # AutoTokenizer picks a different class per model_type (Qwen2Tokenizer for qwen2);
            # all must tokenize identically and agree with the config's special ids.
            atok = AutoTokenizer.from_pretrained(str(d))
            for text in texts:
                assert atok(text).input_ids == tok(text).input_ids, (arch, text)
                assert atok.decode(atok(text).input_ids) == text, (arch, text)
            assert atok.apply_chat_template(chat_msgs, tokenize=False, add_generation_prompt=True)
            assert len(atok) == len(tok), arch
            model = AutoModelForCausalLM.from_pretrained(str(d))
            sd = model.state_dict()
            if arch == "qwen2":
                assert "model.layers.0.self_attn.q_proj.bias" in sd
                assert "model.layers.0.self_attn.k_proj.bias" in sd
                assert "model.layers.0.self_attn.v_proj.bias" in sd
                assert float(sd["model.layers.0.self_attn.k_proj.bias"].abs().min()) > 0
            if arch == "qwen3":
                assert "model.layers.0.self_attn.q_norm.weight" in sd
                assert "model.layers.0.self_attn.k_norm.weight" in sd
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                assert getattr(model.config, key) == getattr(atok, key), (arch, key)
                assert getattr(model.generation_config, key) == getattr(atok, key), (arch, key)
            assert model.config.vocab_size == len(atok)
            assert model.dtype == torch.float32
            tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
            assert tied == model.config.tie_word_embeddings, arch
            n_params = sum(p.numel() for p in model.parameters())

            # bf16 load works and mostly agrees with fp32 on the first greedy steps.
            mbf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
            ids = atok(prompts[0], return_tensors="pt").input_ids
            g32 = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
            gbf = mbf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
            bf_agree = int((g32 == gbf).cumprod(0).sum())

            s = _greedy_stats(d, prompts)
            c = model.config
            print(
                f"{arch:8s} params={n_params} hidden={c.hidden_size} layers={c.num_hidden_layers}"
                f" heads={c.num_attention_heads}/{c.num_key_value_heads}"
                f" head_dim={getattr(c, 'head_dim', None)} inter={c.intermediate_size}"
                f" tied={c.tie_word_embeddings}"
                f" theta={c.rope_parameters['rope_theta']}"
            )
            print(
                f"         margin min={s['min_margin']:.4f} median={s['median_margin']:.4f}"
                f" (rel to logit std: min={s['min_rel_margin']:.4f}"
                f" median={s['median_rel_margin']:.4f}) steps={s['steps']}"
                f" distinct={s['distinct_tokens']} per-prompt={s['distinct_per_prompt']}"
                f" eos={s['eos_generated']} bf16-agree-prefix={bf_agree}/8"
            )
            print(f"         sample: {s['sample']!r}")


if __name__ == "__main__":
    _self_check()
