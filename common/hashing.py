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
an accidental collision costs a cache miss, never a wrong token. That re-check covers the
block's own tokens, not its prefix's, so the hash must also resist a *crafted* collision
(a block that hashes as the same tokens after another prefix would be served that
prefix's KV): it stays cryptographic, which rules out faster non-cryptographic hashes
such as XXH3 (about 3x faster on a 2048-token prompt).
``tests/unit/test_hashing.py`` pins the output: changing anything here invalidates every
cache and index entry in a running cluster, so it is a breaking change.

Speed: the router hashes every prompt before it can route it (``pdserve bench-routing``
times the decision), so the tokens are packed once, in one native call, and each block
costs one BLAKE2b call over a few joined byte strings; no per-token Python work.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

HASH_VERSION = 1
"""Bumped whenever the encoding below changes; part of the root hash."""

_blake2b = hashlib.blake2b


def _digest(payload: bytes) -> int:
    return int.from_bytes(_blake2b(payload, digest_size=8).digest(), "little")


def root_hash(model_id: str) -> int:
    """The parent of a sequence's first block: ties every chain to one model."""
    return _digest(f"pdserve-block-hash-v{HASH_VERSION}:{model_id}".encode())


# The v1 encoding of a block: ``<Q`` parent, ``<I`` token count, the tokens as ``<I``
# each, ``<H`` length of the extra keys, the extra keys.
_EXTRA_LEN_FIELD_MAX = 0xFFFF
"""The v1 encoding's extra-keys length field is a uint16. It saturates here: the extra
keys are the payload's tail, so their length is implied by the payload's and the field
carries no information the digest needs. Every payload that fit before is unchanged
(the pinned values hold); longer extra keys, which used to raise ``struct.error``, hash
like any other (:data:`common.request.MAX_CACHE_SALT_BYTES` bounds the salt itself)."""

_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_TOKEN_ID_MAX = 0xFFFF_FFFF  # token ids are packed as uint32


def _pack(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as little-endian uint32, in one native call.

    Raises ``ValueError`` for a token id outside ``[0, 2**32)`` (the engine never holds
    one: prompts and first tokens are checked against the vocabulary on the way in)."""
    try:
        packed = array(_U32, token_ids)
    except (OverflowError, TypeError) as e:
        bad = next((t for t in token_ids
                    if not (isinstance(t, int) and 0 <= t <= _TOKEN_ID_MAX)), None)
        what = f"token id {bad!r} is not an integer in [0, 2**32)" if bad is not None else e
        raise ValueError(f"cannot hash block: {what}") from e
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _tail(extra_keys: bytes) -> bytes:
    return min(len(extra_keys), _EXTRA_LEN_FIELD_MAX).to_bytes(2, "little") + extra_keys


def hash_block(parent: int, token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
    """Hash one full block given its parent's hash. Pure and thread-safe; raises
    ``ValueError`` for a token id outside ``[0, 2**32)``."""
    return _digest(b"".join((parent.to_bytes(8, "little"), len(token_ids).to_bytes(4, "little"),
                             _pack(token_ids), _tail(extra_keys))))


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
    the index of the first block still to hash, to hash newly filled blocks only (only
    those blocks' tokens are read). Equal to :func:`hash_block` block by block.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    end = len(token_ids) // block_size
    if start_block >= end:
        return []
    h = root_hash(model_id) if parent is None else parent
    packed = _pack(token_ids[start_block * block_size : end * block_size])
    count, step, plain = block_size.to_bytes(4, "little"), 4 * block_size, _tail(b"")
    # Each digest is its block's hash as the next block's payload wants it (8 bytes,
    # little-endian): chain the bytes, and turn them into ints once, at the end.
    digests: list[bytes] = []
    prev, first = h.to_bytes(8, "little"), 0
    if start_block == 0 and cache_salt:
        # surrogatepass: the same bytes for every valid string, and no error for a lone
        # surrogate (Request refuses those; hashing stays total regardless).
        salted = _tail(cache_salt.encode("utf-8", "surrogatepass"))
        prev = _blake2b(b"".join((prev, count, packed[:step], salted)), digest_size=8).digest()
        digests.append(prev)
        first = step
    blake2b, join, add = _blake2b, b"".join, digests.append
    for at in range(first, len(packed), step):
        prev = blake2b(join((prev, count, packed[at : at + step], plain)), digest_size=8).digest()
        add(prev)
    return list(struct.unpack(f"<{len(digests)}Q", b"".join(digests)))


class BlockHashChain:
    """The block hashes of one token sequence that grows, each block hashed once.

    The router keeps one per request: its first attempt hashes the prompt, and after a
    migration (the prompt continued by the tokens generated so far) only the blocks those
    tokens filled are hashed. :meth:`update` checks that the tokens it is given continue
    the ones it hashed (a C-level list compare) and starts over when they do not, so a
    chain can never answer for a sequence it did not hash. Not thread-safe: one owner."""

    def __init__(self, block_size: int, model_id: str, cache_salt: str | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size, self.model_id, self.cache_salt = block_size, model_id, cache_salt
        self._hashes: list[int] = []
        self._tokens: list[int] = []  # the tokens of the hashed (full) blocks

    def update(self, token_ids: Sequence[int]) -> list[int]:
        """Hashes of every full block of ``token_ids`` (a new list), as
        :func:`block_hashes` gives them, hashing only blocks not hashed before."""
        bs = self.block_size
        full = len(token_ids) // bs
        known = min(full, len(self._hashes))
        if known:
            hashed = self._tokens
            if known * bs < len(hashed):
                hashed = hashed[: known * bs]
            if _as_list(token_ids[: known * bs]) != hashed:  # not a continuation: start over
                self._hashes.clear()
                self._tokens.clear()
        done = len(self._hashes)
        if full > done:
            new = _as_list(token_ids[done * bs : full * bs])
            if done:  # the salt is the first block's alone
                self._hashes += block_hashes(new, bs, self.model_id, parent=self._hashes[-1])
            else:
                self._hashes += block_hashes(new, bs, self.model_id, self.cache_salt)
            self._tokens += new
        return self._hashes[:full]


def _as_list(tokens: Sequence[int]) -> list[int]:
    return tokens if isinstance(tokens, list) else list(tokens)
