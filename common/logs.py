"""How a pdserve process logs: INFO and up to stderr, each line stamped with the time
and the component (``decode@50061``, ``router@50051``) so that lines from several
workers read apart once collected (a terminal, Ray's ``worker-*.err`` files, a pod's
log). Called once, at a process's entry point (``pdserve worker|router``, the Ray
actor that serves one); a library module only ever takes ``logging.getLogger``.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s {name} %(levelname)s %(name)s: %(message)s"


def log_to_stderr(name: str, level: int = logging.INFO) -> None:
    """Send this process's log records at ``level`` and up to stderr, tagged ``name``.
    A handler already installed is replaced (``force``): a Ray worker process may have
    one of Ray's own that drops INFO."""
    logging.basicConfig(level=level, stream=sys.stderr, format=FORMAT.replace("{name}", name),
                        force=True)
