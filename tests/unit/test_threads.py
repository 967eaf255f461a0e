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
