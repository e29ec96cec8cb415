"""The index split over RetrievalShard actors on a real local Ray cluster: same answers as the in-process
Index, and a killed shard never costs a wrong token or a hang (search waits for the restart, lookups miss)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.distributed.retrieval import ShardedIndex, assign_segments
from rasd.index import Index
from rasd.index.writer import add_documents, build_index
from tests.helpers import hf_greedy, make_tiny_tokenizer, tiny_llama, topic_documents

pytestmark = pytest.mark.slow
QUERIES = ["how does a rocket reach orbit", "baking a loaf", "what do kittens learn", "lava and ash"]
VOCAB = 300


def test_assign_segments_round_robin_never_empty() -> None:
    assert assign_segments(["a", "b", "c"], 2) == [["a", "c"], ["b"]]
    assert assign_segments(["a"], 4) == [["a"]]
    assert assign_segments(["a", "b"], 0) == [["a", "b"]]


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def three_segments(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = str(make_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=VOCAB))
    root = tmp_path_factory.mktemp("sharded") / "idx"
    docs = topic_documents()
    build_index(docs[:2], root, model=tok, chunk_tokens=24, overlap=6)
    add_documents(root, docs[2:4])
    add_documents(root, docs[4:])
    return root


def test_sharded_index_answers_like_the_local_index(ray_local: None, three_segments: Path) -> None:
    local = Index.open(three_segments)
    sharded = ShardedIndex(three_segments, num_shards=2)
    try:
        assert len(sharded.actors) == 2 and sharded.num_documents == local.num_documents
        assert sharded.num_chunks == local.num_chunks and sharded.num_tokens == local.num_tokens
        for q in QUERIES:
            got, ref = sharded.search(q, k=4), local.search(q, k=4)
            assert [(h.doc_id, h.chunk_id, h.text) for h in got] == [(h.doc_id, h.chunk_id, h.text) for h in ref]
            np.testing.assert_allclose([h.score for h in got], [h.score for h in ref], atol=1e-5)
        ids = [5, 0, 3, 1]
        assert sharded.document_tokens(ids) == local.document_tokens(ids)
        assert [d.title for d in sharded.documents(ids)] == [d.title for d in local.documents(ids)]
        with pytest.raises(KeyError, match="no document"):
            sharded.document_tokens([99])
        rng = random.Random(0)
        remote = sharded.datastores()
        for _ in range(30):     # the longest match over all shards = the longest over all local segments
            toks = local.document_tokens([rng.randrange(6)])[0]
            s = rng.randrange(4, len(toks) - 2)
            context = [7, 8] + toks[s - rng.randrange(2, 5): s]
            best_local = max(ds.lookup(context, 16, 4)[0] for ds in local.datastores())
            best_remote = max(ds.lookup(context, 16, 4)[0] for ds in remote)
            assert best_remote == best_local > 0
        assert sharded.lookups.misses == 0
    finally:
        sharded.close()


def test_killed_shard_search_waits_for_the_restart(ray_local: None, three_segments: Path) -> None:
    import ray

    local = Index.open(three_segments)
    sharded = ShardedIndex(three_segments, num_shards=3)
    try:
        pid = ray.get(sharded.actors[0].pid.remote())
        ray.kill(sharded.actors[0], no_restart=False)          # a crash: Ray restarts the actor
        hits = sharded.search(QUERIES[0], k=4)                 # search is retried on the restarted shard
        assert [h.chunk_id for h in hits] == [h.chunk_id for h in local.search(QUERIES[0], k=4)]
        assert ray.get(sharded.actors[0].pid.remote()) != pid
    finally:
        sharded.close()


def test_dead_shard_lookups_miss_fast_and_decoding_stays_exact(ray_local: None, three_segments: Path) -> None:
    import ray

    local = Index.open(three_segments)
    sharded = ShardedIndex(three_segments, num_shards=3)
    target = tiny_llama(3, vocab=VOCAB)
    prompt = local.document_tokens([0])[0][:30]
    proposer = make_proposer("retrieval", datastores=sharded.datastores())
    decoder = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16))
    try:
        ref = hf_greedy(target, prompt, 24)
        assert decoder.generate(prompt, 24).token_ids == ref
        assert sharded.lookups.calls > 0 and sharded.lookups.misses == 0
        for actor in sharded.actors:
            ray.kill(actor, no_restart=True)                   # every shard gone for good
        start = time.monotonic()
        out = decoder.generate(prompt, 24)
        assert out.token_ids == ref                            # no drafts from the datastore, same tokens
        assert sharded.lookups.misses > 0
        assert time.monotonic() - start < 30                   # a dead shard answers "no match" at once
        assert out.stats.accepted_by_source.get("datastore", 0) == 0
        with pytest.raises(ray.exceptions.RayActorError):      # search cannot do without its shards
            sharded.search(QUERIES[0], k=4)
    finally:
        sharded.close()


def test_refresh_picks_up_a_new_segment(ray_local: None, tmp_path: Path, three_segments: Path) -> None:
    import shutil

    root = tmp_path / "idx"
    shutil.copytree(three_segments, root)
    sharded = ShardedIndex(root, num_shards=2)
    try:
        before = sharded.num_documents
        add_documents(root, topic_documents()[:1])
        sharded.refresh()
        assert sharded.num_documents == before + 1 == Index.open(root).num_documents
        assert sharded.document_tokens([before]) == Index.open(root).document_tokens([before])
    finally:
        sharded.close()


def test_service_with_sharded_index_answers_like_in_process(ray_local: None, tmp_path: Path) -> None:
    """The real model and a two-segment index: /v1/docqa's logic with 2 shards = with the local index."""
    import asyncio

    from rasd.serve.openai import DocQARequest
    from rasd.serve.service import ServeConfig, Service

    root = tmp_path / "idx"
    docs = topic_documents()
    build_index(docs[:3], root, model="default")
    add_documents(root, docs[3:])
    req = DocQARequest(question="How does a rocket reach orbit?", max_tokens=24, top_k_sources=2)
    answers = {}
    for shards in (0, 2):
        service = Service(ServeConfig(model="default", index=str(root), retrieval_shards=shards, threads=1))
        try:
            ids, sources = service.docqa_prompt(req.question, req.top_k_sources, req.max_tokens)
            out = asyncio.run(service.run(service.prepare(req, ids, "rasd", 24, sources)))
            answers[shards] = (ids, [(s.doc_id, s.chunk_id) for s in sources], out.token_ids)
        finally:
            service.backend.scheduler.close()
            if shards:
                service.index.close()
    assert answers[2] == answers[0]


def test_a_shard_that_hangs_costs_a_503_not_an_endless_wait(ray_local: None) -> None:
    """Every call to the shards has a deadline: a hung actor turns into ApiError 503 within it."""
    import ray

    from rasd.distributed.retrieval import _get
    from rasd.errors import ApiError

    @ray.remote
    class Hung:
        def search_vectors(self, *_: object) -> list:
            time.sleep(30)
            return []

    actor = Hung.remote()
    start = time.monotonic()
    with pytest.raises(ApiError) as err:
        _get([actor.search_vectors.remote(None, 1)], 1.0, "searching")
    assert err.value.status == 503 and "did not finish searching" in err.value.message
    assert time.monotonic() - start < 10
    ray.kill(actor)
