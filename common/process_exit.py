"""How a process that moved KV ends: its orderly shutdown, then
:func:`exit_after_shutdown`, never the interpreter's finalization.

Why. The transfer layer's threads are daemons by design (a peer that went silent must
never hold a worker's exit), and most of their time is spent inside torch calls that
release the GIL: a gloo ``Work.wait``, a ``TCPStore.queue_pop`` waiting for a peer's
reply. CPython 3.11 ends a daemon thread that tries to take the GIL back once
finalization has begun with ``pthread_exit``; that unwinds the thread's stack through
pybind11's GIL guard, a ``noexcept`` destructor, and the C++ runtime calls
``std::terminate``: SIGABRT, exit status 134, "terminate called without an active
exception" on stderr. Any such call returning in the short window between the main
thread's end and the process's does it: a reply wait woken by the close's own STOP,
a posted message resolving. Seen once in CI (the transfer test agent, after every
assertion had passed) and reproduced in a few lines: a daemon thread in
``queue_pop`` with a 0.5 s timeout, the main thread returning at 0.3 s, exits 134
every time.

The process has closed everything it owns by the time it calls this (the worker's
``serve`` drains, closes its KV sender and receiver, its step trace and its Redis
clients), so nothing is lost by skipping finalization: the streams and logging
handlers are flushed here, and the exit status is the one given.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_after_shutdown(code: int) -> None:
    """Flush logging and the standard streams, then end the process with ``code`` at
    once (``os._exit``): no daemon thread can wake into a finalizing interpreter."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(code)
