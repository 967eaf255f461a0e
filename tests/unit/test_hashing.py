from common.hashing import block_hashes, hash_block, root_hash


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
