"""Two model replicas behind one endpoint, on a real local Ray + Serve with the embedded model.

The prefix-aware router sends a chat's next turn and a repeated question to the replica that served the
first (`X-Rasd-Replica`, and its hits in `/metrics`); an ingest through one replica is retrieved by requests
that the other serves; both answer exactly as the in-process engine. To have a request served by the other
replica, the test holds a long stream open on the one that served it (router option imbalance 0: a
replica with a request more than the least loaded one is skipped).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import DOCS, KEY, free_port

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow
APP = "rasd-replicas-test"
HOLD = {"max_tokens": 1000, "temperature": 0, "method": "ar", "stream": True}
HOLD_TAIL = "\nNow count from one to a thousand in words: one, two, three,"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[dict]:
    """Our own app with two replicas of one thread each (beside the session app when that one holds Ray)."""
    import ray
    from ray import serve

    from rasd.index import Document, build_index
    from rasd.serve.app import build_app

    index = tmp_path_factory.mktemp("replicas") / "index"
    build_index([Document(text=t, source=f"test:{title}", title=title) for title, t in DOCS], index)
    config = {"index": str(index), "api_key": KEY, "replicas": 2, "threads": 1, "max_batch": 4,
              "max_waiting": 4, "max_tokens_limit": 1024, "warm_methods": False,
              "router": {"imbalance": 0}}          # a replica with a request in flight counts as busy
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url, prefix, cpus = f"http://127.0.0.1:{port}", "/", 1
    else:
        shared = request.getfixturevalue("service")
        url, prefix, cpus = f"{shared['url']}/replicas", "/replicas", 0
    serve.run(build_app(config, replica_cpus=cpus), name=APP, route_prefix=prefix)
    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    yield {"client": client, "url": url, "index": index}
    client.close()
    if owns_ray:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP)


@contextlib.contextmanager
def busy(client: httpx.Client, prompt: str) -> Iterator[str]:
    """A long stream held open (yields the replica serving it); closing it cancels the request there.
    Routed like any prompt: to the replica that served its prefix, else to the least loaded."""
    stop, started = threading.Event(), threading.Event()
    held: dict[str, Any] = {}

    def hold() -> None:
        with client.stream("POST", "/v1/completions", json={**HOLD, "prompt": prompt + HOLD_TAIL}) as s:
            held["replica"] = s.headers.get("x-rasd-replica")
            started.set()
            for _ in s.iter_lines():
                if stop.is_set():
                    break

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert started.wait(120), "the holding stream never started"
    try:
        yield held["replica"]
    finally:
        stop.set()
        thread.join(120)
    # the client left: the ingress cancels the replica's generator, and the request leaves the batch
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (client.get("/healthz").json()["running"]
                                           or sum(_router_in_flight(client).values())):
        time.sleep(0.5)
    assert client.get("/healthz").json()["running"] == 0, "a stream whose client left kept decoding"
    assert sum(_router_in_flight(client).values()) == 0, "the router still counts a closed stream in flight"


def on_both(client: httpx.Client, path: str, body: dict[str, Any], route: str) -> dict[str, dict[str, Any]]:
    """`body` answered by each replica: first wherever the router sends it, then again with that replica
    held busy (a stream whose prompt extends `route`, so it lands there), which sends it to the other."""
    first, answer = _post(client, path, body)
    with busy(client, route) as held:
        assert held == first, "a prompt extending the first one is routed to where the first was served"
        second, again = _post(client, path, body)
    assert second != first
    return {first: answer, second: again}


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-rasd-replica"], r.json()


def _router_samples(client: httpx.Client, name: str, label: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    return {s.labels[label]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def _router_hits(client: httpx.Client) -> dict[str, float]:
    return _router_samples(client, "rasd:router_requests_total", "outcome")


def _router_in_flight(client: httpx.Client) -> dict[str, float]:
    return _router_samples(client, "rasd:router_requests_in_flight", "replica")


def test_health_lists_both_replicas(replicas: dict[str, Any]) -> None:
    body = replicas["client"].get("/healthz").json()
    assert body["status"] == "ok" and body["auth"] is True
    assert len({r["replica"] for r in body["replicas"]}) == 2, body
    assert replicas["client"].get("/v1/info").json()["replicas"] == 2


def test_a_chats_next_turn_and_a_repeated_question_stay_on_their_replica(replicas: dict[str, Any]) -> None:
    c = replicas["client"]
    before = _router_hits(c).get("hit", 0)
    first = [{"role": "user", "content": "Which gas do plants take in from the air to make sugar?"}]
    body = {"max_tokens": 12, "temperature": 0, "method": "pld"}
    seen, r1 = _post(c, "/v1/chat/completions", {"messages": first, **body})
    second = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And which gas do they give off?"}]
    again, r2 = _post(c, "/v1/chat/completions", {"messages": second, **body})
    assert again == seen
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0          # its prefix cache served it
    question = {"question": "Who designed the Forth Bridge?", "max_tokens": 12, "top_k_sources": 1}
    asked, _ = _post(c, "/v1/docqa", question)
    for _ in range(3):
        assert _post(c, "/v1/docqa", question)[0] == asked
    # a streamed turn goes the same way (the streaming handle shares the router's state)
    with c.stream("POST", "/v1/chat/completions", json={"messages": second, **body, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["x-rasd-replica"] == seen
        s.read()
    assert _router_hits(c)["hit"] - before >= 5


def test_every_replica_answers_like_the_in_process_engine(replicas: dict[str, Any]) -> None:
    from rasd.decoding.model.loading import load_model
    from rasd.decoding.runtime.engine import build_decoder

    target = load_model("default")
    for method in ("pld", "rasd"):
        prompt = f"def is_prime(n):  # {method}\n    \"\"\"Return True when n is prime.\"\"\"\n"
        ids = target.tokenizer(prompt)["input_ids"]
        want = build_decoder(target, "ar").generate(ids, 24, eos_token_ids=target.eos_token_ids).text or ""
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "method": method}
        answers = on_both(replicas["client"], "/v1/completions", body, prompt)
        assert [a["choices"][0]["text"] for a in answers.values()] == [want, want], method


def test_an_ingest_through_one_replica_is_found_by_both(replicas: dict[str, Any]) -> None:
    c = replicas["client"]
    r = c.post("/v1/documents", json={"documents": [{"title": "Quokkas", "text": "The quokka is a small "
                                                     "marsupial that lives on Rottnest Island near Perth."}]})
    assert r.status_code == 200 and r.json()["added"] == 1, r.text
    question = "Where do quokkas live?"
    answers = on_both(c, "/v1/docqa", {"question": question, "max_tokens": 8, "top_k_sources": 1}, question)
    assert r.headers["x-rasd-replica"] in answers
    assert [a["sources"][0]["title"] for a in answers.values()] == ["Quokkas", "Quokkas"]
