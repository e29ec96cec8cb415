"""The draft model in DraftWorker Ray actors: `rasd` through a RemoteDraft decodes exactly like with the local
draft (same tokens, same accepted counts, = HF greedy); a killed worker costs drafts, never a token, and
drafting resumes after its restart; on a 2-node cluster the workers and retrieval shards land on the node
with the custom resources, with the same tokens as in-process."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rasd.decoding.proposers import DraftModelProposer, RasdProposer
from rasd.decoding.runtime.engine import GenerationOutput, SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.sampling import GREEDY
from rasd.distributed.draft_worker import DraftPool, DraftWorker, RemoteDraft, load_draft_model
from rasd.index.suffix_array import SuffixArray
from tests.helpers import TINY_VOCAB, assert_greedy_equal, fresh_tiny_llama, hf_greedy, random_prompt, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
TREE = {"top_k": 2, "width": 3, "min_prob": 0.0}   # a real tree, not only a chain
PATIENT_S = 30.0   # equality tests must not lose a draft to a busy machine: only the fault test times out


# ------------------------------------------------------------------------------------------------------
# Ray fixtures: a local Ray shared by the tests that want one; a 2-node cluster for the placement test
# ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _ray_down_after_module() -> Iterator[None]:
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_local() -> Iterator[None]:
    """A local Ray (never a running cluster), started once and shut down after the module."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield


@pytest.fixture
def two_nodes() -> Iterator[str]:
    """A head (1 CPU) and a second node (1 CPU, rasd_draft 1, rasd_retrieval 2); yields the second's id."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        node = cluster.add_node(num_cpus=1, resources={"rasd_draft": 1, "rasd_retrieval": 2})
        ray.init(address=cluster.address, log_to_driver=False)
        yield node.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


# ------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------

def corrupted_copies(prompt: list[int], ref: list[int], seed: int, vocab: int = TINY_VOCAB) -> list[list[int]]:
    """The prompt's tail + the reference continuation with ~12% of tokens replaced, plus noise documents."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(3):
        doc = torch.tensor(prompt[-6:] + list(ref))
        flip = torch.rand(len(doc), generator=gen) < 0.12
        flip[:6] = False
        doc[flip] = torch.randint(0, vocab, (int(flip.sum()),), generator=gen)
        docs.append(doc.tolist())
    return docs + [torch.randint(0, vocab, (50,), generator=gen).tolist() for _ in range(3)]


def decode(target: torch.nn.Module, proposer: Any, prompt: list[int], max_new: int) -> GenerationOutput:
    return SpeculativeDecoder(target, proposer, sizer=FixedSizer(16)).generate(prompt, max_new)


def same_run(ours: GenerationOutput, ref: GenerationOutput) -> None:
    """Same tokens and the same verification history (accepted per step, by source)."""
    assert ours.token_ids == ref.token_ids
    assert list(ours.stats.accept_lengths) == list(ref.stats.accept_lengths)
    assert dict(ours.stats.accepted_by_source) == dict(ref.stats.accepted_by_source)


def tiny_model_folder(folder: Path, layers: int = 2) -> tuple[Path, torch.nn.Module]:
    """A random Llama saved with a tiny BPE tokenizer (vocab 300): loadable by name, like a hub model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import make_tiny_tokenizer

    make_tiny_tokenizer(folder, vocab_size=300)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return folder, model


def wait_alive(actor: Any, timeout_s: float = 120.0) -> dict[str, Any]:
    """The worker's ping once it answers: calls fail at once (ActorUnavailableError) while it restarts."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.ping.remote(), timeout=max(deadline - time.monotonic(), 0.1))
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def wait_down(actor: Any, timeout_s: float = 30.0) -> None:
    """Until a call fails: the killed process is gone (its restart takes seconds more)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5.0)
        except ray.exceptions.RayError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed draft worker still answers")


def node_of(actor: Any) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: __import__("ray").get_runtime_context().get_node_id()))


# ------------------------------------------------------------------------------------------------------
# without Ray
# ------------------------------------------------------------------------------------------------------

def test_worker_serves_requests_like_local_proposers_and_recreates_unknown_ids() -> None:
    model = tiny_llama(0)
    worker = DraftWorker(model, draft_options=TREE, threads=None)
    local = DraftModelProposer(model, **TREE)
    prompt = random_prompt(20, 0)
    local.start(prompt, GREEDY)
    worker.start("a", prompt, GREEDY)
    for extra in ([], [5, 6], [5, 6, 7, 8]):
        context = prompt + extra
        ref, got = local.propose(context, 12), worker.propose("a", context, 12)
        assert (got.tokens, got.parents, got.sources) == (ref.tokens, ref.parents, ref.sources)
        torch.testing.assert_close(worker.root_probs("a", context), local.root_probs(context))
    # an id the worker never saw (it restarted): created on the fly, and it syncs to the context given
    fresh = worker.propose("unknown", prompt + [5, 6], 12)
    assert fresh.tokens == local.propose(prompt + [5, 6], 12).tokens
    assert worker.ping()["recreated"] == 1 and worker.ping()["requests"] == 2
    assert worker.finish("a") and not worker.finish("a")


def test_worker_keeps_a_bounded_number_of_requests() -> None:
    worker = DraftWorker(tiny_llama(0), threads=None, max_requests=2)
    for rid in "abc":
        worker.start(rid, [1, 2, 3], GREEDY)
    assert list(worker.requests) == ["b", "c"]


def test_remote_draft_backs_off_after_a_failure() -> None:
    """A dead actor: one failure, then "no draft" without asking until the back-off is over."""
    from ray.exceptions import RayActorError

    calls = []

    class Dead:
        def __getattr__(self, name: str) -> Any:
            def remote(*args: Any) -> Any:
                calls.append(name)
                raise RayActorError()
            return SimpleNamespace(remote=remote)

    now = [100.0]
    draft = RemoteDraft(Dead(), "r", backoff_s=5.0, clock=lambda: now[0])
    assert draft.propose([1, 2, 3], 8).tokens == [3]
    assert draft.root_probs([1, 2, 3]) is None
    assert (draft.stats.calls, draft.stats.failures, draft.stats.skipped) == (1, 1, 1)
    assert "RayActorError" in draft.stats.last_error
    now[0] += 6.0
    draft.propose([1, 2, 3], 8)
    assert calls == ["propose", "propose"] and draft.stats.failures == 2
    draft.finish()
    assert draft.propose([1, 2, 3], 8).tokens == [3] and calls == ["propose", "propose", "finish"]


def test_a_worker_stops_its_tree_where_the_callers_sizer_says_growing_does_not_pay() -> None:
    """The cost sizer's rule for the step travels with `propose`: refused, the worker grows no layer past the
    first; granted, it grows deeper; either way its tree is a first part of the one it grows unasked."""
    from tests.decoding.test_cost_control import flat, steep, trained_sizer

    model = tiny_llama(0)
    worker = DraftWorker(model, draft_options=TREE, threads=None)
    prompt = random_prompt(20, 0)
    worker.start("a", prompt, GREEDY)
    free = worker.propose("a", prompt, 12)
    assert max(free.depths()) > 1
    worker.propose("a", prompt, 12, grow=trained_sizer(steep, accept=True).grow_rule(len(prompt)))  # times a layer
    stopped = worker.propose("a", prompt, 12, grow=trained_sizer(steep, accept=True).grow_rule(len(prompt)))
    assert max(stopped.depths()) == 1 and stopped.tokens == free.tokens[:len(stopped)]
    granted = worker.propose("a", prompt, 12, grow=trained_sizer(flat, accept=True).grow_rule(len(prompt)))
    assert max(granted.depths()) > 1 and granted.parents == free.parents[:len(granted)]
    assert granted.tokens == free.tokens[:len(granted)]


def test_remote_draft_sends_its_sizers_rule_with_each_propose() -> None:
    from ray.exceptions import RayActorError

    from tests.decoding.test_cost_control import flat, trained_sizer

    sent: list[tuple[Any, ...]] = []

    class Recording:
        def __getattr__(self, name: str) -> Any:
            def remote(*args: Any) -> Any:
                sent.append((name, *args))
                raise RayActorError()
            return SimpleNamespace(remote=remote)

    draft = RemoteDraft(Recording(), "r", backoff_s=0.0)
    draft.propose([1, 2, 3], 8)
    assert sent[-1][-1] is None                                    # no sizer: the worker grows freely
    sizer = trained_sizer(flat, accept=True)
    draft.use_sizer(sizer)
    draft.propose([1, 2, 3], 8)
    rule = sent[-1][-1]
    assert rule.step_s == sizer.grow_rule(3).step_s and rule.estimator is sizer.estimator
    draft.use_sizer(FixedSizer(8))                                 # a sizer without the rule: none is sent
    draft.propose([1, 2, 3], 8)
    assert sent[-1][-1] is None


def test_rasd_takes_a_built_draft_but_not_both() -> None:
    draft = DraftModelProposer(tiny_llama(0))
    proposer = RasdProposer(draft_proposer=draft)
    # a local built draft's module is the engine's to install kernels on; a remote one has none (model None)
    assert proposer.draft is draft and proposer.probs_fn == draft.root_probs and proposer.model is draft.model
    assert RasdProposer(draft_proposer=RemoteDraft(object(), "r")).model is None
    with pytest.raises(ValueError, match="not both"):
        RasdProposer(draft_model=tiny_llama(0), draft_proposer=draft)


def test_eesd_spec_builds_the_self_draft(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`eesd:<target>`: the target's first layer + its exit layer from $RASD_HOME/eesd/<target>."""
    from rasd.decoding.proposers.early_exit import eesd_path, load_early_exit, new_exit_layer, save_exit_layer

    monkeypatch.setenv("RASD_HOME", str(tmp_path / "home"))
    folder, target = tiny_model_folder(tmp_path / "model", layers=3)
    save_exit_layer(eesd_path(str(folder)), new_exit_layer(target, 1), 1)
    draft = load_draft_model(f"eesd:{folder}")
    ref = load_early_exit(target, eesd_path(str(folder)), str(folder))
    assert draft.config.num_hidden_layers == 2
    ids = torch.tensor([[1, 5, 9, 4]])
    with torch.inference_mode():
        torch.testing.assert_close(draft(ids).logits, ref(ids).logits)


def test_service_config_names_the_worker_model() -> None:
    from rasd.serve.service import ServeConfig, decoding_settings

    def spec(**kw: Any) -> str:
        return decoding_settings(ServeConfig(**kw)).draft_worker_spec()

    assert spec(model="m") == "eesd:m"                       # no EAGLE head for m: its self-draft
    assert spec(model="default") == "eagle:default"          # the shipped head, as `rasd` drafts in-process
    assert spec(model="default", draft_model="eesd") == "eesd:default"
    assert spec(model="m", draft_model="d") == "d"
    assert spec(model="m", draft_model="d", draft_worker_model="w") == "w"
    assert spec(model="m", draft_model="eesd") == "eesd:m"   # the self-draft spec names no separate model


def test_serve_flags_reach_the_config() -> None:
    from rasd.errors import CliError
    from rasd.serve.config import ServeConfig
    from rasd.serve.options import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--draft-workers", "2", "--draft-model", "d",
                              "--draft-worker-resources", '{"rasd_draft": 1}'])
    config = ServeConfig.from_args(args)
    assert config.draft_workers == 2 and config.draft_worker_options == {"resources": {"rasd_draft": 1}}
    assert config.draft_worker_model is None
    with pytest.raises(CliError, match="JSON"):
        ServeConfig.from_args(parser.parse_args(["serve", "--draft-worker-resources", "{rasd_draft"]))
    with pytest.raises(CliError, match="rasd train eesd"):   # no draft model: the self-draft needs its weights
        ServeConfig.from_args(parser.parse_args(["serve", "--model", "/nowhere/model", "--draft-workers", "1"]))


# ------------------------------------------------------------------------------------------------------
# a real local Ray
# ------------------------------------------------------------------------------------------------------

def test_remote_draft_decodes_like_the_local_draft(ray_local: None) -> None:
    """Same tokens, same accepted counts per step and source, = HF greedy; for a self and an unrelated draft."""
    pools = {name: DraftPool(model, 1, draft_options=TREE, timeout_s=PATIENT_S, named=False)
             for name, model in (("self", fresh_tiny_llama(0)), ("other", fresh_tiny_llama(99)))}
    try:
        target = tiny_llama(0)
        for name, pool in pools.items():
            draft_model = tiny_llama(0) if name == "self" else tiny_llama(99)
            for seed, length in ((0, 7), (1, 40)):
                prompt = random_prompt(length, seed)
                ref = hf_greedy(target, prompt, 40)
                store = SuffixArray.from_documents(corrupted_copies(prompt, ref, seed))
                local = decode(target, RasdProposer([store], draft_model=draft_model, draft_options=TREE), prompt, 40)
                remote = decode(target, RasdProposer([store], draft_proposer=pool.remote_draft()), prompt, 40)
                assert_greedy_equal(target, prompt, remote.token_ids, ref, label=f"{name} seed={seed}")
                same_run(remote, local)
                if name == "self":   # its nodes are verified (those the copies also propose are credited to them)
                    assert remote.stats.drafted_by_source["draft"] > 0
            stats = pool.stats()
            assert stats["failures"] == 0 and stats["calls"] > 0 and stats["count"] == 1
    finally:
        for pool in pools.values():
            pool.close()


def test_killed_worker_costs_drafts_not_tokens_and_drafting_resumes(ray_local: None) -> None:
    """The worker dies between steps: the next steps have no draft (same tokens); after the restart the
    request's draft state is re-created on the fly and drafts get accepted again."""
    import ray

    target = tiny_llama(0)
    prompt = random_prompt(24, 5)
    pool = DraftPool(fresh_tiny_llama(0), 1, draft_options={"min_prob": 0.0}, timeout_s=5.0, backoff_s=0.2)
    try:
        actor = ray.get_actor("rasd-draft-0", namespace="rasd")     # the name a fault script uses
        assert ray.get(actor.propose.remote("warm", prompt, 8)).num_draft_tokens > 0   # first forwards: slow
        remote = pool.remote_draft("fault")
        stream = SpeculativeDecoder(target, RasdProposer(draft_proposer=remote), sizer=FixedSizer(16)).stream(
            prompt, 120)
        for _ in range(3):
            next(stream)
        assert "draft" in stream.token_sources, pool.stats()
        pid = ray.get(actor.ping.remote())["pid"]
        ray.kill(actor, no_restart=False)                             # a crash: Ray restarts the worker
        wait_down(actor)                                              # the kill is asynchronous
        down = len(stream.token_sources)
        next(stream)                                                  # this step's draft call fails
        assert remote.stats.failures >= 1
        assert "draft" not in stream.token_sources[down:]             # no draft (other sources may guess)
        info = wait_alive(actor)                                      # the restarted worker
        assert info["pid"] != pid
        time.sleep(0.3)                                               # past the back-off
        up = len(stream.token_sources)
        for _ in stream:
            pass
        assert stream.output.token_ids == hf_greedy(target, prompt, 120)
        assert "draft" in stream.token_sources[up:], "drafting did not resume after the restart"
        assert ray.get(actor.ping.remote())["recreated"] >= 1
        assert pool.stats()["failures"] >= 1 and pool.stats()["names"] == ["rasd-draft-0"]
    finally:
        pool.close()


@pytest.mark.slow
def test_service_drafts_in_named_workers_and_reports_them(ray_local: None, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`ServeConfig.draft_workers`: a `rasd` request drafts in rasd-draft-0 (same tokens as the in-replica
    draft); /v1/info's `draft_workers` lists the worker and its calls."""
    import asyncio

    from rasd.index.writer import build_index
    from rasd.serve.openai import CompletionRequest
    from rasd.serve.service import ServeConfig, Service
    from tests.helpers import TOPICS, topic_documents

    monkeypatch.setenv("RASD_HOME", str(tmp_path / "home"))
    folder = str(tiny_model_folder(tmp_path / "model")[0])
    root = tmp_path / "idx"
    build_index(topic_documents()[:2], root, model=folder, chunk_tokens=24, overlap=6)
    req = CompletionRequest(prompt=TOPICS["rockets"][:90], max_tokens=24, method="rasd", temperature=0.0)
    outs, info = {}, None
    for workers in (0, 1):
        config = ServeConfig(model=folder, index=str(root), threads=1, draft_workers=workers,
                             **({"draft_worker_model": folder} if workers else {"draft_model": folder}))
        service = Service(config)
        try:
            ids = service.encode_text(req.prompt)
            outs[workers] = asyncio.run(service.run(service.prepare(req, ids, "rasd", 24))).token_ids
            info = service.info()["draft_workers"]
        finally:
            service.close()
    assert outs[1] == outs[0]
    assert info["count"] == 1 and info["names"] == ["rasd-draft-0"] and info["namespace"] == "rasd"
    assert info["calls"] > 0 and info["failures"] == 0


# ------------------------------------------------------------------------------------------------------
# two nodes
# ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_node_cluster_routes_workers_by_resource(two_nodes: str, tmp_path: Path) -> None:
    """Draft worker (rasd_draft) and retrieval shards (rasd_retrieval) on the second node; same tokens as
    the same decoding in-process."""
    from rasd.distributed.retrieval import ShardedIndex
    from rasd.index import Index
    from rasd.index.writer import add_documents, build_index
    from tests.helpers import make_tiny_tokenizer, topic_documents

    tok = str(make_tiny_tokenizer(tmp_path / "tok", vocab_size=300))
    root = tmp_path / "idx"
    docs = topic_documents()
    build_index(docs[:3], root, model=tok, chunk_tokens=24, overlap=6)
    add_documents(root, docs[3:])
    local = Index.open(root)
    target = tiny_llama(3, vocab=300)
    pool = DraftPool(fresh_tiny_llama(3, vocab=300), 1, {"resources": {"rasd_draft": 1}}, draft_options=TREE,
                     timeout_s=PATIENT_S)
    sharded = ShardedIndex(root, 2, actor_options={"resources": {"rasd_retrieval": 1}},
                           lookup_timeout_s=PATIENT_S)
    try:
        assert [node_of(a) for a in pool.actors] == [two_nodes]
        assert pool.wait_ready()[0]["node_id"] == two_nodes
        assert len(sharded.actors) == 2 and {node_of(a) for a in sharded.actors} == {two_nodes}
        for doc in (0, 4):
            prompt = local.document_tokens([doc])[0][:30]
            ref = decode(target, RasdProposer(local.datastores(), draft_model=target, draft_options=TREE), prompt,
                         32)
            out = decode(target, RasdProposer(sharded.datastores(), draft_proposer=pool.remote_draft()), prompt, 32)
            assert_greedy_equal(target, prompt, out.token_ids, hf_greedy(target, prompt, 32), label=f"doc {doc}")
            same_run(out, ref)
        assert sharded.lookups.calls > 0 and sharded.lookups.misses == 0
        assert pool.stats()["failures"] == 0
    finally:
        sharded.close()
        pool.close()


@pytest.mark.parametrize("fused", [False, True], ids=["final", "fused"])
def test_a_head_in_draft_workers_decodes_like_the_local_head(ray_local: None, fused: bool) -> None:
    """`rasd` drafting with the EAGLE head in a worker (the target's features travel with each call) runs
    the same steps as with the head in-process, and equals HF greedy; a fused head (EAGLE-3) is sent the
    tapped layers' features too."""
    from rasd.decoding.model.eagle_head import EagleHead
    from rasd.decoding.proposers.eagle import EagleProposer
    from tests.decoding.test_eagle import trained_head
    from tests.decoding.test_eagle_taps import TAPS, fused_head

    target = fresh_tiny_llama(0) if fused else tiny_llama(0)   # a tap with layers stays on its target
    local_head = fused_head(target) if fused else trained_head(0)
    worker_head = EagleHead(fresh_tiny_llama(0), taps=local_head.taps)   # a fresh target: the cached one
    worker_head.load_state_dict(local_head.state_dict())                 # carries a feature hook
    pool = DraftPool(worker_head.eval(), 1, draft_options={"min_prob": 0.0}, named=False, timeout_s=PATIENT_S)
    try:
        assert pool.wants_hidden and pool.feature_layers == (TAPS if fused else ())
        store = SuffixArray.from_documents([random_prompt(60, 70 + i) for i in range(3)])
        prompt = random_prompt(30, 8)
        local = EagleProposer(local_head, min_prob=0.0)
        ref = decode(target, RasdProposer([store], draft_proposer=local), prompt, 30)
        got = decode(target, RasdProposer([store], draft_proposer=pool.remote_draft()), prompt, 30)
        same_run(got, ref)
        assert_greedy_equal(target, prompt, got.token_ids, hf_greedy(target, prompt, 30), "rasd + remote head")
        assert ref.stats.accepted_by_source.get("eagle", 0) > 0, "the head's drafts were accepted"
        assert pool.stats()["failures"] == 0
    finally:
        pool.close()
