"""The block-hash chain: one function shared by the router and every worker.

A prompt is cut into full blocks of ``block_size`` tokens. Block ``i`` hashes to
``h_i = H(h_{i-1}, tokens of block i, extra keys)`` where ``h_{-1}`` is derived from the
model identity, so two models never share entries, and the extra keys of the first block
carry the tenant's cache salt (a shared prefix cache is a timing side channel; tenants
share blocks only when they opt in by using the same salt). Because each hash covers its
parent, equal hashes mean equal prefixes, not just equal blocks.

H is BLAKE2b with an 8-byte digest over a fixed byte encoding, so the value is the same
in every process, on every machine and in every Python version (never Python's
``hash()``). A hit is still re-checked against the stored tokens by the block manager, so
a collision can cost a cache miss but never a wrong token. ``tests/unit/test_hashing.py``
pins the output: changing anything here invalidates every cache and index entry in a
running cluster, so it is a breaking change.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_VERSION = 1
"""Bumped whenever the encoding below changes; part of the root hash."""


def _digest(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def root_hash(model_id: str) -> int:
    """The parent of a sequence's first block: ties every chain to one model."""
    return _digest(f"pdserve-block-hash-v{HASH_VERSION}:{model_id}".encode())


_EXTRA_LEN_FIELD_MAX = 0xFFFF
"""The v1 encoding's extra-keys length field is a uint16. It saturates here: the extra
keys are the payload's tail, so their length is implied by the payload's and the field
carries no information the digest needs. Every payload that fit before is unchanged
(the pinned values hold); longer extra keys, which used to raise ``struct.error``, hash
like any other (:data:`common.request.MAX_CACHE_SALT_BYTES` bounds the salt itself)."""

_TOKEN_ID_MAX = 0xFFFF_FFFF  # token ids are packed as uint32


def hash_block(parent: int, token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
    """Hash one full block given its parent's hash. Pure and thread-safe.

    Raises ``ValueError`` for a token id outside ``[0, 2**32)`` (the engine never holds
    one: prompts and first tokens are checked against the vocabulary on the way in)."""
    try:
        payload = struct.pack(f"<QI{len(token_ids)}IH", parent, len(token_ids), *token_ids,
                              min(len(extra_keys), _EXTRA_LEN_FIELD_MAX))
    except struct.error as e:
        bad = next((t for t in token_ids
                    if not (isinstance(t, int) and 0 <= t <= _TOKEN_ID_MAX)), None)
        what = f"token id {bad!r} is not an integer in [0, 2**32)" if bad is not None else e
        raise ValueError(f"cannot hash block: {what}") from e
    return _digest(payload + extra_keys)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    cache_salt: str | None = None,
    parent: int | None = None,
    start_block: int = 0,
) -> list[int]:
    """Hashes of every *full* block of ``token_ids`` (a trailing partial block has none).

    ``parent``/``start_block`` continue an existing chain: pass the last known hash and
    the index of the first block still to hash, to hash newly filled blocks only.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    h = root_hash(model_id) if parent is None else parent
    # surrogatepass: the same bytes for every valid string, and no error for a lone
    # surrogate (Request refuses those; hashing stays total regardless).
    salt = cache_salt.encode("utf-8", "surrogatepass") if cache_salt else b""
    out: list[int] = []
    for i in range(start_block, len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        h = hash_block(h, block, salt if i == 0 else b"")
        out.append(h)
    return out
