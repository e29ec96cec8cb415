"""How `rasd serve` stops: on SIGTERM/SIGINT in the foreground, and `rasd serve --stop` for a detached one.

The order is the same on every path: the ingress drains (`serve.drain`: new requests 503, running ones get
`--grace-s`, the rest an error), then Serve is shut down, then the Ray this command started is stopped by its
session's pids (`serve.ray_head`). A Ray rasd joined is left running: only rasd's application is removed.

A running service is recorded under `$RASD_HOME/run/serve-<port>.json` (`ServiceRecord`): its URL, the Ray's
address, session folder and auth mode, whether rasd started that Ray, and the pids of that Ray's session.
`--stop` reads these records and never guesses (`ray.init(address="auto")` found another Ray, or none).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rasd.fsio import write_json_atomic
from rasd.paths import rasd_home
from rasd.serve.ray_head import (
    RayHead,
    enable_default_token_auth,
    is_running,
    reachable,
    session_pids,
    stop_session,
)

APP_NAME = "rasd"
DEFAULT_GRACE_S = 30.0
SERVE_SHUTDOWN_S = 30.0       # Serve's own shutdown waits for its replicas; past this the Ray is stopped anyway
EXTRA_DRAIN_S = 15.0          # a drain call's bound beyond the grace period (abort wait, handle round trips)


def runs_dir() -> Path:
    """Where running services are recorded: `$RASD_HOME/run/`."""
    return rasd_home() / "run"


@dataclass
class ServiceRecord:
    """What `--stop` needs to find and stop a service, written once it serves (removed when it stops)."""

    url: str
    port: int
    mode: str                              # "detached" or "foreground"
    ray_address: str
    ray_owned: bool                        # started by rasd (then stopped with the service), else joined
    pid: int = 0                           # the `rasd serve` process of a foreground service
    ray_head_pid: int = 0                  # `ray start --block`, and the session id of the Ray's processes
    ray_session_dir: str = ""
    ray_auth_mode: str | None = None       # RAY_AUTH_MODE the service's driver ran with (token auth)
    single_machine: bool = True
    ray_pids: list[int] = field(default_factory=list)
    started: float = 0.0

    @property
    def path(self) -> Path:
        return runs_dir() / f"serve-{self.port}.json"

    def save(self) -> None:
        write_json_atomic(self.path, asdict(self))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def head(self) -> RayHead:
        return RayHead(pid=self.ray_head_pid, address=self.ray_address, log="")


def records() -> list[ServiceRecord]:
    """The recorded services, joined Rays first (stopping an owned Ray first would take a joined app with it)."""
    found = []
    for path in sorted(runs_dir().glob("serve-*.json")):
        try:
            found.append(ServiceRecord(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError) as exc:
            print(f"rasd: ignoring unreadable record {path}: {exc}", file=sys.stderr)
    return sorted(found, key=lambda r: r.ray_owned)


# ---------------------------------------------------------------------------------------------- signals


class StopRequested(BaseException):
    """Raised by the first signal while the service is still starting (nothing to drain yet)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """SIGTERM and SIGINT of a foreground `rasd serve`: the first stops it in order (while starting: at once, as
    `StopRequested`; while serving: `requested` is set and the main thread drains); a second one calls
    `force(signum)`, which must not return. Installed again after `ray.init`, which sets its own."""

    def __init__(self, force: Any):
        self.force = force
        self.requested = threading.Event()
        self.signum = 0
        self.serving = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested.is_set():
            self.force(signum)
            return
        self.signum = signum
        self.requested.set()
        if not self.serving:
            raise StopRequested(signum)


# ---------------------------------------------------------------------------------------------- stopping


def bounded(fn: Any, timeout_s: float) -> tuple[bool, Any]:
    """Run `fn` on a daemon thread: (True, its result) when it returned in time, (False, None) otherwise or when it
    raised (the error printed). The main thread waits in short slices, so a second signal is handled at once."""
    done, result = threading.Event(), []

    def run() -> None:
        try:
            result.append(fn())
        except Exception as exc:    # noqa: BLE001 - reported; the caller goes on stopping either way
            print(f"rasd: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="rasd-stop").start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(0.2) and time.monotonic() < deadline:
        pass
    return (bool(result), result[0] if result else None)


def drain_app(grace_s: float) -> dict[str, int] | None:
    """Ask rasd's ingress to drain (`RasdIngress.drain`); None when it did not answer in time."""
    from ray import serve

    def call() -> Any:
        return serve.get_app_handle(APP_NAME).drain.remote(grace_s).result(timeout_s=grace_s + EXTRA_DRAIN_S)

    ok, outcome = bounded(call, grace_s + EXTRA_DRAIN_S)
    return outcome if ok else None


def drain_summary(outcome: dict[str, int] | None, grace_s: float) -> str:
    if outcome is None:
        return "the ingress did not answer the drain; its requests end with Serve"
    if not outcome["in_flight"]:
        return "no request was in flight"
    cut = f", {outcome['cut']} cut after {grace_s:g} s with an error" if outcome["cut"] else ""
    return f"{outcome['finished']} of {outcome['in_flight']} requests in flight finished{cut}"


def remove_app(owned: bool) -> None:
    """Serve down on a Ray rasd started; on a joined Ray only rasd's application (others may serve there)."""
    import ray
    from ray import serve

    if owned:
        ok, _ = bounded(serve.shutdown, SERVE_SHUTDOWN_S)
        if not ok:
            print(f"rasd: Serve did not shut down within {SERVE_SHUTDOWN_S:.0f} s; stopping its Ray",
                  file=sys.stderr)
    else:
        bounded(lambda: serve.delete(APP_NAME), SERVE_SHUTDOWN_S)
    bounded(ray.shutdown, 10.0)


def stop_head(head: RayHead | None, force: bool = False) -> str:
    """Stop the Ray this command started (none: a joined Ray, left running); what was done, in words."""
    if head is None:
        return ""
    count = stop_session(head, force=force)
    return f"stopped its Ray ({head.address}, {count} processes)"


def force_exit(head: RayHead | None, connected: bool, signum: int) -> None:
    """A second signal: stop at once, still leaving no process behind (the started Ray's session is killed; on
    a joined Ray, rasd's application is removed without waiting for it). Exits 128 + the signal's number."""
    print(f"\nrasd: {signal.Signals(signum).name} again: stopping at once", file=sys.stderr, flush=True)
    if head is not None:
        stop_session(head, force=True)
    elif connected:
        from ray import serve

        bounded(lambda: serve.delete(APP_NAME, _blocking=False), 3.0)
    for record in records():
        if record.mode == "foreground" and record.pid == os.getpid():
            record.remove()
    os._exit(128 + signum)


# ---------------------------------------------------------------------------------------------- --stop


def stop_recorded(grace_s: float = DEFAULT_GRACE_S) -> int:
    """`rasd serve --stop`: stop every recorded service, saying what was stopped; nothing recorded: one line."""
    found = records()
    if not found:
        print(f"no rasd service is running (none recorded under {runs_dir()})")
        return 0
    for record in found:
        print(stop_one(record, grace_s), flush=True)
    return 0


def stop_one(record: ServiceRecord, grace_s: float) -> str:
    """Stop one recorded service; one line saying what was stopped."""
    if record.mode == "foreground" and is_running(record.pid) and _is_rasd(record.pid):
        return stop_foreground(record, grace_s)
    where = f"rasd at {record.url}"               # detached, or a foreground one killed without its clean-up
    head = record.head() if record.ray_owned else None
    if head is not None and not head.alive():
        left = session_pids(head.pid)
        stop_session(head, force=True)
        record.remove()
        return f"{where}: its Ray (pid {head.pid}) was no longer running; {len(left)} leftover processes stopped"
    if not reachable(record.ray_address):
        record.remove()
        return f"{where}: the Ray at {record.ray_address} does not answer; nothing to stop (record removed)"
    if not connect(record):
        return f"{where}: could not join its Ray at {record.ray_address}; left as it is (record kept)"
    summary = drain_summary(drain_app(grace_s), grace_s)
    remove_app(record.ray_owned)
    done = stop_head(head) if head is not None else f"left the Ray at {record.ray_address} running (rasd joined it)"
    record.remove()
    return f"stopped {where}: {summary}; {done}"


def connect(record: ServiceRecord) -> bool:
    """Join the recorded Ray as a driver, with the auth mode and single-machine mode the service ran with."""
    import ray

    from rasd.serve.loopback import single_machine_ray

    if record.ray_auth_mode == "token":
        enable_default_token_auth()
    if record.single_machine:
        single_machine_ray()
    ok, _ = bounded(lambda: ray.init(address=record.ray_address, log_to_driver=False, logging_level="ERROR"), 60.0)
    return ok


def stop_foreground(record: ServiceRecord, grace_s: float) -> str:
    """A foreground service stops itself on SIGTERM (drain, Serve, its Ray): send it and wait for it to exit."""
    where = f"rasd at {record.url} (pid {record.pid})"
    os.kill(record.pid, signal.SIGTERM)
    wait_s = grace_s + SERVE_SHUTDOWN_S + EXTRA_DRAIN_S
    deadline = time.monotonic() + wait_s
    while is_running(record.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if is_running(record.pid):
        return f"{where}: sent SIGTERM; still stopping after {wait_s:.0f} s"
    return f"stopped {where}: it drained and stopped its own Ray"


def _is_rasd(pid: int) -> bool:
    """Whether `pid` is still a `rasd serve` process (not an unrelated one that reuses the pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"rasd" in a for a in argv) and b"serve" in argv
