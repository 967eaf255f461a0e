import hashlib
import random
import struct

import pytest

from common import hashing
from common.hashing import BlockHashChain, block_hashes, hash_block, root_hash


def test_block_hash_values_are_pinned() -> None:
    # Changing these invalidates every prefix cache and Redis index entry in a cluster.
    assert root_hash("m") == 0xED261C354F5BE743
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, "m") == [
        0xF741ADAC15CA3EEE,
        0x3085B338F25611BD,
    ]
    assert block_hashes([1, 2, 3, 4], 4, "m", cache_salt="tenant-a") == [0x82B6B842FB603D61]


def test_hash_covers_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "m")
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, "m")
    assert a[1] != b[1], "equal second blocks after different first blocks must differ"


def test_partial_trailing_block_has_no_hash() -> None:
    assert len(block_hashes(list(range(15)), 4, "m")) == 3
    assert block_hashes([1, 2, 3], 4, "m") == []


def test_model_and_salt_separate_namespaces() -> None:
    tokens = list(range(8))
    base = block_hashes(tokens, 4, "model-a")
    assert base != block_hashes(tokens, 4, "model-b")
    assert base != block_hashes(tokens, 4, "model-a", cache_salt="tenant")
    assert block_hashes(tokens, 4, "model-a", cache_salt="t") == block_hashes(
        tokens, 4, "model-a", cache_salt="t"
    )


def test_chain_can_be_continued() -> None:
    tokens = list(range(20))
    full = block_hashes(tokens, 4, "m", cache_salt="s")
    head = block_hashes(tokens[:8], 4, "m", cache_salt="s")
    tail = block_hashes(tokens, 4, "m", cache_salt="s", parent=head[-1], start_block=2)
    assert head + tail == full
    assert hash_block(full[0], tokens[4:8]) == full[1]


def _v1_first_block(model_id: str, tokens: list[int], salt: bytes) -> int:
    """The v1 encoding as first written (a uint16 salt length), for salts it could hold."""
    payload = struct.pack(f"<QI{len(tokens)}IH", root_hash(model_id), len(tokens), *tokens,
                          len(salt))
    return int.from_bytes(hashlib.blake2b(payload + salt, digest_size=8).digest(), "little")


def test_salts_up_to_the_old_field_size_hash_exactly_as_before() -> None:
    for size in (0, 1, 255, 256, 65_535):
        salt = "s" * size
        assert block_hashes([1, 2, 3, 4], 4, "m", cache_salt=salt or None) == [
            _v1_first_block("m", [1, 2, 3, 4], salt.encode())
        ], size


def test_a_salt_of_any_length_hashes_and_still_separates_tenants() -> None:
    """A 70 KB salt overflowed the uint16 length field (struct.error) inside an engine
    step; the field now saturates, and the salt, the payload's tail, still counts whole."""
    long_a = block_hashes([1, 2, 3, 4], 4, "m", cache_salt="s" * 70_000)
    long_b = block_hashes([1, 2, 3, 4], 4, "m", cache_salt="s" * 70_001)
    at_limit = block_hashes([1, 2, 3, 4], 4, "m", cache_salt="s" * 65_535)
    assert len({long_a[0], long_b[0], at_limit[0]}) == 3
    assert long_a == block_hashes([1, 2, 3, 4], 4, "m", cache_salt="s" * 70_000)


def test_a_lone_surrogate_salt_hashes_instead_of_raising() -> None:
    assert block_hashes([1, 2, 3, 4], 4, "m", cache_salt="\ud800") != block_hashes(
        [1, 2, 3, 4], 4, "m")


def test_token_ids_outside_uint32_raise_a_value_error_naming_the_id() -> None:
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match=f"token id {bad} "):
            block_hashes([1, 2, 3, bad], 4, "m")


def _v1_reference(tokens: list[int], block_size: int, model_id: str, salt: bytes) -> list[int]:
    """The v1 chain as first written: one ``struct.pack`` of every field, per block."""
    out, h = [], root_hash(model_id)
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        extra = salt if i == 0 else b""
        payload = struct.pack(f"<QI{len(block)}IH", h, len(block), *block, len(extra))
        h = int.from_bytes(hashlib.blake2b(payload + extra, digest_size=8).digest(), "little")
        out.append(h)
    return out


def test_the_one_pack_per_prompt_encoding_is_the_v1_encoding() -> None:
    """block_hashes packs the whole prompt once (the router's hot path); the bytes each
    block hashes, and so every value in a running cluster, are those of v1."""
    rng = random.Random(3)
    for block_size in (1, 4, 16, 33):
        for salt in ("", "tenant-a", "é"):
            tokens = [rng.randrange(2**32) for _ in range(block_size * 7 + 3)]
            want = _v1_reference(tokens, block_size, "m", salt.encode())
            assert block_hashes(tokens, block_size, "m", salt or None) == want
            assert block_hashes(tuple(tokens), block_size, "m", salt or None) == want
            assert block_hashes(tokens, block_size, "m", salt or None, parent=want[2],
                                start_block=3) == want[3:]
            assert hash_block(want[0], tokens[block_size : 2 * block_size]) == want[1]


def test_a_chain_hashes_each_block_once_as_its_sequence_grows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []  # tokens handed to block_hashes, per call
    real = hashing.block_hashes
    monkeypatch.setattr(hashing, "block_hashes",
                        lambda tokens, *a, **k: hashed.append(len(tokens)) or real(tokens, *a, **k))
    prompt, generated = list(range(40)), list(range(100, 130))
    chain = BlockHashChain(8, "m", "tenant")
    assert chain.update(prompt) == real(prompt, 8, "m", "tenant") and hashed == [40]
    assert chain.update(prompt) == real(prompt, 8, "m", "tenant") and hashed == [40]  # a retry
    grown = prompt + generated  # a migration: the prompt continued by the tokens so far
    assert chain.update(grown) == real(grown, 8, "m", "tenant") and hashed == [40, 24]
    assert chain.update(prompt[:17]) == real(prompt, 8, "m", "tenant")[:2]
    assert hashed == [40, 24]


def test_a_chain_given_other_tokens_starts_over() -> None:
    chain = BlockHashChain(4, "m")
    chain.update([1, 2, 3, 4, 5, 6, 7, 8])
    assert chain.update([1, 2, 3, 9, 5, 6, 7, 8, 9]) == block_hashes([1, 2, 3, 9, 5, 6, 7, 8], 4,
                                                                      "m")
    assert chain.update((1, 2, 3, 9)) == block_hashes([1, 2, 3, 9], 4, "m")  # any sequence type
    assert chain.update([1, 2, 3]) == []
    with pytest.raises(ValueError, match="block_size"):
        BlockHashChain(0, "m")
