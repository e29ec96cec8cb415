"""OpenAI fields on the real service: honoured (penalties, logit_bias, logprobs, content parts,
max_completion_tokens, stream_options, response_format) or refused by name (tools, echo, best_of, ...).

Honoured fields are checked against the in-process engine with the same settings, token for token.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.serve.test_serve import sse_events

pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

QUESTION = "List four things a river does to the land around it, one per line."


@pytest.fixture(scope="module")
def target(service: dict[str, Any]) -> Any:
    from rasd.decoding.model.loading import load_model

    return load_model("default")


def in_process(target: Any, messages: list[dict[str, str]], max_new: int, method: str = "ar",
               logprobs: int | None = None, repetition: int = 0, **sampling: Any) -> Any:
    from rasd.decoding.runtime.engine import build_decoder
    from rasd.decoding.step.sampling import SamplingParams
    from rasd.text import encode_chat

    ids = encode_chat(target.tokenizer, messages)
    stream = build_decoder(target, method).stream(ids, max_new, SamplingParams(**sampling), target.eos_token_ids,
                                                  logprobs=logprobs, repetition=repetition)
    for _ in stream:
        pass
    return stream.output


REFUSED = [   # (path, extra fields, the field the 400 names)
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": {"type": "objectx"}}}}, "response_format"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ("/v1/chat/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"presence_penalty": "lots"}, "presence_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"max_tokens": 8, "max_completion_tokens": 9}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages.0.content.0"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None}]}, "messages.0.content"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"n": 9}, "n"),
    ("/v1/docqa", {"question": "What is a river?", "n": 2}, "n"),
    ("/v1/chat/completions", {"repetition_window": 16}, "repetition_window"),
    ("/v1/chat/completions", {"stop_on_repetition": True, "repetition_window": 2}, "repetition_window"),
    ("/v1/docqa", {"question": "What is a river?", "repetition_window": 5000}, "repetition_window"),
]


@pytest.mark.parametrize(("path", "extra", "param"), REFUSED, ids=[r[2] for r in REFUSED])
def test_unsupported_or_invalid_openai_fields_get_400_naming_them(service: dict[str, Any], path: str,
                                                                  extra: dict[str, Any], param: str) -> None:
    body = ({"prompt": "hi"} if path == "/v1/completions" else {} if path == "/v1/docqa"
            else {"messages": [{"role": "user", "content": "hi"}]})
    r = service["client"].post(path, json={**body, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_fields_without_effect_and_unknown_fields_are_accepted(service: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0,
            "response_format": {"type": "text"}, "tool_choice": "none", "user": "u-1", "store": False,
            "some_vendor_field": {"x": 1}}
    r = service["client"].post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["x-rasd-ignored-fields"] == "some_vendor_field, store, tool_choice, user"
    streamed = service["client"].post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed.headers["x-rasd-ignored-fields"] == "some_vendor_field, store, tool_choice, user"
    clean = service["client"].post("/v1/chat/completions", json={k: body[k] for k in ("messages", "max_tokens")})
    assert "x-rasd-ignored-fields" not in clean.headers


def test_ignored_field_names_cannot_inject_headers(service: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "evil\r\nX-Injected: 1": 1, "na\u00efve": 2}
    r = service["client"].post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert "x-injected" not in r.headers
    assert r.headers["x-rasd-ignored-fields"] == "evil??X-Injected: 1, na?ve"


def test_token_id_prompts_answer_as_their_text(service: dict[str, Any], target: Any) -> None:
    """`prompt` as token ids (OpenAI's and vLLM's forms): the same answer as the text they encode; an id
    outside the vocabulary is a 400 naming its position."""
    c = service["client"]
    text = "The three primary colours are"
    ids = [int(t) for t in target.tokenizer(text)["input_ids"]]
    answers = [c.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0})
               for p in (text, ids, [ids])]
    assert [a.status_code for a in answers] == [200, 200, 200], answers[1].text
    assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
    assert all(a.json()["usage"]["prompt_tokens"] == len(ids) for a in answers)
    bad = c.post("/v1/completions", json={"prompt": [ids[0], 10**9], "max_tokens": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt.1", bad.text


def test_content_parts_equal_the_same_text_as_a_string(service: dict[str, Any]) -> None:
    c = service["client"]
    plain = {"messages": [{"role": "user", "content": "Name a colour.\nJust one."}], "max_tokens": 8,
             "temperature": 0}
    parts = {**plain, "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."},
                                                                {"type": "text", "text": "Just one."}]}]}
    a, b = c.post("/v1/chat/completions", json=plain), c.post("/v1/chat/completions", json=parts)
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]


@pytest.mark.parametrize("method", ["pld", "rasd"])
def test_penalties_and_bias_equal_the_in_process_engine(service: dict[str, Any], target: Any, method: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    bias_token = target.tokenizer(" water")["input_ids"][0]
    settings = {"frequency_penalty": 0.6, "presence_penalty": 0.3, "repetition_penalty": 1.1}
    body = {"messages": messages, "max_completion_tokens": 40, "temperature": 0, "method": method,
            "logit_bias": {str(bias_token): 2.0}, **settings}
    r = service["client"].post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    ref = in_process(target, messages, 40, logit_bias=((bias_token, 2.0),), **settings)
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    assert r.json()["usage"]["completion_tokens"] == len(ref.token_ids)
    unpenalised = in_process(target, messages, 40)
    assert unpenalised.token_ids != ref.token_ids, "the settings must change the answer for the test to mean much"


LOOPING = "What is the capital of France? Explain in detail."   # the embedded model repeats itself here


def test_the_repetition_stop_is_asked_for_and_equals_the_engine_streamed_or_not(service: dict[str, Any],
                                                                                target: Any) -> None:
    messages = [{"role": "user", "content": LOOPING}]
    body = {"messages": messages, "max_tokens": 200, "temperature": 0, "method": "pld"}
    plain = service["client"].post("/v1/chat/completions", json=body).json()["choices"][0]
    assert plain["finish_reason"] in ("stop", "length")          # off by default on the OpenAI endpoints
    ref = in_process(target, messages, 200, method="pld", repetition=32)
    assert ref.finish_reason == "repetition", "the prompt must loop for the test to mean much"
    asked = {**body, "stop_on_repetition": True}
    r = service["client"].post("/v1/chat/completions", json=asked)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (ref.text, "repetition")
    assert r.json()["usage"]["completion_tokens"] == len(ref.token_ids)
    assert plain["message"]["content"].startswith(ref.text) and len(plain["message"]["content"]) > len(ref.text)
    events = sse_events(service["client"].post("/v1/chat/completions", json={**asked, "stream": True}))
    chunks = [e["choices"][0] for e in events if isinstance(e, dict) and e.get("choices")]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == ref.text   # the dropped repeat never sent
    assert chunks[-1]["finish_reason"] == "repetition"


def test_chat_logprobs_equal_the_engine_streamed_or_not(service: dict[str, Any], target: Any) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "method": "pld", "logprobs": True,
            "top_logprobs": 2}
    r = service["client"].post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    ref = in_process(target, messages, 24, logprobs=2)
    assert len(content) == len(ref.token_ids) == r.json()["usage"]["completion_tokens"]
    for entry, want in zip(content, ref.logprobs, strict=True):
        assert entry["token"] == target.tokenizer.decode([want.token])
        assert abs(entry["logprob"] - want.logprob) < 1e-3
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        assert entry["bytes"] == list(entry["token"].encode("utf-8", "replace"))
    with service["client"].stream("POST", "/v1/chat/completions",
                                  json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == r.json()["usage"]
    streamed = [e for c in events[:-2] if c["choices"][0].get("logprobs")
                for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed, content, strict=True)) < 1e-3


def test_completion_logprobs_have_the_legacy_shape(service: dict[str, Any]) -> None:
    r = service["client"].post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 6,
                                                        "temperature": 0, "logprobs": 3})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    n = r.json()["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(len(top) <= 3 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert json.dumps(r.json())   # plain JSON: no NaN or infinity


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_json_schema_answers_validate_and_equal_plain_decoding(service: dict[str, Any]) -> None:
    """`response_format` json_schema with rasd: valid JSON of that schema, the same tokens as `ar`."""
    messages = [{"role": "user", "content": "Anna is 31 and lives in Paris. Describe her as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = {}
    for method in ("ar", "rasd"):
        r = service["client"].post("/v1/chat/completions", json={"messages": messages, "max_tokens": 64,
                                                                 "temperature": 0, "method": method,
                                                                 "response_format": fmt})
        assert r.status_code == 200, r.text
        answers[method] = r.json()
    text = answers["rasd"]["choices"][0]["message"]["content"]
    assert text == answers["ar"]["choices"][0]["message"]["content"]
    value = json.loads(text)
    assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int)
    assert isinstance(value["name"], str) and isinstance(value["city"], str)
    stats = answers["rasd"]["rasd"]
    print(f"json_schema with rasd: mean accepted {stats['mean_accepted_tokens']:.2f}, "
          f"{stats.get('accepted_by_source')}")
    r = service["client"].post("/v1/chat/completions", json={"messages": messages, "max_tokens": 32,
                                                             "temperature": 0, "response_format":
                                                             {"type": "json_object"}})
    assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_n_choices_are_rows_of_the_batch_streamed_or_not(service: dict[str, Any]) -> None:
    c = service["client"]
    greedy = {"prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0, "n": 3}
    r = c.post("/v1/completions", json=greedy)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == [0, 1, 2] and len({ch["text"] for ch in choices}) == 1
    one = c.post("/v1/completions", json={**greedy, "n": 1}).json()
    assert r.json()["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    # `ar`: a seed fixes the sample path of plain decoding; a speculative method consumes random numbers per
    # draft candidate, so its samples are exact in distribution (tests/decoding) but depend on the trees
    sampled = {**greedy, "temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 16, "method": "ar"}
    a, b = c.post("/v1/completions", json=sampled).json(), c.post("/v1/completions", json=sampled).json()
    assert [ch["text"] for ch in a["choices"]] == [ch["text"] for ch in b["choices"]], "seeded: reproducible"
    first = c.post("/v1/completions", json={**sampled, "n": 1}).json()
    assert a["choices"][0]["text"] == first["choices"][0]["text"], "choice 0 is the request with n = 1"
    with c.stream("POST", "/v1/completions", json={**sampled, "stream": True,
                                                  "stream_options": {"include_usage": True}}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in events[:-2]:
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1} and [texts[0], texts[1]] == [ch["text"] for ch in a["choices"]]
    # more choices than the service holds (batch 4 + 1 waiting): a real 429, never a 500
    full = c.post("/v1/completions", json={**greedy, "n": 8, "max_tokens": 24})
    assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error", full.text


HOSTILE_VALUES = [None, True, -1, 10**30, float("nan"), float("inf"), "", "\ud800", "x" * 5000, {"a": [[None]]}]
FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
          "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs",
          "response_format", "stream_options", "method", "tools", "messages", "user"]


def test_every_field_with_hostile_values_never_gets_a_500(service: dict[str, Any]) -> None:
    """Wrong types, huge numbers, NaN, infinity, lone surrogates, empty and nested values in every field of a
    chat request, streamed or not: a 4xx naming the problem, or an answer; never a 5xx; a stream ends with
    [DONE]."""
    seen: dict[int, int] = {}
    for f, field in enumerate(FIELDS):
        for v, value in enumerate(HOSTILE_VALUES):
            stream = (f + v) % 2 == 1
            base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
                    "stream": stream}
            raw = json.dumps({**base, field: value}, allow_nan=True)
            r = service["client"].post("/v1/chat/completions", content=raw.encode(),
                                       headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (field, repr(value)[:40], r.text[:300])
            if r.status_code >= 400:
                assert r.json()["error"]["message"], (field, value)
            elif stream and r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]"), (field, repr(value)[:40])
    assert seen.get(400, 0) > len(FIELDS) * 4, seen
