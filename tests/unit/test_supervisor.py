"""The process launcher's restart rule (cluster.supervisor), on a virtual clock, with
short real processes (``sys.executable -c``) as the components."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from cluster.supervisor import GaveUp, RestartPolicy, Supervisor, exit_text, log_tail


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def _exits(code: int) -> subprocess.Popen:
    p = _proc(f"raise SystemExit({code})")
    p.wait()
    return p


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(first_backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_dead_component_is_restarted_after_its_backoff_and_counted() -> None:
    clock, started = Clock(), []

    def start() -> subprocess.Popen:
        started.append(clock.now)
        return _exits(3) if len(started) == 1 else _proc("import time; time.sleep(30)")

    sup = Supervisor(RestartPolicy(first_backoff_s=2.0), clock=clock, on_event=lambda e: None)
    c = sup.add("decode-0", start)
    try:
        assert sup.poll() == ["decode-0 exited (exit status 3); restarting it in 2.0 s"]
        clock.now = 1.9
        assert sup.poll() == [] and len(started) == 1  # still backing off
        clock.now = 2.0
        [event] = sup.poll()
        assert event.startswith("decode-0 restarted (restart 1, pid ")
        assert c.restarts == 1 and c.last_exit == 3 and started == [0.0, 2.0]
        assert sup.poll() == []  # running
    finally:
        sup.stop(grace=5)
    assert c.proc is not None and c.proc.returncode == -signal.SIGINT
    assert sup.poll() == []  # stopped on purpose: nothing restarts


def test_a_component_that_keeps_dying_is_given_up_with_its_log(tmp_path) -> None:
    log = tmp_path / "router.log"
    log.write_text("Traceback ...\nValueError: bad --policy\n")
    clock = Clock()
    sup = Supervisor(RestartPolicy(first_backoff_s=1.0, max_backoff_s=1.0, max_restarts=2,
                                   window_s=60.0), clock=clock, on_event=lambda e: None)
    sup.add("router", lambda: _exits(2), str(log))
    for t in (0.0, 1.0, 2.0, 3.0):  # exit, restart, exit, restart
        clock.now = t
        sup.poll()
    clock.now = 4.0
    with pytest.raises(GaveUp) as e:
        sup.poll()  # the third exit within 60 s
    assert e.value.name == "router"
    assert "router exited (exit status 2) 3 times within 60 s" in str(e.value)
    assert "ValueError: bad --policy" in str(e.value)


def test_exits_spread_beyond_the_window_never_give_up() -> None:
    clock = Clock()
    sup = Supervisor(RestartPolicy(first_backoff_s=1.0, max_restarts=1, window_s=10.0),
                     clock=clock, on_event=lambda e: None)
    c = sup.add("prefill-0", lambda: _exits(1))
    for i in range(5):  # one death every 20 s: restarted forever
        clock.now = 20.0 * i
        sup.poll()
        clock.now += 1.0
        sup.poll()
    assert c.restarts == 5


def test_exit_text_and_log_tail(tmp_path) -> None:
    assert exit_text(-9) == "SIGKILL" and exit_text(1) == "exit status 1"
    assert exit_text(None) == "running"
    log = tmp_path / "x.log"
    log.write_text("a" * 5000 + "the end")
    assert log_tail(str(log), 10) == ":\naaathe end"
    assert log_tail(None) == "" and log_tail(str(tmp_path / "missing")) == ""
