"""A verifier actor that is alive but stuck (SIGSTOP) on a real local Ray + Serve with the embedded model.

Such an actor raises nothing: without deadlines its requests wait forever and /healthz says ok. Two replicas,
each decoding in its own `TargetVerifier` (`verifier_actor`), so that one verifier can be stopped while the
other replica keeps streaming. The stopped process is always continued (SIGCONT) in a `finally`, and only the
verifier of this module's own app is ever stopped (its PID looked up by the name its replica reports).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import DOCS, KEY, free_port

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow
APP = "rasd-hung-verifier-test"
HANG_S = 4.0            # the app's verifier_timeout_s: a verifier silent this long is hung
BOUND_S = 30.0          # what "within a bounded time" means here (detection + a loaded 2-core machine)
NO_EOS = {"0": -100, "2": -100}      # SmolLM2's <|endoftext|> and <|im_end|>: a held stream never ends early
HOLD = {"max_tokens": 1000, "temperature": 0, "method": "ar", "stream": True, "logit_bias": NO_EOS}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[dict]:
    """Our own app: two replicas of one thread, each with its verifier actor (beside the session app when that
    one already holds Ray)."""
    import ray
    from ray import serve

    from rasd.index import Document, build_index
    from rasd.serve.app import build_app

    index = tmp_path_factory.mktemp("hung") / "index"
    build_index([Document(text=t, source=f"test:{title}", title=title) for title, t in DOCS], index)
    config = {"index": str(index), "api_key": KEY, "replicas": 2, "threads": 1, "verifier_actor": True,
              "max_batch": 4, "max_waiting": 4, "max_tokens_limit": 1024, "warm_methods": False,
              "verifier_timeout_s": HANG_S, "router": {"imbalance": 0}}
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url, prefix = f"http://127.0.0.1:{port}", "/"
    else:
        shared = request.getfixturevalue("service")
        url, prefix = f"{shared['url']}/hung", "/hung"
    serve.run(build_app(config), name=APP, route_prefix=prefix)
    yield {"url": url}
    if owns_ray:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP)


def client(url: str, timeout: float = 60.0) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout)


class Stream(threading.Thread):
    """A streamed completion read on its own thread: its replica, each event with its arrival time, and how
    it ended (closing it early cancels the request)."""

    def __init__(self, url: str, prompt: str):
        super().__init__(daemon=True)
        self.url, self.body = url, {**HOLD, "prompt": prompt}
        self.started, self.ended, self.close = threading.Event(), threading.Event(), threading.Event()
        self.replica: str | None = None
        self.events: list[tuple[float, str]] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            with client(self.url, timeout=BOUND_S * 4) as c, c.stream("POST", "/v1/completions", json=self.body) as s:
                self.replica = s.headers.get("x-rasd-replica")
                self.started.set()
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[6:]))
                    if self.close.is_set():
                        break
        except Exception as exc:   # noqa: BLE001 - reported by the test
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()
            self.ended.set()

    def wait_tokens(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.events) < n and not self.ended.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.events) >= n, (self.error, self.events[-2:])

    def stop(self) -> None:
        self.close.set()
        self.join(BOUND_S * 4)

    def gaps(self, since: float, until: float) -> list[float]:
        times = [t for t, _ in self.events if since <= t <= until]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


def verifier_pid(url: str, replica: str) -> int:
    """The process of the verifier actor of `replica` (the name its replica reports, found in our own Ray)."""
    from rasd.eval.fault import alive_actors

    with client(url) as c:
        rows = c.get("/healthz").json()["replicas"]
    name = next(r["verifier"] for r in rows if r["replica"] == replica)
    assert name and name.startswith("rasd-verifier-"), rows
    (actor,) = [a for a in alive_actors() if a.name == name]
    assert actor.pid > 0 and actor.pid != os.getpid()
    return actor.pid


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[float]:
    """The process stopped (SIGSTOP: alive to Ray, answering nothing) and always continued afterwards."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_health(url: str, status: int, timeout_s: float = BOUND_S) -> dict[str, Any]:
    """/healthz's body once it answers `status` (bounded)."""
    deadline = time.monotonic() + timeout_s
    with client(url, timeout=10) as c:
        while True:
            r = c.get("/healthz")
            if r.status_code == status or time.monotonic() > deadline:
                assert r.status_code == status, r.text
                return r.json()
            time.sleep(0.25)


def hammer(url: str, count: int = 100, rate: float = 20.0) -> list[tuple[int | None, float]]:
    """`count` GET /healthz at `rate` a second, each on its own thread (a slow answer does not slow the rate):
    (status, seconds) per request, status None when it failed or took over 10 s."""
    from concurrent.futures import ThreadPoolExecutor

    def one(c: httpx.Client, at: float) -> tuple[int | None, float]:
        time.sleep(max(0.0, at - time.monotonic()))
        sent = time.monotonic()
        try:
            return c.get("/healthz").status_code, time.monotonic() - sent
        except httpx.HTTPError:
            return None, time.monotonic() - sent

    start = time.monotonic()
    with client(url, timeout=10) as c, ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(lambda i: one(c, start + i / rate), range(count)))


def complete(url: str, prompt: str) -> httpx.Response:
    with client(url, timeout=BOUND_S * 4) as c:
        return c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "method": "ar"})


def test_a_stopped_verifier_fails_its_requests_fast_and_serves_again_once_continued(app: dict[str, Any]) -> None:
    """In-flight: an error event and no [DONE]; new requests: 503; /healthz: 503 naming the verifier, all within
    a bounded time; after SIGCONT /healthz is 200 and a request to that replica completes."""
    url = app["url"]
    prompt = "Count from one to a thousand in words: one, two, three,"
    held = Stream(url, prompt)
    held.start()
    assert held.started.wait(120) and held.replica, held.error
    held.wait_tokens(3)
    pid = verifier_pid(url, held.replica)
    try:
        with stopped(pid) as t0:
            assert held.ended.wait(BOUND_S), "a stream on a stopped verifier never ended"
            assert time.monotonic() - t0 < BOUND_S
            last = json.loads(held.events[-1][1])
            assert last["error"]["code"] == 503 and "verifier" in last["error"]["message"], last
            assert all(data != "[DONE]" for _, data in held.events)
            body = wait_health(url, 503)
            assert "verifier" in body["problem"] and body["status"] == "unhealthy", body
            start = time.monotonic()
            again = complete(url, prompt + " four")   # routed by its prefix to the stopped verifier's replica
            assert again.status_code == 503, again.text
            assert "verifier" in again.json()["error"]["message"]
            assert time.monotonic() - start < 10.0, "a new request must be refused at once, not after a deadline"
    finally:
        held.stop()
    wait_health(url, 200, timeout_s=60)
    ok = complete(url, prompt + " four")
    assert ok.status_code == 200 and ok.headers["x-rasd-replica"] == held.replica, ok.text


def test_health_answers_at_once_and_other_streams_keep_their_pace_while_a_verifier_is_stopped(
        app: dict[str, Any]) -> None:
    """20 /healthz a second for 5 s with one verifier stopped: each answers 503 within 2 s (the replica reads
    its verifier's last answer, never waits on it), and a stream on the other replica keeps its gaps under
    0.5 s (on a machine so busy that its gaps before the stop were longer: under twice those)."""
    url = app["url"]
    stream = Stream(url, "Write the numbers from one to a thousand, one per line:\n1\n2\n3\n")
    stream.start()
    assert stream.started.wait(120) and stream.replica, stream.error
    stream.wait_tokens(3)
    before = time.monotonic()
    stream.wait_tokens(len(stream.events) + 30)
    pace = stream.gaps(before, time.monotonic())
    with client(url) as c:
        rows = c.get("/healthz").json()["replicas"]
    other = next(r["replica"] for r in rows if r["replica"] != stream.replica)
    try:
        with stopped(verifier_pid(url, other)):
            with contextlib.suppress(AssertionError):   # judged below, with the answers under load
                wait_health(url, 503)
            start = time.monotonic()
            answers = hammer(url)
            end = time.monotonic()
            assert not stream.ended.is_set(), (stream.error, stream.events[-2:])
            gaps = stream.gaps(start, end)
            for path in ("/v1/info", "/metrics"):
                sent = time.monotonic()
                with client(url, timeout=10) as c:
                    assert c.get(path).status_code == 200, path
                assert time.monotonic() - sent < 2.0, path
    finally:
        stream.stop()
    wait_health(url, 200, timeout_s=60)
    assert max(latency for _, latency in answers) < 2.0, sorted(answers, key=lambda a: a[1])[-5:]
    assert {status for status, _ in answers} == {503}, answers
    assert len(gaps) >= 5 and max(gaps) < max(0.5, 2 * max(pace)), (sorted(gaps)[-5:], sorted(pace)[-5:])


def test_the_fault_drill_stops_a_verifier_and_finds_no_hang_and_no_wrong_token(app: dict[str, Any]) -> None:
    """`rasd fault --phases hung` against this app: the stopped verifier's requests end with a clear 503, the
    other replica's complete with the fault-free answers, nothing hangs, /healthz saw it and recovers."""
    from rasd.eval.fault import FaultConfig, format_fault_table, run_fault

    questions = ["Who designed the Forth Bridge and when did it open?", "How do glaciers form?"]
    cfg = FaultConfig(url=app["url"], api_key=KEY, app=APP, phases=["hung"], questions=questions, concurrency=2,
                      params={"max_tokens": 8, "method": "rasd", "top_k_sources": 1, "temperature": 0},
                      docs_per_phase=0, request_timeout_s=90, phase_timeout_s=120, accept_wait_s=10,
                      hang_s=2 * HANG_S)
    summary = run_fault(cfg)
    print(format_fault_table(summary))
    (p,) = summary["phases"]
    assert not p["skipped"] and p["kill"].startswith("SIGSTOP"), p["notes"]
    assert p["hung"] == 0 and p["wrong"] == 0 and p["unclear_errors"] == 0 and p["not_sent"] == 0, p["notes"]
    assert p["completed"] + p["clear_errors"] == len(questions), p["notes"]
    assert p["detected_s"] is not None and p["healthz_back_s"] is not None, p["notes"]
    assert p["stream"]["outcome"] in ("ok", "error") and not p["stream"]["wrong"], p["stream"]
    assert p["stream"]["max_gap_s"] < cfg.hang_s + BOUND_S, p["stream"]
    assert summary["violations"] == []
