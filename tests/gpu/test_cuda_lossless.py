"""Lossless on CUDA: every method's greedy output equals HF `generate` greedy on the same device.

Why a separate module: CI has no GPU and the other tests pin tiny models to the CPU; on a machine with CUDA
this runs with the rest (`pytest tests/gpu`), and without CUDA it is skipped. It checks tiny random Llamas
(several seeds, fp32 and bf16) on the eager path and on static shapes replayed as CUDA graphs, a captured batch
whose rows join and leave, a fused EAGLE-3 head's features after a graph replay, and the embedded default
model (slow). A difference passes only at a near-tie of the reference's top-2 logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rasd.decoding.model.static_step import StepConfig
from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEVICE = "cuda"
VOCAB = 200
PATHS = {"eager": StepConfig(), "graphs": StepConfig(static=True, graphs=True)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TINY_METHODS = ("ar", "pld", "draft", "optree", "recycling", "retrieval", "rasd", "rasd-draft", "eesd",
                "adaeagle", "adaeagle-eesd", "eagle", "rasd-eagle")
SEEDS = (0, 1, 2)


def tiny_llama(seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """A small random Llama on CUDA; weights scaled up so greedy output is not one repeated token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, max_position_embeddings=1024,
                      initializer_range=0.05, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).to(device=DEVICE, dtype=dtype).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """HF `generate` greedy on the model's device (explicit mask: see tests/helpers.py)."""
    x = torch.tensor([prompt], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_equal_or_tie(model: torch.nn.Module, prompt: list[int], ours: list[int], ref: list[int],
                        label: str) -> None:
    """Token-for-token equality; a first difference passes only where the reference's top-2 logits tie
    within the rounding of the model's dtype (fp32: 1e-4 as on the CPU; bf16: two units in the last place)."""
    first = next((i for i in range(min(len(ours), len(ref))) if ours[i] != ref[i]), None)
    if first is None:
        assert len(ours) == len(ref), f"{label}: lengths {len(ours)} != {len(ref)}"
        return
    x = torch.tensor([prompt + ref[:first]], device=next(model.parameters()).device)
    with torch.inference_mode():
        top = model(x).logits[0, -1].float().topk(2).values
    dtype = next(model.parameters()).dtype
    tie = 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * max(1.0, abs(float(top[0])))
    gap = float(top[0] - top[1])
    assert gap < tie, f"{label}: differs at new token {first} (top-2 gap {gap:.3g}, not a tie)\n{ours}\n{ref}"


def case(seed: int) -> tuple[list[int], list[int]]:
    """A prompt whose start repeats (pld finds drafts) and its random tail."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    return base, base * 3 + torch.randint(0, VOCAB, (5,), generator=gen).tolist()


def tiny_proposer(method: str, target: torch.nn.Module, draft: torch.nn.Module, docs: list[list[int]],
                  files: Path) -> object:
    """The proposer for one method on a tiny model: datastores, recycling matrix and self-draft weights built
    here (random exit layer, LDLP and head: losslessness does not depend on how good a drafter is)."""
    from rasd.decoding.model.eagle_head import EagleHead
    from rasd.decoding.proposers.early_exit import new_exit_layer, save_exit_layer
    from rasd.decoding.proposers.recycling import RecyclingMatrix
    from rasd.decoding.sizing.ldlp import LengthPredictor
    from rasd.index.suffix_array import SuffixArray

    if method in ("eesd", "adaeagle", "adaeagle-eesd"):     # adaeagle drafts with the head, or with the self-draft
        exit_path, ldlp_path = files / "exit.safetensors", files / "ldlp.safetensors"
        save_exit_layer(exit_path, new_exit_layer(target, 1), 1)
        LengthPredictor(target.config.hidden_size, width=16, k_max=6).save(ldlp_path)
        options = {"head": EagleHead(target).eval()} if method == "adaeagle" else {"drafter": "eesd"}
        return make_proposer(method.removesuffix("-eesd"), target_model=target, eesd=exit_path, ldlp=ldlp_path,
                             **(options if method != "eesd" else {}))
    if method in ("eagle", "rasd-eagle"):   # an untrained head: the features' path, captured or not, is what counts
        head = make_proposer("eagle", head=EagleHead(target).eval(), min_prob=0.0)
        if method == "eagle":
            return head
        return make_proposer("rasd", datastores=[SuffixArray.from_documents(docs)], draft_proposer=head)
    stores = [SuffixArray.from_documents(docs)] if method in ("retrieval", "rasd", "rasd-draft") else None
    recycling = RecyclingMatrix(VOCAB) if method in ("recycling", "rasd", "rasd-draft") else None
    use_draft = method in ("draft", "optree", "rasd-draft")
    return make_proposer("rasd" if method == "rasd-draft" else method, draft_model=draft if use_draft else None,
                         datastores=stores, recycling=recycling)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("method", TINY_METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_method_equals_hf_greedy(dtype: str, method: str, path: str, seed: int, tmp_path: Path) -> None:
    target, draft = tiny_llama(seed, DTYPES[dtype]), tiny_llama(99, DTYPES[dtype])
    base, prompt = case(seed)
    ref = hf_greedy(target, prompt, 48)
    docs = [prompt[-6:] + ref, ref[10:] + base]      # a datastore that holds the answer: drafts get accepted
    proposer = tiny_proposer(method, target, draft, docs, tmp_path)
    dec = SpeculativeDecoder(target, proposer, sizer=FixedSizer(0 if method == "ar" else 16), step=PATHS[path])
    out = dec.generate(prompt, max_new_tokens=48)
    assert_equal_or_tie(target, prompt, out.token_ids, ref, f"{dtype} {method} {path} seed {seed}")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_captured_batch_with_rows_joining_and_leaving(dtype: str, seed: int, tmp_path: Path) -> None:
    target, draft = tiny_llama(seed, DTYPES[dtype]), tiny_llama(99, DTYPES[dtype])
    base, prompt = case(seed)
    docs = [prompt[-6:] + hf_greedy(target, prompt, 48), base]
    batch = BatchDecoder(target, slots=2, step=PATHS["graphs"])            # slots grow as rows join
    plan = [("pld", prompt, 40), ("ar", prompt[5:], 9), ("recycling", prompt[:20], 30), ("rasd", prompt, 44)]
    streams = []
    for i, (method, ids, n) in enumerate(plan):
        dec = SpeculativeDecoder(target, tiny_proposer(method, target, draft, docs, tmp_path), sizer=FixedSizer(16),
                                 step=PATHS["graphs"])
        streams.append(dec.stream(ids, n))
        batch.add(streams[-1])
        for _ in range(3 if i < 2 else 0):       # the first two decode a while before the others join
            batch.step()
    for _ in range(400):
        if not len(batch):
            break
        batch.step()
    for (method, ids, n), stream in zip(plan, streams, strict=True):
        assert stream.output is not None, f"{method} never finished"
        assert_equal_or_tie(target, ids, stream.output.token_ids, hf_greedy(target, ids, n), f"batch {method}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fused_head_is_handed_the_teachers_features(dtype: str, path: str) -> None:
    """A fused EAGLE-3 head (layer 0 tapped, its map random so the tapped values matter): a graph replay runs no
    hooks, so the captured step must hand over the stacked features itself."""
    from rasd.decoding.model.eagle_head import EagleHead
    from rasd.train.eagle_head import extract_features

    target = tiny_llama(0, DTYPES[dtype])
    _, prompt = case(0)
    head = EagleHead(target, taps=(0,)).eval()
    with torch.no_grad():
        head.fc_taps.weight.normal_(std=0.05)
    proposer = make_proposer("eagle", head=head, min_prob=0.0)
    out = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16), step=PATHS[path]).generate(prompt, 48)
    assert_equal_or_tie(target, prompt, out.token_ids, hf_greedy(target, prompt, 48), f"fused {dtype} {path}")
    teacher = extract_features(target, [prompt + out.token_ids], None, batch=1, shard=1, taps=(0,))["feats"][0]
    fed, start = proposer.feats, proposer.feat_start
    gap = float((fed[: len(teacher) - start].float().cpu() - teacher[start: start + len(fed)].float()).abs().max())
    assert gap < (1e-2 if dtype == "fp32" else 0.1)          # the teacher's features are stored in fp16


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_the_default_model_equals_hf_greedy(dtype: str) -> None:
    """The embedded model: one decoder per method across a few chat prompts, as the service keeps one."""
    from rasd.decoding.model.loading import load_model
    from rasd.decoding.runtime.engine import build_decoder
    from rasd.text import encode_prompt

    target = load_model("default", device=DEVICE, dtype=dtype)
    decoders: dict[str, SpeculativeDecoder] = {}
    for text in ("Explain in three sentences why the sky is blue.", "Write a short poem about autumn."):
        ids = encode_prompt(target.tokenizer, text)
        ref = hf_greedy(target.model, ids, 96)
        for method in ("ar", "pld", "recycling", "rasd", "eagle"):
            out = decoders.setdefault(method, build_decoder(target, method)).generate(ids, max_new_tokens=96)
            assert_equal_or_tie(target.model, ids, out.token_ids[: len(ref)], ref, f"default {dtype} {method}")
