"""`rasd serve` stops when it is told to, with real processes and a real Ray (issue 71).

Each test runs `rasd serve` as a supervisor would, in a process group of its own, with its own $RASD_HOME
(caches linked from the session's) and its own Ray temp folder ($RAY_TMPDIR), on free loopback ports. What
"nothing left" means is checked by pid: the processes of the Ray session the service recorded (the head's
Unix session and the pids listed in its record), never by process name (other Rays may run on this machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, free_ports, kill_session

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 900.0          # a busy 2-core machine has taken minutes to load and warm the model
LEARNT = ("cost", "kernels", "precision", "recycling")   # what a service learns and caches under $RASD_HOME
BROKEN = "(connection broken)"
PROMPT = "Count from 1 to 200, separated by commas: 1, 2, 3,"


class Service:
    """One `rasd serve` process and what it recorded."""

    def __init__(self, home: Path, ray_tmp: Path, *flags: str):
        self.home, self.ray_tmp = home, ray_tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = home / f"serve-{self.port}.out"
        self.err = home / f"serve-{self.port}.err"
        self.env = {**os.environ, "RASD_HOME": str(home), "RAY_TMPDIR": str(ray_tmp),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.flags = ["--port", str(self.port), "--max-batch", "2", *flags]
        self.proc: subprocess.Popen | None = None

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "rasd.cli", "serve", *extra]

    def start(self) -> Service:
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(self.command(*self.flags), env=self.env, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def run(self, *extra: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*extra), env=self.env, capture_output=True, text=True, timeout=timeout)

    def wait_serving(self) -> dict[str, Any]:
        """Until it prints its URL (its record then exists); the record."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if "rasd is serving" in self.out.read_text():
                return self.record()
            assert self.proc is None or self.proc.poll() is None, self.err.read_text()[-3000:]
            time.sleep(0.5)
        raise AssertionError(f"not serving after {START_TIMEOUT_S:.0f} s: {self.err.read_text()[-2000:]}")

    def record(self) -> dict[str, Any]:
        return json.loads((self.home / "run" / f"serve-{self.port}.json").read_text())

    def signal(self, sig: int) -> None:
        """As a terminal or supervisor does: to the whole process group."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def wait_exit(self, timeout_s: float) -> tuple[int, float]:
        assert self.proc is not None
        start = time.monotonic()
        code = self.proc.wait(timeout=timeout_s)
        return code, time.monotonic() - start

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def live(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def session_members(sid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def left_of(record: dict[str, Any]) -> list[int]:
    """The processes of the recorded Ray session still alive."""
    pids = set(record["ray_pids"]) | set(session_members(record["ray_head_pid"]))
    return sorted(p for p in pids if live(p))


def assert_nothing_left(record: dict[str, Any], port: int) -> None:
    deadline = time.monotonic() + 10
    while left_of(record) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_of(record) == [], f"processes of the service's Ray session remain: {left_of(record)}"
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still accepts connections"


@pytest.fixture
def places(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A $RASD_HOME of its own (the session home's caches linked in) and a short Ray temp folder."""
    shared = Path(os.environ["RASD_HOME"])
    home = tmp_path / "home"
    home.mkdir()
    real = (shared / "models").resolve().parent          # conftest links the real home's models
    for learnt in LEARNT:             # measured once (copied from the real home when it has them), then reused
        if not (shared / learnt).exists() and (real / learnt).is_dir():
            shutil.copytree(real / learnt, shared / learnt)
        (shared / learnt).mkdir(exist_ok=True)
    for entry in shared.iterdir():
        if entry.name != "run":
            (home / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    ray_tmp = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))   # Ray's socket paths have a length limit
    yield home, ray_tmp
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Whatever a failed test leaves: services killed, their Ray sessions killed by pid."""
    owned: list[Any] = []
    yield owned
    for item in owned:
        if isinstance(item, Service):
            item.kill()
            run_dir = item.home / "run"
            for path in run_dir.glob("serve-*.json") if run_dir.exists() else []:
                head = json.loads(path.read_text()).get("ray_head_pid")
                if head:
                    kill_session(head)
        elif isinstance(item, int):
            kill_session(item)


def stream(url: str, events: list[str], max_tokens: int = 64) -> None:
    """The stream's event data into `events`; a broken connection ends it with BROKEN."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "method": "ar"}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            events.append(str(response.status_code))
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
    except httpx.HTTPError:
        events.append(BROKEN)


def start_stream(url: str, events: list[str], max_tokens: int = 64) -> threading.Thread:
    """A stream in a thread; returns once its first token arrived."""
    thread = threading.Thread(target=stream, args=(url, events, max_tokens), daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while len(events) < 3 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert events[:1] == ["200"] and len(events) >= 3 and BROKEN not in events, events
    return thread


def wait_refused(url: str) -> httpx.Response:
    """Poll until the draining service refuses a new request."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = httpx.get(f"{url}/healthz", timeout=10)
        if answer.status_code == 503 and "retry-after" in answer.headers:
            return answer
        time.sleep(0.1)
    raise AssertionError("the service kept accepting requests after SIGTERM")


def test_sigterm_lets_the_running_stream_finish_then_stops_its_ray(places: tuple[Path, Path],
                                                                   cleanup: list[Any]) -> None:
    """SIGTERM with a stream in flight: new requests get 503 + Retry-After, the stream completes ([DONE]), the
    process exits 0 within the grace period, its port is closed and no process of its Ray session remains;
    no native stack dump on stderr."""
    grace = 120
    service = Service(*places, "--grace-s", str(grace))
    cleanup.append(service.start())
    record = service.wait_serving()
    assert record["mode"] == "foreground" and record["ray_owned"] and record["ray_head_pid"] in record["ray_pids"]
    assert os.getsid(record["ray_head_pid"]) == record["ray_head_pid"] != os.getsid(service.proc.pid)
    events: list[str] = []
    thread = start_stream(service.url, events)
    service.signal(signal.SIGTERM)
    signalled = time.monotonic()
    refused = wait_refused(service.url)
    assert "shutting down" in refused.json()["error"]["message"]
    thread.join(grace)
    assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2:]
    code, _ = service.wait_exit(grace + 60)
    took = time.monotonic() - signalled
    assert code == 0 and took < grace, (code, took, service.err.read_text()[-2000:])
    assert_nothing_left(record, service.port)
    err = service.err.read_text()
    assert "Aborted" not in err and "*** SIG" not in err and "Stack trace" not in err, err[-2000:]
    assert re.search(r"(\d+) of \1 requests in flight finished", err) and "cut" not in err, err[-1000:]
    assert not (service.home / "run" / f"serve-{service.port}.json").exists()


def test_a_second_sigterm_stops_at_once_without_orphans(places: tuple[Path, Path], cleanup: list[Any]) -> None:
    service = Service(*places, "--grace-s", "300")
    cleanup.append(service.start())
    record = service.wait_serving()
    events: list[str] = []
    start_stream(service.url, events, max_tokens=1000)
    service.signal(signal.SIGTERM)
    wait_refused(service.url)                        # draining: the stream would get 300 s
    service.signal(signal.SIGTERM)
    code, took = service.wait_exit(60)
    assert code == 128 + signal.SIGTERM and took < 30, (code, took)
    assert_nothing_left(record, service.port)


def test_detach_then_stop_leaves_nothing(places: tuple[Path, Path], cleanup: list[Any]) -> None:
    service = Service(*places, "--grace-s", "20")
    cleanup.append(service)
    started = service.run(*service.flags, "--detach")
    assert started.returncode == 0, started.stderr[-2000:]
    record = service.record()
    assert record["mode"] == "detached" and record["ray_owned"] and all(live(p) for p in record["ray_pids"])
    assert httpx.get(f"{service.url}/healthz", timeout=30).status_code == 200
    stopped = service.run("--stop", timeout=300)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert f"stopped rasd at {service.url}" in stopped.stdout and "stopped its Ray" in stopped.stdout
    assert_nothing_left(record, service.port)
    again = service.run("--stop", timeout=120)
    assert again.returncode == 0 and again.stdout.strip().startswith("no rasd service is running")
    assert len(again.stdout.strip().splitlines()) == 1


def test_stop_leaves_a_ray_the_operator_started_running(places: tuple[Path, Path], cleanup: list[Any]) -> None:
    """`--address` an operator's Ray: `--stop` removes rasd's application and leaves that Ray (and its other
    processes) up; the test then stops that Ray itself, by its session."""
    home, ray_tmp = places
    ray_cli = str(Path(sys.executable).parent / "ray")
    gcs, client, agent, agent_grpc, rt_env, metrics, objm, nodem = free_ports(8)
    auth = "token" if Path.home().joinpath(".ray", "auth_token").exists() else "disabled"   # as `ray start` picks
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": auth}
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
         f"--port={gcs}", f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={rt_env}",
         f"--metrics-export-port={metrics}", f"--object-manager-port={objm}", f"--node-manager-port={nodem}"],
        env=env, stdout=open(home / "operator-ray.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    cleanup.append(head.pid)
    deadline = time.monotonic() + 180
    while "Ray runtime started" not in (home / "operator-ray.log").read_text() and time.monotonic() < deadline:
        assert head.poll() is None, (home / "operator-ray.log").read_text()[-2000:]
        time.sleep(0.5)
    service = Service(home, ray_tmp, "--grace-s", "20", "--address", f"127.0.0.1:{gcs}")
    service.env["RAY_AUTH_MODE"] = auth          # a driver given an address needs to be told (Ray's rule)
    cleanup.append(service)
    started = service.run(*service.flags, "--detach")
    assert started.returncode == 0, started.stderr[-2000:]
    record = service.record()
    assert not record["ray_owned"] and record["ray_pids"] == []
    stopped = service.run("--stop", timeout=300)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert f"left the Ray at 127.0.0.1:{gcs} running" in stopped.stdout, stopped.stdout
    assert head.poll() is None and live(head.pid)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", gcs)) == 0, "the operator's GCS is down"
    apps = subprocess.run([sys.executable, "-c", APPS, f"127.0.0.1:{gcs}"], env={**env, **service.env},
                          capture_output=True, text=True, timeout=300)
    assert apps.returncode == 0 and json.loads(apps.stdout.strip().splitlines()[-1]) == [], apps.stderr[-2000:]
    kill_session(head.pid)
    head.wait(timeout=30)


# the applications on a Ray, listed by a driver of its own
APPS = """
import json, sys
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(json.dumps(sorted(serve.status().applications)))
"""
