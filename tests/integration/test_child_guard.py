"""cluster.child: launched children exec in place and die with their launcher, without
the fork() that a preexec function costs next to gRPC (see the module)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cluster_helpers import assert_dies_with_launcher

from cluster.child import guarded

ROOT = Path(__file__).resolve().parents[2]


def test_the_command_runs_in_place_with_its_exit_status() -> None:
    p = subprocess.run(guarded([sys.executable, "-c",
                                "import os, sys; print(os.getpid()); sys.exit(7)"]),
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 7, p.stderr
    proc = subprocess.Popen(guarded([sys.executable, "-c", "import os; print(os.getpid())"]),
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    out, _ = proc.communicate(timeout=60)
    assert int(out) == proc.pid  # exec'd in place: signals and status are the command's


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_a_child_gets_sigterm_when_its_launcher_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    launcher = textwrap.dedent(f"""
        import subprocess, sys, time
        from cluster.child import guarded
        p = subprocess.Popen(guarded([sys.executable, "-c",
            "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(120)"]))
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", launcher], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        assert_dies_with_launcher(parent, int(pid_file.read_text()), 10)
    finally:
        parent.kill()

