"""Structured-output overhead: greedy decode tok/s with a JSON-schema grammar against
unconstrained decoding, same engine, same run.

``python -m benchmarks.structured [--batch 8] [--tokens 64] [--repeats 3]``. The schema
holds one long string field, so no request ends before ``--tokens`` (the grammar's mask
and advance run on every token, like a real JSON answer mid-string). Prints the
workload, the hardware and the ratio; the best of ``--repeats`` alternating runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from common.sampling import SamplingParams, StructuredOutput
from workers.engine.llm import LLM

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}},
          "required": ["text"], "additionalProperties": False}


def _tok_per_s(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == len(prompts) * params.max_tokens, "a request ended early"
    return tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model)
    prompts = [llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write a JSON object about topic {i}."}],
        tokenize=False, add_generation_prompt=True) for i in range(args.batch)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                                 structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    _tok_per_s(llm, prompts, constrained)  # warm-up; compiles the schema once
    best = {"plain": 0.0, "json_schema": 0.0}
    for _ in range(args.repeats):
        best["plain"] = max(best["plain"], _tok_per_s(llm, prompts, plain))
        best["json_schema"] = max(best["json_schema"], _tok_per_s(llm, prompts, constrained))
    overhead = best["plain"] / best["json_schema"] - 1
    print(f"workload: {args.batch} requests x {args.tokens} greedy tokens, "
          f"dtype {llm.config.dtype}, model {llm.config.model}")
    print(f"hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"unconstrained {best['plain']:.1f} tok/s, json_schema {best['json_schema']:.1f} "
          f"tok/s: {overhead:+.1%} time per token")


if __name__ == "__main__":
    main()
