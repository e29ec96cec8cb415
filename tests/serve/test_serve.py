"""The Ray Serve app over real HTTP: a local Ray, the embedded model, a real FAISS index.

Every answer is compared with the in-process engine token for token (through the text); concurrent
requests share batched forwards and must still each get their own greedy output. Also: streaming (SSE),
the OpenAI error format, the API key, limits (429) and document ingest.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import DOCS, KEY, QUESTION

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

# `service` (the app on a local Ray, one per session, shared with test_web.py) is in conftest.py


@pytest.fixture(scope="module")
def local(service: dict[str, Any]) -> Any:
    """The in-process reference: same model, same index."""
    from rasd.decoding.model.loading import load_model
    from rasd.index.store import Index

    return load_model("default"), Index.open(service["index"])


def reference_completion(target: Any, prompt: str, max_new: int, method: str = "ar") -> str:
    from rasd.decoding.runtime.engine import build_decoder

    ids = target.tokenizer(prompt)["input_ids"]
    out = build_decoder(target, method).generate(ids, max_new, eos_token_ids=target.eos_token_ids)
    return out.text or ""


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_models_and_api_key(service: dict[str, Any]) -> None:
    bare = httpx.Client(base_url=service["url"], timeout=30)
    health = bare.get("/healthz").json()
    assert health["status"] == "ok"                                 # health needs no key
    # what `--dtype auto` chose and why (the suite pins auto's candidates to float32: conftest)
    assert health["dtype"] == "float32" and "RASD_DTYPE_CANDIDATES" in health["dtype_reason"]
    denied = bare.get("/v1/models")
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    wrong = bare.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    models = service["client"].get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "rasd-default"


def test_api_key_is_checked_before_the_body_and_guards_the_docs(service: dict[str, Any]) -> None:
    bare = httpx.Client(base_url=service["url"], timeout=30)
    assert bare.get("/healthz").json()["auth"] is True
    # an unkeyed caller gets 401, not the schema's 400 details, and the body is never parsed
    invalid = bare.post("/v1/chat/completions", json={"messages": "not a list", "max_tokens": -5})
    assert invalid.status_code == 401 and invalid.headers["www-authenticate"] == "Bearer"
    huge = bare.post("/v1/completions", content=b"{" * 5_000_000, headers={"content-type": "application/json"})
    assert huge.status_code == 401
    for path in ("/docs", "/openapi.json", "/metrics", "/v1/info", "/v1/documents"):
        assert bare.get(path).status_code == 401, path
    near = bare.get("/v1/models", headers={"Authorization": f"Bearer {KEY}x"})
    assert near.status_code == 401
    assert bare.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert bare.get("/").status_code == 200                       # the web page asks for the key itself


HOSTILE = [   # (path, raw JSON body, expected status, the field the error names or None)
    ("/v1/completions", b'{"prompt": "x", "stop": ""}', 400, "stop.0"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": [str(i) for i in range(17)]}).encode(), 400, "stop"),
    ("/v1/completions", json.dumps({"prompt": "x", "stop": ["ok", "s" * 300]}).encode(), 400, "stop.1"),
    ("/v1/completions", b'{"prompt": "x", "seed": 99999999999999999999999}', 400, "seed"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": 42}', 400, None),
    ("/v1/completions", b'{"prompt": "a \\ud800 b"}', 400, "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}], "stream": true}', 400,
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/docqa", json.dumps({"question": "q" * 200_001}).encode(), 400, "question"),
    ("/v1/documents", b'{"documents": [{"text": "ok", "title": "\\ud800"}]}', 400, "documents.0.title"),
    ("/v1/completions", b"{" * 3_000_000, 413, None),
    ("/v1/completions", b"not json", 400, None),
    ("/v1/documents", b'{"documents": [{"text": "ok", "metadata": {"a": 1}}]}', 400, "documents.0.metadata"),
    ("/v1/documents", b'{"documents": [{"text": "ok"}], "replace": true}', 400, "replace"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 5000 + b"]" * 5000
     + b"}", 400, None),
    ("/v1/no-such-path", b"{}", 404, None),
]


def test_models_retrieve_and_refusals_outside_the_routes_have_openai_error_bodies(service: dict[str, Any]) -> None:
    c = service["client"]
    assert c.get("/v1/models/rasd-default").json() == c.get("/v1/models").json()["data"][0]
    missing = c.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    wrong_verb = c.get("/v1/chat/completions")
    assert wrong_verb.status_code == 405 and "GET /v1/chat/completions" in wrong_verb.json()["error"]["message"]


@pytest.mark.parametrize(("path", "raw", "status", "param"), HOSTILE, ids=[f"{h[0]}:{h[2]}:{h[3]}" for h in HOSTILE])
def test_hostile_inputs_get_a_clear_4xx_naming_the_field(service: dict[str, Any], path: str, raw: bytes,
                                                          status: int, param: str | None) -> None:
    r = service["client"].post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_completion_equals_in_process_engine(service: dict[str, Any], local: Any) -> None:
    target, _ = local
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "method": "pld"}
    r = service["client"].post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["choices"][0]["finish_reason"] in ("stop", "length")
    assert data["choices"][0]["text"] == reference_completion(target, prompt, 40)
    assert data["usage"]["completion_tokens"] == data["rasd"]["new_tokens"] <= 40
    assert data["rasd"]["method"] == "pld" and data["rasd"]["mean_accepted_tokens"] >= 1.0
    # the same request streamed: the deltas add up to the same text, then usage, then [DONE]
    with service["client"].stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == data["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == data["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == data["usage"]


def test_chat_completion_shape_and_stream(service: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "Name three primary colours."}]
    r = service["client"].post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24,
                                                             "temperature": 0})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "chat.completion" and data["choices"][0]["message"]["role"] == "assistant"
    with service["client"].stream("POST", "/v1/chat/completions",
                                  json={"messages": messages, "max_tokens": 24, "temperature": 0,
                                        "stream": True}) as s:
        events = sse_events(s)[:-1]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == data["choices"][0]["message"]["content"]


def test_a_chats_next_turn_reuses_the_previous_prompt(service: dict[str, Any], local: Any) -> None:
    """The second turn resends the first turn's prompt: its whole blocks come from the prefix cache, and the
    answer still equals the in-process engine's greedy output for the whole conversation."""
    target, _ = local
    first = [{"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
             {"role": "user", "content": "Which gas do plants take in from the air to make sugar?"}]
    body = {"max_tokens": 16, "temperature": 0, "method": "pld"}
    r1 = service["client"].post("/v1/chat/completions", json={"messages": first, **body}).json()
    second = first + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And which gas do they give off?"}]
    r2 = service["client"].post("/v1/chat/completions", json={"messages": second, **body}).json()
    whole_blocks = r1["usage"]["prompt_tokens"] // 16 * 16
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= whole_blocks > 0
    ids = target.tokenizer.apply_chat_template(second, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    from rasd.decoding.runtime.engine import build_decoder

    ref = build_decoder(target, "ar").generate(list(ids), 16, eos_token_ids=target.eos_token_ids)
    assert r2["choices"][0]["message"]["content"] == (ref.text or "")


def test_the_client_warns_of_fields_the_service_ignored(service: dict[str, Any]) -> None:
    import warnings

    from rasd.client import Client, IgnoredFieldsWarning

    messages = [{"role": "user", "content": "Hi"}]
    with Client(service["url"], api_key=KEY) as client:
        with pytest.warns(IgnoredFieldsWarning, match="temprature"):
            client.chat(messages, max_tokens=2, temprature=0)
        with pytest.warns(IgnoredFieldsWarning, match="temprature"):
            list(client.chat_stream(messages, max_tokens=2, temprature=0))
        with warnings.catch_warnings():
            warnings.simplefilter("error", IgnoredFieldsWarning)
            client.chat(messages, max_tokens=2, temperature=0)


def test_docqa_equals_in_process_pipeline(service: dict[str, Any], local: Any) -> None:
    from rasd.apps.docqa import DocQA
    from rasd.client import Client

    target, index = local
    with Client(service["url"], api_key=KEY) as client:
        answer = client.ask(QUESTION, top_k_sources=2, max_tokens=48)
        streamed = list(client.ask_stream(QUESTION, top_k_sources=2, max_tokens=48))
    ref = DocQA(index, target, method="rasd", top_k=2, max_new_tokens=48).ask(QUESTION)
    assert answer.answer == ref.answer
    assert answer.sources[0]["title"] == "Bridges"
    assert answer.stats["method"] == "rasd" and answer.stats["mean_accepted_tokens"] > 1.0
    assert streamed[0]["sources"][0]["title"] == "Bridges"
    assert "".join(e.get("delta", "") for e in streamed).strip() == ref.answer
    assert streamed[-1]["answer"] == ref.answer
    # asked twice: the service remembered the first answer (its response history) and drafted the second from it
    assert streamed[-1]["rasd"]["committed_by_source"].get("history", 0) > 0, streamed[-1]["rasd"]
    # asked twice: the second prefill reused the first one's prompt blocks (all but the last 16-31 tokens)
    prompt_tokens = streamed[-1]["usage"]["prompt_tokens"]
    assert prompt_tokens - 32 < streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] <= prompt_tokens - 16


def test_concurrent_requests_share_the_batch_and_keep_their_outputs(service: dict[str, Any], local: Any) -> None:
    target, _ = local
    prompts = ["The capital of France is", "import numpy as np\n\ndef mean(xs):", "Once upon a time,",
               "The three laws of motion are"]
    results: dict[int, Any] = {}

    def go(i: int) -> None:
        results[i] = service["client"].post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 32,
                                                                     "temperature": 0, "method": "pld"})

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, prompt in enumerate(prompts):
        assert results[i].status_code == 200, results[i].text
        assert results[i].json()["choices"][0]["text"] == reference_completion(target, prompt, 32), prompt


def test_bad_requests_get_openai_style_errors(service: dict[str, Any]) -> None:
    c = service["client"]
    cases = [
        ({}, 400, "prompt"),                                               # missing prompt
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ({"prompt": "hi", "n": 9}, 400, "n"),                               # more choices than the limit
        ({"prompt": "hi", "method": "magic"}, 400, "method"),
        ({"prompt": "hi", "method": "draft"}, 400, "method"),              # no --draft-model
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
        ({"prompt": "word " * 8200}, 400, "prompt"),                     # longer than the 8192 context
    ]
    for body, status, param in cases:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"] and err["param"] == param, (body, err)
    r = c.post("/v1/docqa", json={"question": "   "})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    from rasd.decoding.proposers.early_exit import eesd_path

    if not eesd_path("default").exists():                                  # untrained: refused up front
        r = c.post("/v1/completions", json={"prompt": "hi", "method": "eesd"})
        assert r.status_code == 400 and "rasd train eesd" in r.json()["error"]["message"]
    r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_overload_gets_429_not_an_unbounded_queue(service: dict[str, Any]) -> None:
    """Half the requests stream: a refused stream gets a real 429 status with a JSON error, never a 200
    whose event stream then carries the error."""
    statuses: list[int] = []
    lock = threading.Lock()

    def go(stream: bool) -> None:
        r = service["client"].post("/v1/completions", json={"prompt": "Count slowly:", "max_tokens": 48,
                                                            "temperature": 0, "method": "ar", "stream": stream})
        with lock:
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["type"] == "rate_limit_error"
            elif stream:
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text

    threads = [threading.Thread(target=go, args=(i % 2 == 0,)) for i in range(8)]   # batch 4 + 1 waiting
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert statuses.count(200) >= 5 - 1 and statuses.count(429) >= 1, statuses
    assert set(statuses) <= {200, 429}


def test_ingested_documents_are_retrieved_and_durable(service: dict[str, Any]) -> None:
    from rasd.client import ApiError, Client
    from rasd.index.store import Index

    with Client(service["url"], api_key=KEY) as client:
        before = Index.open(service["index"]).num_documents   # len(DOCS), more if test_web.py ran first
        added = client.add_documents([{"title": "Quokkas", "text": "The quokka is a small marsupial that lives on "
                                       "Rottnest Island near Perth. Quokkas are nocturnal herbivores."}])
        assert added["added"] == 1 and added["num_documents"] == before + 1 >= len(DOCS) + 1
        assert Index.open(service["index"]).num_documents == before + 1   # on disk when acknowledged
        answer = client.ask("Where do quokkas live?", top_k_sources=1, max_tokens=24)
        assert answer.sources[0]["title"] == "Quokkas"
        with pytest.raises(ApiError) as info:
            client.add_documents([{"title": "empty", "text": ""}])
        assert info.value.status == 400


def test_an_ingest_retried_with_its_idempotency_key_adds_once(service: dict[str, Any]) -> None:
    c = service["client"]
    docs = {"documents": [{"title": "Axolotls", "text": "The axolotl is a salamander that keeps its gills."}]}
    first = c.post("/v1/documents", json=docs, headers={"Idempotency-Key": "ingest-axolotl-1"})
    assert first.status_code == 200 and first.json()["added"] == 1, first.text
    again = c.post("/v1/documents", json=docs, headers={"Idempotency-Key": "ingest-axolotl-1"})
    assert again.status_code == 200 and again.json()["replayed"] is True and again.json()["added"] == 1
    assert again.json()["num_documents"] == first.json()["num_documents"], "a retry never adds twice"
    other = c.post("/v1/documents", json={"documents": [{"text": "something else"}]},
                   headers={"Idempotency-Key": "ingest-axolotl-1"})
    assert other.status_code == 422 and other.json()["error"]["param"] == "Idempotency-Key"
    long_key = c.post("/v1/documents", json=docs, headers={"Idempotency-Key": "k" * 256})
    assert long_key.status_code == 400


def test_a_whitespace_only_document_is_refused_by_name_not_skipped(service: dict[str, Any]) -> None:
    docs = {"documents": [{"text": "Capybaras are the largest rodents."}, {"title": "blank", "text": " \n\t "}]}
    r = service["client"].post("/v1/documents", json=docs)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("documents.1"), r.text


def test_the_client_retries_an_ingest_under_one_key_so_a_lost_answer_adds_once(service: dict[str, Any]) -> None:
    """The first answer is lost after the service committed (the connection drops): the client's retry carries
    the same Idempotency-Key, so the batch is added once."""
    from rasd.client import Client
    from rasd.index.store import Index

    class LoseFirstIngestAnswer(httpx.HTTPTransport):
        lost = 0

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            response = super().handle_request(request)
            if request.url.path == "/v1/documents" and not self.lost:
                response.read()                  # the service has committed and answered; the answer is lost
                self.lost += 1
                raise httpx.ReadError("connection reset after the commit", request=request)
            return response

    transport = LoseFirstIngestAnswer()
    doc = {"title": "Okapis", "text": "The okapi is a forest giraffe of the Congo with striped legs."}
    with Client(service["url"], api_key=KEY, backoff_s=0.01, transport=transport) as client:
        before = Index.open(service["index"]).num_documents
        added = client.add_documents([doc])
    assert transport.lost == 1 and added["replayed"] is True and added["added"] == 1
    assert Index.open(service["index"]).num_documents == before + 1, "a lost answer must not add the batch twice"


def test_changes_by_another_writer_are_served_at_the_next_request(service: dict[str, Any]) -> None:
    """A CLI-style `add` and then `compact` on the index folder, behind the replica's back: the next request
    sees the new document, and nothing reads a segment folder the compaction removed."""
    from rasd.client import Client
    from rasd.index import Document
    from rasd.index.writer import add_documents, compact_index

    add_documents(service["index"], [Document(title="Axolotls", text="The axolotl is a salamander from Lake "
                                              "Xochimilco near Mexico City. Axolotls regrow lost limbs.")])
    with Client(service["url"], api_key=KEY) as client:
        answer = client.ask("Which lake do axolotls come from?", top_k_sources=1, max_tokens=16)
        assert answer.sources[0]["title"] == "Axolotls"
        compact_index(service["index"])
        again = client.ask("Which lake do axolotls come from?", top_k_sources=1, max_tokens=16)
        assert again.sources[0]["title"] == "Axolotls"
        assert isinstance(client.complete("The axolotl", max_tokens=8, method="rasd").text, str)


def test_an_ingest_never_freezes_a_running_stream(service: dict[str, Any]) -> None:
    """`rasd ingest-check`'s measurement, small: 150 KB ingested while streams run back to back. Embedding
    runs on the compute thread in background slices of about 0.2 s that yield to decoding steps, so no token
    waits more than the service's promise of 2 s (on the compute thread in one piece, as before, a stream
    waited for the whole embedding; in fixed 16-chunk slices, 1-4 s per token)."""
    from rasd.eval.ingest_check import make_documents, run_ingest_check, sample_paragraphs, verdict
    from tests.helpers import KEY

    docs = make_documents(sample_paragraphs(), 150_000, 50_000, seed=1)
    summary = run_ingest_check(service["url"], KEY, docs, streams=1, max_tokens=64, method="ar", timeout_s=300)
    assert summary["ingest_answer"]["added"] == len(docs) == 3, summary["ingest_error"]
    assert summary["tokens_during"] >= 10, summary        # the streams ran beside the ingest
    assert verdict(summary, max_wait=2.0) == [], {k: v for k, v in summary.items() if k != "gaps"}


def test_metrics_use_vllm_style_names(service: dict[str, Any]) -> None:
    text = service["client"].get("/metrics").text
    for name in ("rasd:spec_decode_num_drafts_total", "rasd:spec_decode_num_draft_tokens_total",
                 "rasd:spec_decode_num_accepted_tokens_total", "rasd:spec_decode_num_accepted_tokens_per_pos_total",
                 "rasd:request_latency_seconds_bucket", "rasd:num_requests_running",
                 "rasd:prefix_cache_queries_total", "rasd:prefix_cache_hits_total"):
        assert name in text, name


def test_serve_config_yaml_builds(tmp_path: Path) -> None:
    import yaml

    from rasd.serve.app import build_app

    config = yaml.safe_load(Path("serve_config.yaml").read_text())
    app = config["applications"][0]
    assert app["import_path"] == "rasd.serve.app:build_app"
    build_app(app["args"])   # the builder accepts the file's args
    with pytest.raises(ValueError, match="serve config has unknown keys: modle"):
        build_app({"modle": "default"})
    replicas = build_app({"replicas": 2, "threads": 1})._bound_deployment.init_args[0]._bound_deployment
    assert replicas.name == "RasdServer" and replicas.num_replicas == 2
    assert replicas.ray_actor_options["num_cpus"] == 1
    with pytest.raises(ValueError, match="router has unknown options: imbalanse"):
        build_app({"router": {"imbalanse": 2}})
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        build_app({"replicas": 0})


def test_load_levels_report_throughput_and_latency(service: dict[str, Any]) -> None:
    from rasd.eval.load import format_load_table, run_level

    questions = [QUESTION, "How long is the Forth Bridge?", "How is green tea brewed?"]
    level = run_level(service["url"], KEY, questions, 3, {"max_tokens": 12, "temperature": 0, "top_k_sources": 1})
    assert level["requests"] == level["completed"] == 3 and level["completion_tokens"] > 0
    assert level["rejected"] == level["errors"] == level["timeouts"] == level["not_sent"] == 0
    assert 0 < level["latency_p50_s"] <= level["latency_p99_s"] <= level["wall_s"] + 1 and level["tokens_per_s"] > 0
    level.update(identical_to_in_process=1.0, vs_hf=2.0, vs_hf_e2e=2.5)
    table = format_load_table({"hf_tokens_per_s": 10.0, "hf_e2e_tokens_per_s": 8.0, "levels": [level]})
    assert "agg tok/s" in table and "2.00x" in table
    assert 0 <= level["cached_prompt_tokens"] < level["prompt_tokens"] and "%" in table


def test_load_level_counts_errors_and_rejections_without_retrying(service: dict[str, Any]) -> None:
    from rasd.eval.load import format_load_table, percentile, run_level

    level = run_level(service["url"], "wrong-key", ["a?", "b?"], 2, {"max_tokens": 4})
    assert level["completed"] == 0 and level["errors"] == 2 and level["latency_p50_s"] is None
    assert all(row["status"] == 401 for row in level["rows"])
    late = run_level(service["url"], KEY, ["a?"], 1, {"max_tokens": 4}, level_timeout_s=-1)
    assert late["not_sent"] == 1 and late["completion_tokens"] == 0
    level.update(identical_to_in_process=None, vs_hf=0.0, vs_hf_e2e=0.0)
    assert " - " in format_load_table({"hf_tokens_per_s": 1.0, "hf_e2e_tokens_per_s": 1.0, "levels": [level]})
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0] * 99 + [9.0], 0.99) == 1.0
    assert percentile([1.0] * 98 + [9.0, 9.0], 0.99) == 9.0 and percentile([], 0.5) is None


def test_a_ray_started_for_the_service_runs_serve_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Ray `rasd serve` starts runs Serve's control loop at 1 s (not 0.1 s), unless the user chose, and
    without Ray's own SIGTERM drain (rasd drains first); in a session of its own, on free ports."""
    import argparse
    import os

    from rasd.serve import app as serve_mod
    from rasd.serve.loopback import build_shim

    build_shim()
    started: list[tuple[list[str], dict[str, str]]] = []

    class Started(Exception):
        pass

    def fake_start(args: list[str], env: dict[str, str], log: Any) -> Any:
        started.append((args, env))
        raise Started

    monkeypatch.setattr(serve_mod, "start_head", fake_start)
    monkeypatch.setattr(serve_mod, "running_local_ray", lambda: None)       # no Ray running here
    monkeypatch.delenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", raising=False)
    args = argparse.Namespace(address=None, ray_host="127.0.0.1", host="127.0.0.1", port=8000)
    with pytest.raises(Started):
        serve_mod.Running()._ray(args)
    ((head_args, env),) = started
    assert head_args[:2] == ["start", "--head"] and any(a.startswith("--port=") for a in head_args)
    assert env["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "1.0"
    assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0"
    assert env["PATH"] == os.environ["PATH"], "the rest of the environment is passed on"
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")
    assert serve_mod.ray_env()["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2", "the user's setting wins"


def test_load_plot_labels_each_level_against_both_hf_rates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plot says what the table says: aggregate vs HF decode-only and vs HF with prefill, per level."""
    import matplotlib.figure

    from rasd.eval.load import plot_load

    saved: list[Any] = []
    real_savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, path, **kw: (saved.append(fig), real_savefig(fig, path, **kw)))
    summary = {"method": "rasd", "max_tokens": 8, "hf_tokens_per_s": 10.0, "hf_e2e_tokens_per_s": 8.0,
               "levels": [{"concurrency": c, "tokens_per_s": t, "latency_p50_s": 1.0, "latency_p99_s": 2.0}
                          for c, t in ((1, 12.0), (8, 30.0))]}
    plot_load(summary, str(tmp_path / "both.png"))
    assert [t.get_text() for t in saved[-1].axes[0].texts] == ["1.20x / 1.50x hf", "3.00x / 3.75x hf"]
    del summary["hf_e2e_tokens_per_s"]                    # results files from before it was recorded
    plot_load(summary, str(tmp_path / "decode.png"))
    assert [t.get_text() for t in saved[-1].axes[0].texts] == ["1.20x hf", "3.00x hf"]
    assert (tmp_path / "both.png").stat().st_size > 0 and (tmp_path / "decode.png").stat().st_size > 0
