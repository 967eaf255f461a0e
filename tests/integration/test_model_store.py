"""Integration tests for workers.model_store: the default GGUF -> cached checkpoint lifecycle.

The conversion takes ~20 s, so these tests share one cache across runs and test files:
``$PDSERVE_TEST_CACHE_DIR`` if set, else the user's real cache (``~/.cache/pdserve``). The first
run converts; later runs reuse the checkpoint. Concurrent runs are safe (the store locks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from workers.model_store import (
    DEFAULT_MODEL_NAME,
    ModelStoreError,
    default_cache_dir,
    find_default_gguf,
    resolve_model,
)


def _test_cache_dir() -> Path:
    """The cache shared by the test suite (reading the environment is fine at this edge)."""
    override = os.environ.get("PDSERVE_TEST_CACHE_DIR")
    return Path(override).expanduser() if override else default_cache_dir()


@pytest.fixture(scope="module")
def default_checkpoint() -> Path:
    """The converted default model, converting it once if the shared cache lacks it."""
    return resolve_model(None, cache_dir=_test_cache_dir())


def test_find_default_gguf_locates_the_wheel_file() -> None:
    path = find_default_gguf()
    assert path.is_file()
    assert path.suffix == ".gguf"
    assert DEFAULT_MODEL_NAME.lower() in path.name.lower()


@pytest.mark.slow
def test_default_model_resolves_to_a_loadable_checkpoint(default_checkpoint: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    assert default_checkpoint == _test_cache_dir().absolute() / "models" / DEFAULT_MODEL_NAME
    assert (default_checkpoint / "model.safetensors").is_file()
    # Resolving again (by name this time) must reuse the cache, not convert again.
    assert resolve_model(DEFAULT_MODEL_NAME, cache_dir=_test_cache_dir()) == default_checkpoint

    raw = json.loads((default_checkpoint / "config.json").read_text())
    assert "quantization_config" not in raw
    config = AutoConfig.from_pretrained(default_checkpoint)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.tie_word_embeddings is True

    tokenizer = AutoTokenizer.from_pretrained(default_checkpoint)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_default_model_answers_sensibly(default_checkpoint: Path) -> None:
    """Greedy decoding of a factual question: catches silently wrong weight conversions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(default_checkpoint)
    assert model.dtype == torch.float32
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_missing_path_gives_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelStoreError) as excinfo:
        resolve_model(missing)
    message = str(excinfo.value)
    assert str(missing) in message
    assert "config.json" in message
    assert "not supported" in message  # hub ids are rejected, and the message says so


def test_hub_id_is_rejected() -> None:
    with pytest.raises(ModelStoreError, match="offline"):
        resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match="no config.json"):
        resolve_model(tmp_path)


def test_local_checkpoint_directory_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.absolute()
