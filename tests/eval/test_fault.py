"""`rasd fault` in short, on a real local Ray + Serve: kill a retrieval shard and the verifier under load.

One Serve app with two retrieval shards (the session `service` fixture has none), a three-document index in
two segments, three concurrent requests of 12 tokens per phase. The same `run_fault` as the CLI runs every
phase (the draft phase is skipped: this app has no draft workers), then the test checks the promises: no
request hangs, every completed answer equals the fault-free one, every failure carries an HTTP status and a
message, every acknowledged document is found on disk and through the service, and the service answers
after each recovery.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DOCS, KEY, free_port

pytest.importorskip("ray.serve")
pytest.importorskip("httpx")

pytestmark = pytest.mark.slow
APP = "rasd-fault-test"
QUESTIONS = ["Who designed the Forth Bridge and when did it open?",
             "At what temperature is green tea brewed?",
             "How do glaciers form?"]


def _index(root: Path) -> Path:
    """Two segments, so that two shards each own one."""
    from rasd.index import Document, build_index
    from rasd.index.writer import add_documents

    docs = [Document(text=t, source=f"test:{title}", title=title) for title, t in DOCS]
    build_index(docs[:2], root)
    add_documents(root, docs[2:])
    return root


@pytest.fixture(scope="module")
def fault_service(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[dict]:
    """Our own app, so that killing its replica and adding documents never disturbs other tests.

    Ray can be initialised once per process. Normally this module runs before test_serve.py and owns a local
    Ray it shuts down afterwards. If the session `service` fixture already holds Ray (another test order),
    the app is deployed beside it under its own name and route prefix, with no CPU reservation (the session
    replica holds both), and only this app is deleted afterwards; the kills pick this app's replica by name.
    That second path is not known to pass: forced on 2026-11-28 (to save a Ray start), the test failed after
    368 s. Keep this module before tests/serve/ so that it owns its Ray.
    """
    import ray
    from ray import serve

    from rasd.serve.app import build_app

    index = _index(tmp_path_factory.mktemp("fault") / "index")
    config = {"index": str(index), "api_key": KEY, "max_batch": 4, "max_waiting": 4, "max_tokens_limit": 64,
              "threads": 2, "retrieval_shards": 2}
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url, prefix, app = f"http://127.0.0.1:{port}", "/", build_app(config)
    else:
        shared = request.getfixturevalue("service")
        url, prefix = f"{shared['url']}/fault", "/fault"
        app = build_app({**config, "threads": 1}, replica_cpus=0)
    serve.run(app, name=APP, route_prefix=prefix)
    yield {"url": url, "index": index}
    if owns_ray:
        serve.shutdown()
        ray.shutdown()
    else:
        serve.delete(APP)


def test_kills_under_load_cost_no_hang_no_wrong_token_no_document(fault_service: dict[str, Any]) -> None:
    from rasd.eval.fault import FaultConfig, format_fault_table, run_fault

    cfg = FaultConfig(url=fault_service["url"], api_key=KEY, index=str(fault_service["index"]), app=APP,
                      phases=["shard", "verifier", "draft", "ingest"], questions=QUESTIONS, concurrency=3,
                      params={"max_tokens": 12, "method": "rasd", "top_k_sources": 1, "temperature": 0},
                      docs_per_phase=1, ingest_docs=2, request_timeout_s=90, phase_timeout_s=120,
                      accept_wait_s=10)
    summary = run_fault(cfg)
    print(format_fault_table(summary))
    assert summary["reference_answers"] == len(QUESTIONS)
    phases = {p["phase"]: p for p in summary["phases"]}
    assert phases["draft"]["skipped"] and "no draft workers" in phases["draft"]["notes"]
    for name in ("shard", "verifier", "ingest"):
        p = phases[name]
        assert not p["skipped"], p["notes"]
        assert p["hung"] == 0 and p["unclear_errors"] == 0 and p["not_sent"] == 0, p["notes"]
        assert p["wrong"] == 0 and p["other_sources"] == 0 and p["unchecked"] == 0, p["notes"]
        assert p["completed"] + p["clear_errors"] == len(QUESTIONS), p["notes"]
        for row in p["rows"]:
            if row["outcome"] != "ok":
                assert row["status"] >= 400 and row["message"].strip(), row
        assert p["probe"]["outcome"] == "ok" and p["probe"]["same_as_reference"], p["probe"]
        assert p["healthz_back_s"] is not None, p["notes"]
    for name in ("shard", "verifier"):
        assert phases[name]["kill"].startswith(("SIGKILL", "ray.kill")), phases[name]["kill"]
        assert phases[name]["actor_back_s"] is not None, phases[name]["notes"]
    assert phases["shard"]["clear_errors"] == 0, "a shard crash must cost drafts, never a request"
    docs = summary["durability"]
    assert docs["acknowledged"] >= 3 and docs["lost"] == [], docs
    assert docs["on_disk"] == docs["searchable"] == docs["served"] == docs["acknowledged"], docs
    assert summary["violations"] == []
