"""A userspace ``netem`` for a test host's link: delay, jitter and loss between two TAP
devices, for kernels built without ``sch_netem`` (this project's CI VM has none, nor tc
``gact`` actions, nor netfilter tools).

A test host (:mod:`cluster.testhosts`) normally hangs on its bridge by a veth pair. An
*emulated* host hangs on it by two TAP devices instead: ``pdst<i>`` on the bridge and
``eth0`` inside the host, and this module's shuttle process moves every Ethernet frame
between them: each one, in each direction, is dropped with probability ``loss``, else
written to the other side ``delay_ms`` (± ``jitter_ms``, uniform) after it was read. Frames
keep their order in each direction (jitter never reorders: a frame is never released
before the one read ahead of it), so TCP sees delay and loss, not reordering.

Lifecycle. :meth:`LinkEmulator.start` opens both TAPs (in the caller's network
namespace: the caller then moves one into the host, which keeps the descriptors
working) and starts the shuttle, a separate Python process (``python -m
cluster.linkemu``; its own GIL, so a test's load threads and the frames do not wait on
each other) that inherits both descriptors. :meth:`LinkEmulator.set` changes the
impairment at once (a JSON line on the shuttle's stdin, acknowledged with its counters),
:meth:`LinkEmulator.counters` reads them, :meth:`LinkEmulator.close` ends the shuttle and
closes the descriptors (the TAPs vanish with the last one). Writing to a TAP that is
down (a cut link, :meth:`cluster.testhosts.Host.cut`) drops the frame, as a cable would.

Throughput is what one Python loop moves, ~50-100k frames/s of 1,500 bytes on this
machine: enough for a test's KV (megabytes), not a benchmark of a fast link. Linux only;
needs ``/dev/net/tun`` and CAP_NET_ADMIN (root or a user namespace's).
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import select
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536


@dataclass(frozen=True)
class Impairment:
    """What the link does to each frame, each direction."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0  # probability a frame is dropped

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.delay_ms:
            raise ValueError(f"need 0 <= jitter_ms <= delay_ms, got {self}")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss is a probability in [0, 1], got {self.loss}")


def open_tap(name: str) -> int:
    """A new TAP device ``name`` (Ethernet frames, no packet-info header), in this
    process's network namespace; returns its non-blocking descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class LinkEmulator:
    """Two TAP devices and the shuttle between them (module docstring)."""

    def __init__(self, a_name: str, b_name: str, seed: int = 0) -> None:
        self.names = (a_name, b_name)
        self.seed = seed
        self._fds: tuple[int, int] | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> LinkEmulator:
        a = open_tap(self.names[0])
        try:
            b = open_tap(self.names[1])
        except OSError:
            os.close(a)
            raise
        self._fds = (a, b)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.linkemu", str(a), str(b), str(self.seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(a, b))
        self.counters()  # the shuttle answers: it runs
        return self

    def _ask(self, line: str) -> dict[str, int]:
        if self._proc is None or self._proc.stdin is None or self._proc.stdout is None:
            raise RuntimeError("the link emulator is not running (start() it)")
        self._proc.stdin.write(line + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the link emulator exited ({self._proc.poll()})")
        return json.loads(answer)

    def set(self, impairment: Impairment) -> dict[str, int]:
        """Impair the link from now on (``Impairment()``: a clean link); returns the
        counters so far."""
        return self._ask(json.dumps(asdict(impairment)))

    def counters(self) -> dict[str, int]:
        """Frames ``forwarded`` and ``dropped`` so far (both directions), and the ones
        ``lost_down`` (written to a TAP that was down)."""
        return self._ask("{}")

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()  # EOF: the shuttle exits
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._fds is not None:
            for fd in self._fds:
                os.close(fd)
            self._fds = None


class DelayLine:
    """The link's rule, frame by frame (pure: a clock is passed in): :meth:`admit` drops
    a frame with probability ``loss`` or schedules it ``delay_ms`` ± ``jitter_ms`` later,
    never before the frame admitted ahead of it for the same side; :meth:`due` hands
    back what is due, in release order."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.impairment = Impairment()
        self._queue: list[tuple[float, int, int, bytes]] = []  # (release, seq, dst, frame)
        self._last: dict[int, float] = {}  # per destination: its latest release
        self._seq = 0
        self.dropped = 0

    def admit(self, dst: int, frame: bytes, now: float) -> bool:
        """Take a frame bound for side ``dst``; False when the link drops it."""
        imp = self.impairment
        if imp.loss and self.rng.random() < imp.loss:
            self.dropped += 1
            return False
        delay = imp.delay_ms + (self.rng.uniform(-imp.jitter_ms, imp.jitter_ms)
                                if imp.jitter_ms else 0.0)
        release = max(now + delay / 1e3, self._last.get(dst, 0.0))
        self._last[dst] = release
        heapq.heappush(self._queue, (release, self._seq, dst, frame))
        self._seq += 1
        return True

    def next_release(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def due(self, now: float) -> list[tuple[int, bytes]]:
        out = []
        while self._queue and self._queue[0][0] <= now:
            _, _, dst, frame = heapq.heappop(self._queue)
            out.append((dst, frame))
        return out


def _shuttle(a: int, b: int, seed: int) -> None:
    """The shuttle process's loop: frames a <-> b, commands on stdin (module docstring)."""
    line_ = DelayLine(seed)
    other = {a: b, b: a}
    counts = {"forwarded": 0, "dropped": 0, "lost_down": 0}
    ctl = sys.stdin.fileno()
    os.set_blocking(ctl, False)
    pending = b""
    while True:
        head = line_.next_release()
        timeout = 0.5 if head is None else max(0.0, head - time.monotonic())
        ready, _, _ = select.select([a, b, ctl], [], [], timeout)
        if ctl in ready:
            chunk = os.read(ctl, 65536)
            if not chunk:
                return  # the parent closed stdin: close()
            pending += chunk
            while b"\n" in pending:
                text, pending = pending.split(b"\n", 1)
                fields = json.loads(text)
                if fields:
                    line_.impairment = Impairment(**fields)
                counts["dropped"] = line_.dropped
                sys.stdout.write(json.dumps(counts) + "\n")
                sys.stdout.flush()
        now = time.monotonic()
        for src in (a, b):
            if src not in ready:
                continue
            for _ in range(256):  # drain what is there, bounded: the other side waits too
                try:
                    frame = os.read(src, MAX_FRAME)
                except BlockingIOError:
                    break
                except OSError:  # the device is going away: do not spin on it
                    time.sleep(0.01)
                    break
                line_.admit(other[src], frame, now)
        for dst, frame in line_.due(time.monotonic()):
            try:
                os.write(dst, frame)
                counts["forwarded"] += 1
            except OSError:  # down (a cut link) or full: the frame is lost, as on a wire
                counts["lost_down"] += 1


if __name__ == "__main__":
    _shuttle(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
