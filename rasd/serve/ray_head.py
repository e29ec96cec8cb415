"""The Ray that `rasd serve` starts for itself, and how it is found and stopped again.

Why its own Unix session: `ray start --head --block` runs in a new session (`start_new_session`), so every
process of that Ray (GCS, raylet, agents, the Serve controller, proxy and replicas) carries the head's pid as
its session id. A signal sent to `rasd serve`'s process group (Ctrl+C, a supervisor) then reaches `rasd serve`
alone, which drains and stops the Ray in order, and stopping that Ray means stopping the processes of that one
session, by pid: never a Ray found by process name (`ray stop` stops every Ray of the machine).

A Ray rasd joined (`--address`, or one already running here) is never stopped: rasd removes only its own
application from it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rasd.errors import CliError

HEAD_READY = "Ray runtime started"      # what `ray start` prints once GCS, raylet and agents are up
HEAD_START_TIMEOUT_S = 120.0
HEAD_STOP_TIMEOUT_S = 20.0              # the head's own teardown (SIGTERM to `ray start --block`)
KILL_WAIT_S = 5.0                       # then each straggler gets SIGTERM, and SIGKILL after this


@dataclass
class RayHead:
    """A head this command started: `pid` is the `ray start --block` process and the session id of all its
    processes; `address` the GCS's host:port; `log` where `ray start` writes."""

    pid: int
    address: str
    log: str
    process: subprocess.Popen | None = None     # only in the process that started it

    def alive(self) -> bool:
        return is_running(self.pid)


def ray_cli() -> str:
    """The `ray` command of this environment (the venv may not be on PATH)."""
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else "ray"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` now (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_args(loopback: bool) -> list[str]:
    """Free ports for every server of a single-machine head, so that it never collides with another Ray on
    this machine (Ray's defaults are fixed: GCS 6379, client 10001, agent 52365); a head other nodes join keeps
    Ray's defaults, which they expect."""
    if not loopback:
        return []
    names = ("port", "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "runtime-env-agent-port", "metrics-export-port", "object-manager-port", "node-manager-port")
    return [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)), strict=True)]


def start_head(args: list[str], env: dict[str, str], log: Path, timeout_s: float = HEAD_START_TIMEOUT_S) -> RayHead:
    """`ray <args> --block` in a session of its own; returns once Ray says it runs (a one-line CliError with the
    end of its log otherwise, the partial head stopped)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen([ray_cli(), *args, "--block"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    head = RayHead(pid=process.pid, address="", log=str(log), process=process)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if HEAD_READY in log.read_text(errors="replace"):
                head.address = gcs_address(args)
                return head
            if process.poll() is not None:
                break
            time.sleep(0.2)
    except BaseException:              # a signal while it starts: no half-started Ray left behind
        stop_session(head, force=True)
        raise
    stop_session(head)
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    raise CliError(f"could not start a local Ray ({'it exited' if process.poll() is not None else 'timed out'}): "
                   f"{tail[0].strip() if tail else 'no output'} (log: {log})")


def gcs_address(args: list[str]) -> str:
    """The GCS address of a head started with `args`: its `--node-ip-address` and `--port` (Ray's 6379 when
    not given)."""
    options = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
    return f"{options.get('node-ip-address', '127.0.0.1')}:{options.get('port', '6379')}"


def running_local_ray() -> str | None:
    """The address of the Ray already running on this machine that `ray.init(address="auto")` would join: the
    one named in Ray's temp folder (`$RAY_TMPDIR/ray`, else /tmp/ray), when its GCS answers; None otherwise."""
    from ray._common.utils import get_ray_address_file

    try:
        address = Path(get_ray_address_file(None)).read_text().strip()
    except OSError:
        return None
    return address if address and reachable(address) else None


def reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at host:port (a GCS that is up)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def enable_default_token_auth() -> None:
    """Token auth for this driver when a token exists (~/.ray/auth_token, RAY_AUTH_TOKEN_PATH), as `ray start`
    decides for a head, unless RAY_AUTH_MODE says otherwise. Why: a driver given an explicit address never turns
    it on by itself and is refused by such a head; and setting RAY_AUTH_MODE after Ray is imported is not
    enough (Ray's config is read then), which Ray's own function takes care of."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:          # a Ray without token auth
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


# ---------------------------------------------------------------------------------------------- processes


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def session_pids(sid: int) -> list[int]:
    """The live processes whose session id is `sid` (all processes of a head started in its own session)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):   # fields: state, ppid, pgrp, session
            pids.append(int(entry.name))
    return pids


def stop_session(head: RayHead, timeout_s: float = HEAD_STOP_TIMEOUT_S, force: bool = False) -> int:
    """Stop every process of `head`'s session; returns how many there were.

    First SIGTERM to `ray start --block` alone: Ray's own teardown stops its processes in order (rasd has
    already drained and shut Serve down; the head runs with RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0). Then any
    straggler gets SIGTERM, and SIGKILL after `KILL_WAIT_S`. `force` (a second signal) skips the teardown."""
    found = set(session_pids(head.pid)) | ({head.pid} if head.alive() else set())
    if not force and head.alive():
        _signal([head.pid], signal.SIGTERM)
        _wait_empty(head, timeout_s)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = session_pids(head.pid)
        if not left:
            break
        found.update(left)
        _signal(left, sig)
        _wait_empty(head, KILL_WAIT_S)
    if head.process is not None:
        try:
            head.process.wait(timeout=KILL_WAIT_S)   # reap it: our child in the foreground
        except subprocess.TimeoutExpired:
            pass
    return len(found)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_empty(head: RayHead, timeout_s: float) -> None:
    """Wait (bounded) until no live process of the head's session remains."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.process is not None:
            head.process.poll()                      # reap the head if it exited
        if not session_pids(head.pid):
            return
        time.sleep(0.1)
