"""common.threads: the kernel's thread names the serving profile groups threads by."""

from __future__ import annotations

import sys
import threading

import pytest

from common.threads import ENGINE, name_native_thread


@pytest.mark.skipif(sys.platform != "linux", reason="thread names are read from /proc")
def test_a_named_thread_and_the_threads_it_starts_carry_the_name() -> None:
    seen: dict[str, str] = {}

    def comm() -> str:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()

    def child() -> None:
        seen["child"] = comm()

    def named() -> None:
        assert name_native_thread(ENGINE + "-and-a-long-tail")  # truncated, not refused
        seen["named"] = comm()
        t = threading.Thread(target=child)
        t.start()
        t.join()

    t = threading.Thread(target=named)
    t.start()
    t.join()
    assert seen == {"named": "pds-engine-and-", "child": "pds-engine-and-"}
    assert comm() != "pds-engine-and-"  # only the calling thread was renamed


@pytest.mark.skipif(sys.platform != "linux", reason="a thread is reniced alone on Linux")
def test_a_lowered_thread_is_reniced_alone() -> None:
    import os

    from common.threads import lower_thread_priority

    before = os.getpriority(os.PRIO_PROCESS, 0)
    seen: dict[str, int | None] = {}

    def background() -> None:
        seen["returned"] = lower_thread_priority(5)
        seen["kernel"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=background)
    t.start()
    t.join()
    expected = min(19, before + 5)
    assert seen == {"returned": expected, "kernel": expected}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    assert lower_thread_priority(0) is None  # nothing asked: nothing changed
