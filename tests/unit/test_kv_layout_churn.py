"""``benchmarks.kv_layout``'s churn: the real block manager driven as a serving engine
drives it (pure bookkeeping, no torch), and the consecutive baseline it is timed
against."""

from __future__ import annotations

import pytest

from benchmarks.kv_layout import (
    Churn,
    adjacent_share,
    churn_tables,
    consecutive,
    parse_block_sizes,
)


def test_the_churn_ends_with_the_running_sequences_tables() -> None:
    c = Churn(num_blocks=400, block_size=4, batch=12, steps=200, prompt_len=10,
              output_len=(3, 20), seed=1)
    t = churn_tables(c)
    assert len(t.tables) == len(t.lens) <= c.batch
    assert t.sequences > c.batch  # sequences finished and were replaced
    for table, n in zip(t.tables, t.lens, strict=True):
        # Blocks for every token, and the slot of the next token computed: at most one
        # block past the context's own.
        assert (n - 1) // c.block_size + 1 <= len(table) <= n // c.block_size + 1
        assert c.prompt_len + 1 <= n <= c.prompt_len + c.output_len[1]
    held = [b for table in t.tables for b in table]
    assert len(held) == len(set(held)) and all(0 <= b < c.num_blocks for b in held)
    assert 0.0 <= t.adjacent <= 1.0 and t.adjacent == adjacent_share(t.tables)
    assert churn_tables(c) == t  # seeded


def test_the_baseline_keeps_each_length_in_one_run_of_blocks() -> None:
    tables = [[7, 3, 9], [1], [4, 5]]
    runs = consecutive(tables)
    assert runs == [[0, 1, 2], [3], [4, 5]]
    assert adjacent_share(runs) == 1.0
    assert adjacent_share(tables) == pytest.approx(1 / 3)  # [4, 5] only


def test_a_cache_too_small_for_the_batch_says_what_to_change() -> None:
    with pytest.raises(RuntimeError, match="kv-cache-gb"):
        churn_tables(Churn(num_blocks=10, block_size=4, batch=8, steps=5, prompt_len=10))


def test_block_sizes_parse_or_say_what_they_want() -> None:
    assert parse_block_sizes("64,16,128") == [64, 16, 128]
    for bad in ("", "64,", "0,16", "-16", "sixteen"):
        with pytest.raises(ValueError, match="positive integers like 64,16"):
            parse_block_sizes(bad)
