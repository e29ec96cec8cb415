"""What tests share, in one module: tiny random Llama models and HF `generate` references, χ² helpers, a small
topical corpus with a tiny BPE tokenizer (index tests), the Serve tests' corpus and key, bench/ tools loaded as
modules, and throwaway Ray heads (free ports, killing a process session). Fixtures live in conftest.py.

Tiny models run with one torch thread (conftest's `one_thread`): at this size thread start-up costs more than
the arithmetic, and two threads fighting another process for two cores made a tiny step ~50x slower.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import time
import weakref
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from rasd.index import Document

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- tiny models

TINY_VOCAB = 96


@cache
def tiny_llama(seed: int, vocab: int = TINY_VOCAB, init: float = 0.02, max_positions: int = 512) -> torch.nn.Module:
    """A 2-layer random Llama (fp32, eval). No bos/eos/pad ids, so HF `generate` never stops by itself.

    Cached per arguments: the same object is shared by every test (nothing mutates weights; the engine's
    `install()` only adds a switchable Linear forward that is inert outside `fast_kernels()`).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=max_positions,
                         initializer_range=init, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.inference_mode(False):   # first built inside a test's inference block, its weights could never
        return LlamaForCausalLM(config).eval()   # take part in a later test's autograd (training tests)


def fresh_tiny_llama(seed: int, **options: object) -> torch.nn.Module:
    """`tiny_llama`'s weights in a new object, for models sent to Ray actors: the shared cached one may have
    been called with `output_hidden_states`, after which transformers keeps output-capturing hooks on its
    layers that hold a ContextVar, and such a model can no longer be pickled."""
    return tiny_llama.__wrapped__(seed, **options)


def random_prompt(length: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int,
              eos_token_id: int | None = None) -> list[int]:
    """HF `generate` greedy: new tokens only (EOS included when produced).

    The attention mask and pad id are passed explicitly: HF otherwise infers a mask from the pad id, which
    silently masks prompt tokens that happen to equal it.
    """
    key = (tuple(prompt), max_new_tokens, eos_token_id)
    answers = _HF_GREEDY.setdefault(model, {})
    if key not in answers:
        answers[key] = _hf_greedy_run(model, *key)
    return list(answers[key])


# model -> {(prompt, max_new_tokens, eos): tokens}: parametrized tests share a reference, and it dies with its model.
# Why weak: an lru_cache keyed by the model kept every embedded model a test ever loaded (≈ 2 GB each with its
# packed and stacked weights): the suite's process grew to 17.7 GB, and Ray's memory monitor killed replicas.
_HF_GREEDY: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[Any, ...], tuple[int, ...]]] = \
    weakref.WeakKeyDictionary()


def _hf_greedy_run(model: torch.nn.Module, prompt: tuple[int, ...], max_new_tokens: int,
                   eos_token_id: int | None) -> tuple[int, ...]:
    x = torch.tensor([list(prompt)], dtype=torch.long)
    pad = 0 if eos_token_id is None else eos_token_id
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad)
    return tuple(out[0, len(prompt):].tolist())


def top2_gap(model: torch.nn.Module, ids: Sequence[int]) -> float:
    """Gap between the two largest next-token logits after `ids` (a plain, uncached forward)."""
    with torch.inference_mode():
        logits = model(torch.tensor([list(ids)], dtype=torch.long)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_greedy_equal(model: torch.nn.Module, prompt: Sequence[int], ours: Sequence[int],
                        ref: Sequence[int], label: str = "") -> None:
    """Token-for-token equality; a difference passes only at a genuine near-tie of the reference.

    docs/architecture.md: a batched/tree forward sums in another order (~1e-7), which can flip an argmax only when the
    reference's top-2 logits are within 1e-4; anything else is a bug. After such a flip the sequences
    legitimately diverge, so only the first difference is judged.
    """
    ours, ref = list(ours), list(ref)
    n = min(len(ours), len(ref))
    first = next((i for i in range(n) if ours[i] != ref[i]), None)
    if first is None:
        assert len(ours) == len(ref), f"{label}: same tokens but lengths {len(ours)} != {len(ref)}"
        return
    gap = top2_gap(model, list(prompt) + ref[:first])
    print(f"{label}: first difference at new token {first}: ours {ours[first]} vs reference {ref[first]}; "
          f"reference top-2 logit gap there = {gap:.3g}")
    assert gap < 1e-4, (f"{label}: greedy output differs from the reference at new token {first} "
                        f"(ours {ours[first]}, ref {ref[first]}) and the reference's top-2 gap {gap:.3g} "
                        f"is not a near-tie (< 1e-4)\nours {ours}\nref  {ref}")


def pooled_chisquare(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """χ² goodness-of-fit p-value; cells with expected count < `min_expected` are pooled into one cell."""
    from scipy.stats import chisquare

    observed = np.asarray(observed, dtype=float).ravel()
    probs = np.asarray(expected_probs, dtype=float).ravel()
    probs = probs / probs.sum()
    n = observed.sum()
    expected = probs * n
    big = expected >= min_expected
    obs_cells = list(observed[big])
    exp_cells = list(expected[big])
    if (~big).any():
        obs_cells.append(observed[~big].sum())
        exp_cells.append(expected[~big].sum())
        if exp_cells[-1] < min_expected and len(exp_cells) > 2:   # merge a tiny pool into the smallest cell
            j = int(np.argmin(exp_cells[:-1]))
            exp_cells[j] += exp_cells.pop()
            obs_cells[j] += obs_cells.pop()
    assert len(exp_cells) >= 2, "need at least two cells for a χ² test"
    return float(chisquare(obs_cells, exp_cells).pvalue)


def pooled_homogeneity(a: np.ndarray, b: np.ndarray, min_count: float = 10.0) -> float:
    """χ² test that two count vectors come from one distribution; cells rarer than `min_count` are pooled."""
    from scipy.stats import chi2_contingency

    a = np.asarray(a, dtype=float).ravel()
    b = np.asarray(b, dtype=float).ravel()
    both = a + b
    big = both >= min_count
    rows = [list(a[big]), list(b[big])]
    if (~big).any() and both[~big].sum() > 0:
        rows[0].append(a[~big].sum())
        rows[1].append(b[~big].sum())
    table = np.array(rows)
    table = table[:, table.sum(0) > 0]
    assert table.shape[1] >= 2, "need at least two cells for a χ² test"
    return float(chi2_contingency(table, correction=False).pvalue)


# ---------------------------------------------------------------------------------------------- index corpus

TOPICS = {
    "rockets": "A rocket engine burns fuel and oxidizer to produce thrust. The first stage lifts the vehicle "
               "off the launch pad, and the second stage carries the payload into orbit around the Earth. ",
    "bread": "To bake bread, mix flour, water, salt and yeast into a dough. Knead the dough, let it rise for "
             "an hour, shape the loaf and bake it in a hot oven until the crust is brown. ",
    "cats": "Cats are small carnivorous mammals. A cat sleeps for most of the day, hunts mice at night and "
            "purrs when it is content. Kittens learn to hunt by watching their mother. ",
    "rivers": "A river flows from its source in the mountains down to the sea. Along the way it carves "
              "valleys, deposits sediment in its delta and floods the plains in spring. ",
    "chess": "Chess is a board game for two players. Each player starts with sixteen pieces; the goal is to "
             "checkmate the opposing king. The opening, middlegame and endgame need different plans. ",
    "volcano": "A volcano erupts when magma rises through the crust. Lava, ash and gas escape from the vent, "
               "and the cone grows with every eruption over thousands of years. ",
}


def topic_documents(repeat: int = 3) -> list[Document]:
    """One document per topic, its paragraph repeated so documents span several chunks."""
    return [Document(text=(text * repeat).strip(), source=f"mem://{name}", title=name.title())
            for name, text in TOPICS.items()]


def make_tiny_tokenizer(folder: Path, vocab_size: int = 300) -> Path:
    """Train a byte-level BPE on the topic corpus and save it like a hub model (loadable by AutoTokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(TOPICS.values()) * 4, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------- serve

KEY = "test-key"
DOCS = [
    ("Bridges", "The Forth Bridge is a cantilever railway bridge across the Firth of Forth in Scotland. It was "
                "designed by John Fowler and Benjamin Baker and opened in 1890. It is 2,467 metres long."),
    ("Tea", "Green tea is made from leaves that are not withered and oxidised like black tea. It is brewed at "
            "about 80 degrees Celsius for two to three minutes."),
    ("Glaciers", "A glacier is a persistent body of dense ice that moves under its own weight. Glaciers form "
                 "where snow accumulates faster than it melts over many years."),
]
QUESTION = "Who designed the Forth Bridge and when did it open?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------------ bench


def load_script(name: str) -> ModuleType:
    """bench/<name>.py as a module, so tests call its functions instead of spawning it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- ray heads

def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def kill_session(sid: int) -> None:
    """Stop every process of the head's own session (the head, GCS, raylet, dashboard, workers), by id."""
    def members() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[3]) == sid:   # field 6: session id
                    pids.append(int(entry.name))
        return pids

    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 3.0)):   # a throwaway cluster: no grace needed
        for pid in members():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while members() and time.time() < deadline:
            time.sleep(0.2)
