"""The prefix-aware router's pure parts: prefix keys, the bounded table, the choice rule, the shared state,
and the merge of several replicas' metrics (the real router on a real Serve app: test_replicas.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rasd.decoding.runtime.stats import DecodeStats
from rasd.serve.metrics import ServiceMetrics, merge_metrics, router_metrics
from rasd.serve.router import PrefixTable, RouterState, choose, prefix_keys


def test_prefix_keys_chain_every_block_before() -> None:
    a, b = "x" * 130 + "tail one", "x" * 130 + "tail two"
    (ka, tail_a), (kb, tail_b) = prefix_keys(a, 64), prefix_keys(b, 64)
    assert len(ka) == 2 and ka == kb and (tail_a, tail_b) == ("xxtail one", "xxtail two")
    assert prefix_keys("y" + a[1:], 64)[0][1] != ka[1]                # the same later text after another start
    assert prefix_keys("short question?", 64) == ([], "short question?")
    assert prefix_keys("", 64) == ([], "")


def test_table_finds_the_longest_prefix_per_replica() -> None:
    table = PrefixTable(block=8)
    table.insert("system prompt. user: hello", "A")
    table.insert("system prompt. user: other question", "B")
    turn2 = "system prompt. user: hello assistant: hi user: more"
    found = table.match(turn2, ["A", "B"])
    assert found["A"] > found["B"] > 0                                # both share the system prompt; A has more
    assert table.match(turn2, ["B"]) == {"B": found["B"]}           # only replicas asked about
    assert table.match("unrelated", ["A", "B"]) == {}
    assert table.match("system prompt. user: hello", ["A"]) == {"A": 26}   # the whole text, partial block too
    table.insert("Where do quokkas live?", "B")                        # a short question, then a longer text
    assert table.match("Where do quokkas live? On an island.", ["A", "B"]) == {"B": 22}


def test_a_chats_next_turn_matches_to_the_character() -> None:
    table = PrefixTable(block=64)
    turn1 = "\x1euser\x1fWhich gas do plants take in from the air to make sugar?"      # under one block
    table.insert(turn1, "A")
    turn2 = turn1 + "\x1eassistant\x1fCarbon dioxide.\x1euser\x1fAnd which gas do they give off?"
    assert table.match(turn2, ["A", "B"]) == {"A": len(turn1)}
    table.insert(turn2, "A")
    turn3 = turn2 + "\x1eassistant\x1fOxygen.\x1euser\x1fThanks."
    assert table.match(turn3, ["A", "B"]) == {"A": len(turn2)}


def test_table_is_bounded_and_forgets_dead_replicas() -> None:
    table = PrefixTable(max_keys=10, block=4)
    for i in range(20):
        table.insert(f"{i:04d}", "A")
    assert len(table) == 10
    assert table.match("0000", ["A"]) == {} and table.match("0019", ["A"]) == {"A": 4}   # oldest evicted
    table.insert("0019", "B")
    table.insert("00", "A")
    table.remove_replica("A")
    assert table.match("0019", ["A", "B"]) == {"B": 4} and len(table) == 1
    assert table.match("00", ["A", "B"]) == {}


def test_choose_prefers_the_match_unless_it_is_much_busier() -> None:
    assert choose({}, {"A": 0, "B": 0}) == (None, "miss")
    assert choose({"A": 64}, {"A": 3, "B": 0}, imbalance=4) == ("A", "hit")
    assert choose({"A": 64}, {"A": 5, "B": 0}, imbalance=4) == (None, "busy")
    assert choose({"A": 64, "B": 128}, {"A": 0, "B": 1}) == ("B", "hit")           # the longest prefix
    assert choose({"A": 64, "B": 64}, {"A": 2, "B": 1}) == ("B", "hit")            # a tie: the less busy


def test_state_counts_decisions_and_requests_in_flight() -> None:
    state = RouterState()
    state.set_replicas(["A", "B"])
    assert state.decide("r1", "what is a list?", state.loads(["A", "B"])) is None     # nothing cached yet
    state.routed_to("r1", "A", "what is a list?")
    assert state.loads(["A", "B"]) == {"A": 1, "B": 0}
    assert state.decide("r2", "what is a list?", state.loads(["A", "B"])) == "A"
    state.routed_to("r2", "B", "what is a list?")                   # Serve sent it elsewhere (A rejected it)
    state.completed("r1")
    state.completed("r2")
    state.completed("never-routed")
    assert state.loads(["A", "B"]) == {"A": 0, "B": 0}
    state.routed_to("r3", "A", None)                                # unrouted calls (health) are not counted
    assert state.snapshot() == {"hit": 0, "miss": 1, "busy": 1}
    state.set_replicas(["B"])                                       # A died: its cache went with it
    assert state.table.match("what is a list?", ["A", "B"]) == {"B": len("what is a list?")}


def test_a_request_reported_ended_before_routed_is_never_counted() -> None:
    """Serve reports a request routed on its router loop and ended from a worker thread: either may come
    first (a fast answer, a busy host), and a client may leave before its stream was routed."""
    state = RouterState()
    state.set_replicas(["A"])
    state.completed("fast")                          # done before Serve said where it went
    state.routed_to("fast", "A", "q")
    state.stream_closed("left")                      # the client left before its stream was routed
    state.routed_to("r-left", "A", "q", stream="left")
    state.completed("r-left")                        # Serve ends every request it routed
    assert state.loads(["A"]) == {"A": 0}
    state.routed_to("r-s", "A", "q", stream="s")     # a stream: Serve calls its request complete at the start
    state.completed("r-s")
    assert state.loads(["A"]) == {"A": 1}
    state.stream_closed("s")
    state.completed("r-early")                       # ... and may say so before it is reported routed
    state.routed_to("r-early", "A", "q", stream="s2")
    state.stream_closed("s2")
    assert state.loads(["A"]) == {"A": 0}
    assert not state.stream_requests and not state.routed and not state.streams
    state.routed_to("again", "A", "q")               # an ended id is forgotten once it is routed
    assert state.loads(["A"]) == {"A": 1}


def test_ends_of_requests_never_routed_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rasd.serve.router.MAX_PENDING", 3)
    state = RouterState()
    for i in range(10):
        state.completed(f"never-{i}")
    assert list(state.ended) == ["never-7", "never-8", "never-9"]


def test_metrics_of_replicas_are_summed() -> None:
    one, two = ServiceMetrics(lambda: (1, 2)), ServiceMetrics(lambda: (3, 0))
    stats = DecodeStats(steps=4, new_tokens=10, prompt_tokens=7, cached_prompt_tokens=5)
    one.record("chat", stats, 0.3)
    two.record("chat", stats, 1.2)
    two.failed("docqa", "429")
    merged = merge_metrics([one.render(), two.render()]) + router_metrics({"hit": 3, "miss": 1, "busy": 0}, {"A": 2})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(merged.decode()) for s in family.samples}
    assert samples[("rasd:generation_tokens_total", ())] == 20
    assert samples[("rasd:prefix_cache_hits_total", ())] == 10
    assert samples[("rasd:requests_total", (("endpoint", "chat"), ("outcome", "ok")))] == 2
    assert samples[("rasd:requests_total", (("endpoint", "docqa"), ("outcome", "429")))] == 1
    assert samples[("rasd:num_requests_running", ())] == 4
    assert samples[("rasd:request_latency_seconds_count", (("endpoint", "chat"),))] == 2
    assert samples[("rasd:router_requests_total", (("outcome", "hit"),))] == 3
    assert samples[("rasd:router_requests_in_flight", (("replica", "A"),))] == 2
    assert not any(name.endswith("_created") for name, _ in samples if name.startswith("rasd:generation"))
    assert merge_metrics([]) == b""



class _Lines:
    """A replica's stream that never ends (the client leaves first); records whether it was cancelled."""

    def __init__(self) -> None:
        self.cancelled = False

    def __aiter__(self) -> _Lines:
        return self

    async def __anext__(self) -> str:
        await asyncio.sleep(0)
        return "data: {}\n\n"

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("spec", ["2.0", "2.4"])
def test_a_stream_whose_client_leaves_is_released_at_once(spec: str) -> None:
    """The client stops reading (its sends block) and then disconnects: the router must stop counting the
    stream at once, not when the relay generator happens to be garbage-collected."""
    from rasd.serve.ingress import RelayResponse
    from rasd.serve.router import shared_state

    state, lines = shared_state(), _Lines()
    state.set_replicas([*state.replicas, "R-relay"])
    state.routed_to("req", "R-relay", "a prompt", stream="s-relay")
    assert state.in_flight_now()["R-relay"] == 1
    gone, sent = asyncio.Event(), []

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) >= 3:                      # the client stopped reading; then it leaves
            gone.set()
            if spec == "2.4":
                raise OSError("connection reset")
            await asyncio.Event().wait()

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def serve_it() -> tuple[int, bool]:
        with contextlib.suppress(Exception):
            await RelayResponse(lines, "s-relay", {"X-Rasd-Replica": "R-relay"})(
                {"type": "http", "asgi": {"spec_version": spec}}, receive, send)
        return state.in_flight_now()["R-relay"], lines.cancelled   # before the loop closes leftover generators

    assert asyncio.run(asyncio.wait_for(serve_it(), 10)) == (0, True)
