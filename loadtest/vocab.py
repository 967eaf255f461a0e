"""Which token ids a workload may send: ordinary ids of the served model's vocabulary.

The harness never trusts a constant: an id past a small model's vocabulary fails every
request. ``pdserve bench`` takes its ids, in this order of preference, from:

1. ``--max-token-id N``: the ids in ``[N / 30, N)`` (the user vouches for them);
2. ``--tokenizer PATH``: every id of that tokenizer but its special and added tokens;
3. the server (:func:`server_token_ids`): it tokenizes a fixed English sample (gRPC
   ``Tokenize``; HTTP ``POST /tokenize`` as vLLM and pdserve's front serve it, with
   ``add_special_tokens`` false) and the distinct ids that come back are the pool, less
   those the tokenizer adds to an empty text (BOS and the like): 190 of SmolLM2's ids,
   all ordinary tokens; a prompt costs the same whichever ids it holds. A server that
   answers neither is refused, naming what to pass instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from .backends import TargetError, is_http

SAMPLE = (
    "The quick brown fox jumps over the lazy dog. Serving a language model well means "
    "keeping every accelerator busy: requests arrive at random times, prompts range from "
    "a few words to many thousands of tokens, and each answer streams back one token at "
    "a time. A router spreads the load over workers; some compute prompts (prefill), "
    "others generate (decode), and the cache of keys and values moves between them. "
    "Numbers help: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 256, 1024, 3.14159, 2026-11-29, "
    "$19.99, 75%, #7, (a + b) * c = d; x <= y && y >= z || !w. Questions? Answers! "
    "Weather, history, cooking, music, physics, chemistry, biology, mathematics, poetry, "
    "travel, sport, medicine, law, economics, geography, astronomy and philosophy. "
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday; January, February, "
    "March, April, May, June, July, August, September, October, November, December. "
    "def main(args): return sum(x * x for x in args if x > 0)  # Python code\n"
    "She said: \"It's not what you think,\" and then they'd gone. Why? Because we're "
    "here, you've seen it, I'll know. Red, orange, yellow, green, blue, indigo, violet."
)
"""Ordinary text in many shapes (words, digits, punctuation, code); no special-token
text."""

PROBE_TIMEOUT_S = 10.0


def from_max_token_id(max_token_id: int) -> range:
    """``--max-token-id``: ids in ``[max_token_id / 30, max_token_id)``, clear of the
    special ids most vocabularies put first."""
    if max_token_id < 30:
        raise ValueError(f"--max-token-id must be at least 30, got {max_token_id}")
    return range(max_token_id // 30, max_token_id)


def from_tokenizer(path: str) -> list[int]:
    """Every id of the Hugging Face tokenizer at ``path`` (a directory or a hub name in
    the local cache) that is not a special or added token. Raises ValueError."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {path}: cannot load a tokenizer there ({e})") from None
    special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    return [i for i in range(len(tok)) if i not in special]


def pool_from_sample(sample_ids: Sequence[int], empty_ids: Sequence[int]) -> list[int]:
    """The distinct ids of the sample, in first-seen order (so the pool, and hence a
    seeded workload, is the same on every run), less those an empty text gets."""
    added = set(empty_ids)
    return [i for i in dict.fromkeys(sample_ids) if i not in added]


async def _grpc_pool(target: str, api_key: str | None, tls_ca: str | None) -> list[int]:
    import grpc

    from router.client import AsyncClient

    async with AsyncClient(target, tls_ca, api_key=api_key) as client:
        try:
            sample = await client.tokenize(SAMPLE, timeout=PROBE_TIMEOUT_S)
            empty = await client.tokenize("", timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            hint = (" (is a router running there? `pdserve status --target " + target + "`)"
                    if e.code() in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED) else "")
            raise TargetError(f"cannot ask the router at {target} for its vocabulary: "
                              f"{e.code().name}: {e.details()}{hint}") from None
    return pool_from_sample(sample, empty)


async def _http_pool(base_url: str, model: str | None, api_key: str | None) -> list[int]:
    import aiohttp

    url = base_url.rstrip("/") + "/tokenize"
    body: dict = {"prompt": SAMPLE, "add_special_tokens": False}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as session, \
                session.post(url, json=body, headers=headers) as r:
            if r.status in (404, 405):
                which = f" or no model {model!r}" if model else ""
                raise TargetError(f"{url} answered HTTP {r.status} (no such endpoint{which}), "
                                  "so the vocabulary is unknown: pass --tokenizer PATH (the "
                                  "model's tokenizer) or --max-token-id N")
            if r.status != 200:
                raise TargetError(f"{url} answered HTTP {r.status}: {(await r.text())[:200]}")
            ids = (await r.json()).get("tokens")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        raise TargetError(f"cannot reach {url}: {e or type(e).__name__}") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise TargetError(f"{url} answered without a list of token ids in `tokens`")
    return pool_from_sample(ids, ())


def server_token_ids(target: str, *, model: str | None = None, api_key: str | None = None,
                     tls_ca: str | None = None) -> list[int]:
    """Ordinary token ids of the model ``target`` serves (see the module docstring).
    Blocks (runs its own event loop); raises :class:`TargetError` in one line."""
    pool = asyncio.run(_http_pool(target, model, api_key) if is_http(target)
                       else _grpc_pool(target, api_key, tls_ca))
    if not pool:
        raise TargetError(f"{target} tokenized a {len(SAMPLE)}-character text to no "
                          "ordinary ids: pass --tokenizer PATH or --max-token-id N")
    return pool
