"""Batched verification: many requests in one forward give each request's own tokens.

Tiny random Llamas; requests with different prompt lengths, methods and max_new_tokens share a batch,
join late, leave early or are cancelled. Greedy output must equal HF `generate` (a difference only at a
genuine near-tie), and seeded sampling must give the same tokens as the request decoded alone.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import GenerationStream, SpeculativeDecoder
from rasd.decoding.runtime.scheduler import Overloaded, Scheduler
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchCache, BatchDecoder
from rasd.decoding.step.cache import TreeCache
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from rasd.decoding.step.verify import batch_inputs
from tests.helpers import assert_greedy_equal, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def decoder(model: torch.nn.Module, method: str) -> SpeculativeDecoder:
    """A fresh decoder per request: proposer and sizer state belong to one request."""
    draft = model if method == "draft" else None
    options = {"top_k": 2, "width": 3, "min_prob": 0.0} if method == "draft" else {}
    return SpeculativeDecoder(model, make_proposer(method, draft, **options), sizer=FixedSizer(8))


def repeating(length: int, seed: int) -> list[int]:
    """Random tokens whose tail repeats the start, so that prompt lookup finds matches."""
    if length < 20:
        return random_prompt(length, seed)
    head = random_prompt(length - 10, seed)
    return head + head[:10]


def drain(batch: BatchDecoder, blocks: dict[int, list[int]], streams: list[GenerationStream],
          max_steps: int = 500) -> None:
    """Step until every request has left the batch, collecting streamed blocks per request."""
    for _ in range(max_steps):
        if not len(batch):
            return
        for stream, block in batch.step():
            blocks[id(stream)] += block
    raise AssertionError("the batch did not finish")


def add(batch: BatchDecoder, stream: GenerationStream, blocks: dict[int, list[int]],
        streams: list[GenerationStream]) -> None:
    streams.append(stream)
    blocks[id(stream)] = batch.add(stream) or []   # None: prefilled in chunks, first block from a step


REQUESTS = [("pld", 40, 0, 29), ("ar", 7, 1, 13), ("draft", 23, 2, 37), ("pld", 1, 3, 20)]


def test_batched_greedy_equals_hf_for_mixed_requests() -> None:
    model = tiny_llama(0)
    batch = BatchDecoder(model)
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []
    for method, length, seed, max_new in REQUESTS:
        add(batch, decoder(model, method).stream(repeating(length, seed), max_new), blocks, streams)
    assert len(batch) == len(REQUESTS)
    drain(batch, blocks, streams)
    for stream, (method, length, seed, max_new) in zip(streams, REQUESTS, strict=True):
        prompt = repeating(length, seed)
        out = stream.output
        assert out is not None and out.finish_reason == "length"
        assert blocks[id(stream)] == out.token_ids, "streamed blocks must add up to the output"
        assert_greedy_equal(model, prompt, out.token_ids, hf_greedy(model, prompt, max_new), label=method)
        assert out.stats.steps == len(out.stats.accept_lengths)
    pld = streams[0].output
    assert pld is not None and pld.stats.mean_accepted_tokens > 1.0, "speculation must still happen in a batch"


def test_requests_join_late_leave_early_and_cancel() -> None:
    model = tiny_llama(1)
    batch = BatchDecoder(model)
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []
    add(batch, decoder(model, "pld").stream(repeating(40, 5), 40), blocks, streams)
    add(batch, decoder(model, "ar").stream(repeating(9, 6), 4), blocks, streams)        # leaves early
    cancelled = decoder(model, "pld").stream(repeating(30, 7), 40)
    add(batch, cancelled, blocks, streams)
    for _ in range(5):
        for stream, block in batch.step():
            blocks[id(stream)] += block
    assert len(batch) == 2, "the 4-token request has left the batch"
    batch.remove(cancelled)
    add(batch, decoder(model, "draft").stream(repeating(60, 8), 25), blocks, streams)   # joins late, longest
    add(batch, decoder(model, "pld").stream(repeating(3, 9), 18), blocks, streams)
    drain(batch, blocks, streams)
    for stream in streams:
        if stream is cancelled:
            continue
        out = stream.output
        assert out is not None
        ref = hf_greedy(model, stream.prompt_ids, stream.checker.max_new)
        assert_greedy_equal(model, stream.prompt_ids, out.token_ids, ref)
        assert blocks[id(stream)] == out.token_ids


def test_seeded_sampling_in_a_batch_equals_the_request_alone() -> None:
    model = tiny_llama(0)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in (1, 2, 3)]
    prompts = [repeating(40, 11), repeating(12, 12), repeating(25, 13)]
    alone = [decoder(model, "pld").generate(p, 30, sampling=sp).token_ids
             for p, sp in zip(prompts, params, strict=True)]
    batch = BatchDecoder(model)
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []
    for p, sp in zip(prompts, params, strict=True):
        add(batch, decoder(model, "pld").stream(p, 30, sampling=sp), blocks, streams)
    drain(batch, blocks, streams)
    assert [s.output.token_ids for s in streams if s.output] == alone


def test_eos_inside_a_block_stops_only_that_request() -> None:
    model = tiny_llama(0)
    prompt = repeating(40, 0)
    ref = hf_greedy(model, prompt, 30)
    eos = ref[17]
    first = ref.index(eos)
    batch = BatchDecoder(model)
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []
    add(batch, decoder(model, "pld").stream(prompt, 30, eos_token_ids={eos}), blocks, streams)
    add(batch, decoder(model, "pld").stream(repeating(33, 4), 30), blocks, streams)
    drain(batch, blocks, streams)
    out = streams[0].output
    assert out is not None and out.finish_reason == "eos" and out.token_ids == ref[: first + 1]
    other = streams[1].output
    assert other is not None and len(other.token_ids) == 30


def test_batch_inputs_mask_rows_see_only_their_own_entries() -> None:
    chain = DraftTree.chain(5, [6, 7], "x")          # 3 nodes
    root = DraftTree.root_only(9)                    # 1 node: padded with 2 copies of its root
    ids, pos, mask = batch_inputs([chain, root], row_lengths=[4, 2], past_len=4, dtype=torch.float32,
                                  device="cpu")
    assert ids.tolist() == [[5, 6, 7], [9, 9, 9]]
    assert pos.tolist() == [[4, 5, 6], [2, 2, 2]]
    seen = mask[:, 0] == 0                           # [B, T, past + T]
    assert seen[0, :, :4].all() and seen[0, :, 4:].tolist() == [[True, False, False], [True, True, False],
                                                                [True, True, True]]
    assert seen[1, :, :2].all() and not seen[1, :, 2:4].any(), "row 1's gap [2, 4) is hidden"
    assert seen[1, :, 4:].tolist() == [[True, False, False], [False, True, False], [False, False, True]]


def test_batch_cache_rows_join_compact_and_leave() -> None:
    def one_row(length: int, fill: float) -> TreeCache:
        cache = TreeCache(num_layers=1)
        kv = torch.full((1, 2, length, 3), fill)
        cache.update(kv, kv.clone(), 0)
        return cache

    cache = BatchCache(num_layers=1)
    cache.add_row(one_row(5, 1.0))
    cache.add_row(one_row(3, 2.0))
    assert cache.row_lengths == [5, 3] and cache.get_seq_length() == 5
    tree_kv = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).reshape(2, 2, 4, 3)   # a 4-node step
    cache.update(tree_kv, tree_kv.clone(), 0)
    cache.keep_rows(5, [[0, 2], [0, 1, 3]])
    assert cache.row_lengths == [7, 6] and cache.get_seq_length() == 7
    keys = cache.layers[0].keys
    assert torch.equal(keys[0, :, 5:7], tree_kv[0][:, [0, 2]])
    assert torch.equal(keys[1, :, 3:6], tree_kv[1][:, [0, 1, 3]])
    assert (keys[1, :, :3] == 2.0).all(), "row 1's own context is untouched"
    cache.remove_rows([0])
    assert cache.row_lengths == [6] and cache.get_seq_length() == 6
    assert torch.equal(cache.layers[0].keys[0, :, 3:6], tree_kv[1][:, [0, 1, 3]])
    cache.remove_rows([0])
    assert cache.rows == 0
    cache.add_row(one_row(2, 3.0))
    assert cache.row_lengths == [2] and (cache.layers[0].keys == 3.0).all()


def test_batch_cache_a_leaving_row_takes_the_last_rows_slot_and_a_joining_row_sees_zeros() -> None:
    """Leaving moves one row (the last) into the freed slot; the new order is returned for the streams."""
    def one_row(length: int, fill: float) -> TreeCache:
        cache = TreeCache(num_layers=2)
        for layer in range(2):
            kv = torch.full((1, 2, length, 3), fill + layer)
            cache.update(kv, kv.clone(), layer)
        return cache

    cache = BatchCache(num_layers=2)
    for length, fill in ((4, 1.0), (6, 10.0), (2, 20.0), (5, 30.0)):
        cache.add_row(one_row(length, fill))
    assert cache.remove_rows([1]) == [0, 3, 2]
    assert cache.row_lengths == [4, 5, 2] and cache.get_seq_length() == 5
    for layer in range(2):
        keys = cache.layers[layer].keys                      # [3, 2, 5, 3]
        assert (keys[1, :, :5] == 30.0 + layer).all(), "the last row moved into slot 1, whole"
        assert (keys[0, :, :4] == 1.0 + layer).all() and (keys[2, :, :2] == 20.0 + layer).all()
    assert cache.remove_rows([0, 2]) == [1]
    assert cache.row_lengths == [5] and (cache.layers[0].keys[0] == 30.0).all()
    cache.add_row(one_row(3, 40.0))                          # shorter than the shared end (5)
    values = cache.layers[1].values
    assert (values[1, :, :3] == 41.0).all() and (values[1, :, 3:5] == 0).all(), "the gap is zeros, not stale"
    for layer in cache.layers:                               # past the shared end the store is uninitialised
        layer._kstore[:, :, cache.get_seq_length():] = float("nan")
        layer._vstore[:, :, cache.get_seq_length():] = float("nan")
    cache.add_row(one_row(7, 50.0))                          # longer than the others: their gap grows
    keys = cache.layers[0].keys                              # [3, 2, 7, 3]
    assert (keys[2] == 50.0).all() and (keys[1, :, 3:7] == 0).all() and (keys[0, :, 5:7] == 0).all()
    assert not cache.layers[1].values.isnan().any()
    assert cache.remove_rows([0, 1, 2]) == [] and cache.rows == 0 and cache.get_seq_length() == 0


def test_rows_leaving_from_the_middle_keep_every_request_its_own_tokens() -> None:
    """Requests of very different lengths finish in an order that exercises swap-removal on every step."""
    model = tiny_llama(2)
    batch = BatchDecoder(model)
    specs = [(30, 0, 3), (12, 1, 20), (25, 2, 6), (9, 3, 14), (40, 4, 9)]
    streams = [decoder(model, "pld").stream(repeating(n, s), k) for n, s, k in specs]
    tokens: dict[int, list[int]] = {}
    with torch.inference_mode():
        for i, stream in enumerate(streams):
            tokens[i] = batch.add(stream) or []
        for _ in range(100):
            if not len(batch):
                break
            for stream, block in batch.step():
                tokens[streams.index(stream)] += block
    assert not len(batch)
    for i, (n, s, k) in enumerate(specs):
        prompt = repeating(n, s)
        assert tokens[i] == streams[i].output.token_ids
        assert_greedy_equal(model, prompt, tokens[i], hf_greedy(model, prompt, k), label=f"request {i}")


def test_a_stream_for_another_model_is_refused() -> None:
    batch = BatchDecoder(tiny_llama(0))
    with pytest.raises(ValueError, match="another"):
        batch.add(decoder(tiny_llama(1), "ar").stream([1, 2, 3], 3))


def collect(scheduler: Scheduler, streams: list[GenerationStream], timeout: float = 120.0) -> list[list[Any]]:
    """Submit streams, wait (bounded) for each to finish; returns every request's events."""
    events: list[list[Any]] = [[] for _ in streams]
    done = threading.Semaphore(0)

    def sink_for(i: int) -> Any:
        def sink(kind: str, payload: Any) -> None:
            events[i].append((kind, payload))
            if kind in ("done", "error"):
                done.release()
        return sink

    for i, stream in enumerate(streams):
        scheduler.submit(stream, sink_for(i))
    for _ in streams:
        assert done.acquire(timeout=timeout), "a request did not finish in time"
    return events


def test_scheduler_streams_every_request_to_its_own_sink() -> None:
    model = tiny_llama(0)
    scheduler = Scheduler(model, max_batch=3, max_waiting=8)
    try:
        specs = [("pld", 40, 0, 21), ("ar", 7, 1, 9), ("draft", 23, 2, 17), ("pld", 33, 3, 25), ("ar", 2, 4, 5)]
        streams = [decoder(model, m).stream(repeating(n, s), k) for m, n, s, k in specs]
        events = collect(scheduler, streams)
    finally:
        scheduler.close()
    for (method, length, seed, max_new), evs in zip(specs, events, strict=True):
        kinds = [k for k, _ in evs]
        assert kinds[-1] == "done" and set(kinds[:-1]) == {"tokens"}
        tokens = [t for k, block in evs if k == "tokens" for t in block]
        out = evs[-1][1]
        assert tokens == out.token_ids
        prompt = repeating(length, seed)
        assert_greedy_equal(model, prompt, tokens, hf_greedy(model, prompt, max_new), label=method)


def test_scheduler_refuses_beyond_its_queue_and_drops_cancelled_requests() -> None:
    model = tiny_llama(1)
    scheduler = Scheduler(model, max_batch=1, max_waiting=1)
    try:
        tickets, refused = [], 0
        for i in range(4):
            try:
                tickets.append(scheduler.submit(decoder(model, "ar").stream(repeating(9, i), 400), lambda k, p: None))
            except Overloaded:
                refused += 1
        assert refused >= 2, "one running + one waiting: the rest must be refused at once"
        for ticket in tickets:
            scheduler.cancel(ticket)
        deadline = time.monotonic() + 60
        while scheduler.load() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.load() == (0, 0), "cancelled requests must leave the batch"
    finally:
        scheduler.close()


def test_a_warm_started_sizer_continues_from_what_the_last_request_learned() -> None:
    from rasd.decoding.sizing.cost import CostCurve
    from rasd.decoding.sizing.sizers import CostAwareSizer
    from rasd.serve.service import sizer_state, warm_start

    def curve(_: int) -> CostCurve:
        return CostCurve(key="k", context_len=256, sizes=[1, 64], latency_s=[0.05, 0.2])

    model = tiny_llama(0)
    first = SpeculativeDecoder(model, make_proposer("pld"), sizer=CostAwareSizer(curve, max_nodes=16))
    prompt = repeating(40, 0)
    first.generate(prompt, 30)
    state = sizer_state(first.sizer)
    assert state["counts"] and state["observed"]
    fresh = CostAwareSizer(curve, max_nodes=16)
    warm_start(fresh, state)
    assert fresh.estimator.counts == first.sizer.estimator.counts
    assert fresh.estimator.counts is not first.sizer.estimator.counts, "a copy: requests never share state"
    second = SpeculativeDecoder(model, make_proposer("pld"), sizer=fresh).generate(prompt, 30)
    assert_greedy_equal(model, prompt, second.token_ids, hf_greedy(model, prompt, 30))
    warm_start(fresh, {})   # nothing learned yet: no change, no error


def test_a_request_joining_a_running_batch_is_prefilled_in_chunks_alongside_its_steps() -> None:
    """Chunks of 8 prompt tokens ride on the batch's steps; every request still gets its own greedy tokens,
    and a seeded sampled request joining that way gets the same tokens as alone."""
    model = tiny_llama(0)
    batch = BatchDecoder(model, chunk_tokens=8)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    alone = decoder(model, "pld").generate(repeating(27, 21), 20, sampling=sampled).token_ids
    blocks: dict[int, list[int]] = {}
    streams: list[GenerationStream] = []
    add(batch, decoder(model, "pld").stream(repeating(40, 20), 40), blocks, streams)   # alone: prefilled at once
    assert blocks[id(streams[0])] and not batch.prefilling
    add(batch, decoder(model, "pld").stream(repeating(35, 22), 25), blocks, streams)
    add(batch, decoder(model, "pld").stream(repeating(27, 21), 20, sampling=sampled), blocks, streams)
    assert blocks[id(streams[1])] == [] and len(batch.prefilling) == 2 and len(batch) == 3
    steps_to_join = 0
    while batch.prefilling and steps_to_join < 50:
        for stream, block in batch.step():
            blocks[id(stream)] += block
        steps_to_join += 1
    assert steps_to_join == 5 + 4, "35 prompt tokens in chunks of 8, then 27: one chunk per step"
    drain(batch, blocks, streams)
    for stream, max_new in zip(streams[:2], (40, 25), strict=True):
        ref = hf_greedy(model, stream.prompt_ids, max_new)
        assert_greedy_equal(model, stream.prompt_ids, stream.output.token_ids, ref)
        assert blocks[id(stream)] == stream.output.token_ids
    assert streams[2].output.token_ids == alone == blocks[id(streams[2])]


class _Flaky:
    """A proposer that raises on its `fail_at`-th proposal (a bug in one step), else delegates."""

    def __init__(self, inner: Any, fail_at: int):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, context: list[int], max_nodes: int) -> DraftTree:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected proposer bug")
        return self.inner.propose(context, max_nodes)


def test_one_requests_failing_step_ends_it_alone() -> None:
    """A bug in one request's own part of a step (here its proposer raising mid-batch, rows in the cache) ends
    that request with an error; the requests batched with it and those still queued get their exact tokens."""
    model = tiny_llama(0)
    scheduler = Scheduler(model, max_batch=3, max_waiting=8)
    try:
        streams, prompts = [], []
        for i, (length, seed) in enumerate([(40, 0), (30, 1), (35, 2), (33, 3), (28, 4)]):   # 3 run, 2 queue
            dec = decoder(model, "pld")
            if i == 1:
                dec.proposer = _Flaky(dec.proposer, fail_at=4)
            prompts.append(repeating(length, seed))
            streams.append(dec.stream(prompts[-1], 40))
        events = collect(scheduler, streams, timeout=60)
        assert [evs[-1][0] for evs in events] == ["done", "error", "done", "done", "done"]
        assert "injected proposer bug" in events[1][-1][1]
        assert scheduler.load() == (0, 0)
        for i in (0, 2, 3, 4):
            tokens = events[i][-1][1].token_ids
            assert_greedy_equal(model, prompts[i], tokens, hf_greedy(model, prompts[i], 40), label=f"request {i}")
            assert [t for kind, block in events[i] if kind == "tokens" for t in block] == tokens
    finally:
        scheduler.close()


def test_a_failing_shared_forward_ends_the_running_requests_and_spares_the_queued(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in the batch's one forward (a bug, out of memory) ends every request in that batch with an
    error, never a hang; the queued requests never touched it and are decoded exactly afterwards."""
    from rasd.decoding.model import fast_forward

    model = tiny_llama(0)
    real, calls = fast_forward.forward, {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_forward, "forward", flaky)
    scheduler = Scheduler(model, max_batch=2, max_waiting=8)
    try:
        prompts = [repeating(40, 0), repeating(30, 1), repeating(33, 3)]
        events = collect(scheduler, [decoder(model, "pld").stream(p, 30) for p in prompts], timeout=60)
        assert [evs[-1][0] for evs in events] == ["error", "error", "done"]
        assert "injected forward failure" in events[0][-1][1]
        assert_greedy_equal(model, prompts[2], events[2][-1][1].token_ids, hf_greedy(model, prompts[2], 30))
        assert scheduler.load() == (0, 0)
    finally:
        scheduler.close()


def test_a_stuck_loop_reports_stalled_and_recovers() -> None:
    """Work waiting while the compute thread is held by something that does not return: `stalled` (what
    /healthz turns into a 503); once the thread is free and the request done, healthy again."""
    model = tiny_llama(0)
    scheduler = Scheduler(model, max_batch=2, max_waiting=2)
    try:
        assert not scheduler.stalled(0.2), "idle is not stalled"
        blocker = scheduler.compute.call(time.sleep, 1.5)
        done = threading.Event()

        def sink(kind: str, _: Any) -> None:
            if kind in ("done", "error"):
                done.set()

        scheduler.submit(decoder(model, "ar").stream(random_prompt(8, 0), 4), sink)
        time.sleep(0.8)
        assert scheduler.stalled(0.5)
        blocker.result(10)
        assert done.wait(60)
        assert not scheduler.stalled(0.5)
    finally:
        scheduler.close()
