"""`rasd serve --stop` without a running service (no Ray needed): nothing recorded is one line and exit 0; a
record whose processes are gone is removed, and what is left of its Ray session is stopped, by pid."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from rasd.cli import main
from rasd.serve.lifecycle import ServiceRecord, records, runs_dir
from rasd.serve.ray_head import session_pids


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RASD_HOME", str(tmp_path))
    return tmp_path


def test_stop_against_nothing_says_so_in_one_line(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--stop"]) == 0
    out = capsys.readouterr()
    assert out.out.strip().startswith("no rasd service is running") and len(out.out.strip().splitlines()) == 1
    assert out.err == ""


def test_negative_grace_is_a_one_line_error(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--stop", "--grace-s", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "rasd: error: --grace-s must be >= 0 (got -1)"


def test_a_record_whose_ray_died_is_cleaned_up_by_pid(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The head (`ray start --block`) is gone but a process of its session is left (as after a SIGKILL): --stop
    stops that one, by its session, and removes the record."""
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen("
                               "[sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(0.5)"],
                              start_new_session=True)
    leader.wait(timeout=30)                                 # the "head" exits, its child stays in the session
    deadline = time.monotonic() + 10
    while not session_pids(leader.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    (orphan,) = session_pids(leader.pid)
    ServiceRecord(url="http://127.0.0.1:1", port=1, mode="detached", ray_address="127.0.0.1:1", ray_owned=True,
                  ray_head_pid=leader.pid, ray_pids=[leader.pid, orphan]).save()
    assert [r.port for r in records()] == [1]
    assert main(["serve", "--stop"]) == 0
    out = capsys.readouterr().out
    assert "was no longer running; 1 leftover processes stopped" in out, out
    assert session_pids(leader.pid) == [] and list(runs_dir().iterdir()) == []
