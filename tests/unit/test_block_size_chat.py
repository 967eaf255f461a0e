"""``benchmarks.block_size_chat``'s conversations: each turn carries the whole history,
so a prefix cache can serve all of it but what the last whole block leaves over."""

from __future__ import annotations

from benchmarks.block_size_chat import REPLY, USER, conversations


def test_each_turn_is_the_last_one_a_reply_and_a_user_message() -> None:
    chats = conversations(5, 3, seed=2)
    assert len(chats) == 5 and all(len(c) == 3 for c in chats)
    for c in chats:
        assert USER[0] <= len(c[0]) <= USER[1]
        for prev, turn in zip(c, c[1:], strict=False):
            assert turn[:len(prev)] == prev  # the whole history, as sent before
            grown = len(turn) - len(prev)
            assert REPLY[0] + USER[0] <= grown <= REPLY[1] + USER[1]
    assert conversations(5, 3, seed=2) == chats  # seeded
    assert conversations(5, 3, seed=3) != chats
