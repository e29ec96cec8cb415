"""Shared fixtures and helpers: tiny random Llama models, HF `generate` references, χ² helpers.

Tiny models run with one torch thread (`one_thread`): at this size thread start-up costs more than the
arithmetic, and two threads fighting another process for two cores made a tiny step ~50x slower.
Real-model tests keep torch's default threads (cost curves are cached per thread count).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

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
    return LlamaForCausalLM(config).eval()


def random_prompt(length: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int,
              eos_token_id: int | None = None) -> list[int]:
    """HF `generate` greedy: new tokens only (EOS included when produced).

    The attention mask and pad id are passed explicitly: HF otherwise infers a mask from the pad id, which
    silently masks prompt tokens that happen to equal it.
    """
    return list(_hf_greedy_cached(model, tuple(prompt), max_new_tokens, eos_token_id))


@lru_cache(maxsize=256)
def _hf_greedy_cached(model: torch.nn.Module, prompt: tuple[int, ...], max_new_tokens: int,
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


# Read-mostly parts of $RASD_HOME that are expensive to build (the converted embedded model, sample and
# benchmark indexes, trained exit layers, cached self-generations): linked from the real home, built once.
SHARED_HOME_PARTS = ("models", "indexes", "bench-indexes", "eesd", "ldlp", "selfgen")


@pytest.fixture(scope="session", autouse=True)
def rasd_home_for_tests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A session-scoped $RASD_HOME, so that what tests learn stays out of the developer's home.

    Why: the Token Recycling matrix and the cost curves are written back to $RASD_HOME, and `rasd serve`
    hot-starts from them; tests (random prompts, tiny models) would otherwise leave their matrix and a cost
    curve per temporary model there. Set in os.environ, so Ray workers and CLI subprocesses inherit it.
    """
    from rasd.decoding.model_loading import rasd_home

    real, before = rasd_home(), os.environ.get("RASD_HOME")
    home = tmp_path_factory.mktemp("rasd_home")
    for part in SHARED_HOME_PARTS:
        (real / part).mkdir(parents=True, exist_ok=True)
        (home / part).symlink_to(real / part, target_is_directory=True)
    os.environ["RASD_HOME"] = str(home)
    try:
        yield home
    finally:
        if before is None:
            os.environ.pop("RASD_HOME", None)
        else:
            os.environ["RASD_HOME"] = before


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The Serve app on a local Ray: real embedded model, a small real index, an API key.

    Session-scoped: test_serve.py and test_web.py share one app start (the model load dominates).
    """
    pytest.importorskip("ray.serve")
    httpx = pytest.importorskip("httpx")
    import ray
    from ray import serve

    from rasd.index import Document, build_index
    from rasd.serve.app import build_app
    from tests.serve_helpers import DOCS, KEY, free_port

    index = tmp_path_factory.mktemp("serve") / "index"
    build_index([Document(text=t, source=f"test:{title}", title=title) for title, t in DOCS], index)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a running cluster
    port = free_port()   # after ray.init: Ray's own processes take ephemeral ports while starting
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = {"index": str(index), "api_key": KEY, "max_batch": 4, "max_waiting": 1, "max_tokens_limit": 512,
              "threads": 2}
    serve.run(build_app(config), name="rasd-test", route_prefix="/")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=300)
    yield {"client": client, "url": f"http://127.0.0.1:{port}", "index": index}
    client.close()
    serve.shutdown()
    ray.shutdown()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run a tiny-model test with one torch thread, restoring the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
