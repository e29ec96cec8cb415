"""Lossless check and cost curve on an accelerator: run this on a machine with CUDA.

Why a script and not the test suite: CI has no GPU, and the tests pin tiny models to the CPU. This checks the
same properties on CUDA — every proposer's greedy output equals HF `generate` greedy on the same device
(tiny random Llamas, several seeds, on the eager path and on static shapes replayed as CUDA graphs, single
requests and a batch with rows joining and leaving; and the real default model when `--real` is given) —
and prints the target's verify-latency curve on both paths, which decides how large draft trees may be.

    python scripts/gpu_check.py --device cuda [--real] [--dtype float32] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from rasd.decoding.model.static_step import StepConfig
from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.cost import measure_curve
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder

PATHS = {"eager": StepConfig(), "graphs": StepConfig(static=True, graphs=True)}


def tiny_llama(seed: int, vocab: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A small random Llama; weights scaled up so greedy output is not one repeated token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, max_position_embeddings=1024,
                      initializer_range=0.05, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """HF `generate` greedy on the model's device (explicit mask: see tests/conftest.py)."""
    x = torch.tensor([prompt], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)


def top2_gap(model: torch.nn.Module, ids: list[int]) -> float:
    x = torch.tensor([ids], device=next(model.parameters()).device)
    with torch.inference_mode():
        top = model(x).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


TINY_METHODS = ("ar", "pld", "draft", "optree", "recycling", "retrieval", "rasd", "rasd-draft", "eesd",
                "adaeagle", "eagle", "rasd-eagle")


def tiny_proposer(method: str, target: torch.nn.Module, draft: torch.nn.Module, docs: list[list[int]],
                  files: Path):
    """The proposer for one method on a tiny model: datastores, recycling matrix and self-draft weights built
    here (random exit layer and LDLP: losslessness does not depend on how good a drafter is)."""
    from rasd.decoding.proposers.early_exit import new_exit_layer, save_exit_layer
    from rasd.decoding.proposers.recycling import RecyclingMatrix
    from rasd.decoding.sizing.ldlp import LengthPredictor
    from rasd.index.suffix_array import SuffixArray

    vocab = target.config.vocab_size
    if method in ("eesd", "adaeagle"):
        exit_path, ldlp_path = files / "exit.safetensors", files / "ldlp.safetensors"
        save_exit_layer(exit_path, new_exit_layer(target, 1), 1)
        LengthPredictor(target.config.hidden_size, width=16, k_max=6).save(ldlp_path)
        return make_proposer(method, target_model=target, eesd=exit_path, ldlp=ldlp_path)
    if method in ("eagle", "rasd-eagle"):   # an untrained head: the features' path, captured or not, is what counts
        from rasd.decoding.model.eagle_head import EagleHead

        head = make_proposer("eagle", head=EagleHead(target).eval(), min_prob=0.0)
        if method == "eagle":
            return head
        return make_proposer("rasd", datastores=[SuffixArray.from_documents(docs)], draft_proposer=head)
    stores = [SuffixArray.from_documents(docs)] if method in ("retrieval", "rasd", "rasd-draft") else None
    recycling = RecyclingMatrix(vocab) if method in ("recycling", "rasd", "rasd-draft") else None
    name = "rasd" if method == "rasd-draft" else method
    use_draft = method in ("draft", "optree", "rasd-draft")
    return make_proposer(name, draft_model=draft if use_draft else None, datastores=stores, recycling=recycling)


def check_tiny(device: str, dtype: torch.dtype, files: Path, seeds: int = 3) -> dict:
    """Greedy equality for every method on random Llamas, on both verification paths; a difference must sit
    at a near-tie.

    Each (seed, method, path) runs on its own: an exception is recorded with its message, so one broken path
    does not hide the others."""
    vocab, results = 200, []
    draft = tiny_llama(99, vocab, device, dtype)
    files.mkdir(parents=True, exist_ok=True)
    for seed in range(seeds):
        target = tiny_llama(seed, vocab, device, dtype)
        gen = torch.Generator().manual_seed(seed)
        base = torch.randint(0, vocab, (12,), generator=gen).tolist()
        prompt = base * 3 + torch.randint(0, vocab, (5,), generator=gen).tolist()   # repeats: pld finds drafts
        ref, ours_ar = hf_greedy(target, prompt, 48), None
        docs = [prompt[-6:] + ref, ref[10:] + base]      # a datastore that holds the answer: drafts get accepted
        for method, (path, step) in ((m, p) for m in TINY_METHODS for p in PATHS.items()):
            row = {"seed": seed, "method": method, "path": path}
            try:
                proposer = tiny_proposer(method, target, draft, docs, files)
                dec = SpeculativeDecoder(target, proposer, sizer=FixedSizer(0 if method == "ar" else 16), step=step)
                res = dec.generate(prompt, max_new_tokens=48)
            except Exception as err:   # noqa: BLE001 - reported, not hidden: the point is to see every failure
                row.update(equal=False, error=f"{type(err).__name__}: {err}"[:400],
                           trace=traceback.format_exc()[-1500:])
                results.append(row)
                print(f"  {dtype} seed {seed} {method} {path}: ERROR {row['error']}", flush=True)
                continue
            i = first_diff(res.token_ids, ref)
            ours_ar = res.token_ids if method == "ar" and path == "eager" else ours_ar
            row.update(equal=i is None, first_diff=i, equal_to_our_ar=res.token_ids == ours_ar,
                       ref_top2_gap=None if i is None else top2_gap(target, prompt + ref[:i]),
                       mean_accepted=res.stats.mean_accepted_tokens)
            results.append(row)
        results.append(check_batch(target, draft, prompt, docs, files, seed))
        results += [check_fused(seed, vocab, device, dtype, prompt, path) for path in PATHS]
    return {"device": device, "dtype": str(dtype), "runs": results,
            "all_equal": all(r["equal"] for r in results),
            "failed": sorted({r["method"] for r in results if not r["equal"]})}


def check_fused(seed: int, vocab: int, device: str, dtype: torch.dtype, prompt: list[int], path: str) -> dict:
    """A fused EAGLE-3 head (layer 0 tapped, its map random so the tapped values matter): HF greedy's tokens,
    and the features it was handed equal a teacher forward's (a graph replay runs no hooks: the captured step
    must hand over the stacked features itself)."""
    from rasd.decoding.model.eagle_head import EagleHead
    from rasd.train.eagle_head import extract_features

    row: dict = {"seed": seed, "method": "eagle-fused", "path": path}
    try:
        target = tiny_llama(seed, vocab, device, dtype)   # its own: a tap with layers stays on its target
        head = EagleHead(target, taps=(0,)).eval()
        with torch.no_grad():
            head.fc_taps.weight.normal_(std=0.05)
        proposer = make_proposer("eagle", head=head, min_prob=0.0)
        res = SpeculativeDecoder(target, proposer, sizer=FixedSizer(16), step=PATHS[path]).generate(prompt, 48)
        ref = hf_greedy(target, prompt, 48)
        teacher = extract_features(target, [prompt + res.token_ids], None, batch=1, shard=1, taps=(0,))["feats"][0]
        fed, start = proposer.feats, proposer.feat_start
        gap = float((fed[: len(teacher) - start].float().cpu() - teacher[start: start + len(fed)].float()).abs().max())
        row.update(equal=first_diff(res.token_ids, ref) is None, first_diff=first_diff(res.token_ids, ref),
                   features_max_abs_diff=gap, features_width=int(fed.shape[-1]))
        row["equal"] = row["equal"] and gap < (0.1 if dtype != torch.float32 else 1e-2)   # teacher stored fp16
    except Exception as err:   # noqa: BLE001 - reported, not hidden
        row.update(equal=False, error=f"{type(err).__name__}: {err}"[:400], trace=traceback.format_exc()[-1500:])
    print(f"  {dtype} seed {seed} eagle-fused {path}: {row.get('equal')} {row.get('features_max_abs_diff')}",
          flush=True)
    return row


def check_batch(target: torch.nn.Module, draft: torch.nn.Module, prompt: list[int], docs: list[list[int]],
                files: Path, seed: int) -> dict:
    """A captured batch: requests of several methods join, leave early and join late (slots grow); each
    request's tokens must equal HF greedy on its own."""
    row: dict = {"seed": seed, "method": "batch", "path": "graphs"}
    try:
        batch = BatchDecoder(target, slots=2, step=PATHS["graphs"])
        plan = [("pld", prompt, 40), ("ar", prompt[5:], 9), ("recycling", prompt[:20], 30), ("rasd", prompt, 44)]
        streams, refs = [], []
        for i, (method, ids, n) in enumerate(plan):
            dec = SpeculativeDecoder(target, tiny_proposer(method, target, draft, docs, files), sizer=FixedSizer(16),
                                     step=PATHS["graphs"])
            streams.append(dec.stream(ids, n))
            refs.append(hf_greedy(target, ids, n))
            batch.add(streams[-1])
            for _ in range(3 if i < 2 else 0):
                batch.step()
        for _ in range(400):
            if not len(batch):
                break
            batch.step()
        diffs = [first_diff(s.output.token_ids, r) if s.output else -1 for s, r in zip(streams, refs, strict=True)]
        row.update(equal=all(d is None for d in diffs), first_diffs=diffs, graphs=len(batch.cache._captured))
    except Exception as err:   # noqa: BLE001 - recorded: see check_tiny
        row.update(equal=False, error=f"{type(err).__name__}: {err}"[:400], trace=traceback.format_exc()[-1500:])
        print(f"  batch seed {seed}: ERROR {row['error']}", flush=True)
    return row


def check_real(device: str, dtype: str, prompts: list[str], methods: list[str]) -> dict:
    """The default model: each method's greedy output vs HF greedy on a few chat prompts, and the cost curve.

    One decoder per method across the prompts, as the service keeps one (recycling's matrix warms up)."""
    from rasd.decoding.model.loading import load_model
    from rasd.decoding.runtime.engine import build_decoder
    from rasd.text import encode_prompt

    target = load_model("default", device=device, dtype=dtype)
    runs: list[dict] = []
    decoders: dict = {}
    for text in prompts:
        ids = encode_prompt(target.tokenizer, text)
        ref = hf_greedy(target.model, ids, 96)
        for method in methods:
            t0 = time.perf_counter()
            try:
                out = decoders.setdefault(method, build_decoder(target, method)).generate(ids, max_new_tokens=96)
            except Exception as err:   # noqa: BLE001 - recorded: see check_tiny
                runs.append({"method": method, "equal": False, "error": f"{type(err).__name__}: {err}"[:400],
                             "trace": traceback.format_exc()[-1500:]})
                print(f"  real {method}: ERROR {runs[-1]['error']}", flush=True)
                continue
            i = first_diff(out.token_ids[: len(ref)], ref)
            runs.append({"method": method, "prompt_tokens": len(ids), "equal": i is None, "first_diff": i,
                         "mean_accepted": out.stats.mean_accepted_tokens, "seconds": time.perf_counter() - t0,
                         "ref_top2_gap": None if i is None else top2_gap(target.model, ids + ref[:i])})
    curves = {}
    for path, step in PATHS.items():
        curve = measure_curve(target.model, 512, progress=False, step=step)
        curves[path] = {str(k): round(v * 1000, 3) for k, v in zip(curve.sizes, curve.latency_s, strict=True)}
    return {"device": device, "dtype": dtype, "verify_path": target.step.label, "runs": runs,
            "all_equal": all(r["equal"] for r in runs), "cost_curve_ms_ctx512": curves}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--real", action="store_true", help="also check the embedded default model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", default=None, help="Spec-Bench question.jsonl to take real prompts from")
    p.add_argument("--out", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--real-methods", default="ar,pld,recycling,rasd",
                   help="methods checked on the real model (add eesd when its weights are under $RASD_HOME)")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-model checks")
    p.add_argument("--seeds", type=int, default=3, help="tiny models checked per dtype")
    p.add_argument("--max-prompts", type=int, default=6, help="real prompts (one per category)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report: dict = {"torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for dt in () if args.no_tiny else (torch.float32, torch.bfloat16):
        report[f"tiny_{dt}"] = check_tiny(args.device, dt, Path(tempfile.mkdtemp(prefix="rasd-gpu-")), args.seeds)
        print(f"tiny {dt}: all equal = {report[f'tiny_{dt}']['all_equal']}, failed: "
              f"{report[f'tiny_{dt}']['failed']}", flush=True)
    if args.real:
        prompts = ["Explain in three sentences why the sky is blue.", "Write a short poem about autumn."]
        if args.prompts:
            rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
            seen: dict[str, str] = {}
            for row in rows:
                seen.setdefault(row.get("category", "?"), row["turns"][0])
            prompts = list(seen.values())[: args.max_prompts]
        report["real"] = check_real(args.device, args.dtype, prompts, args.real_methods.split(","))
        print(f"real {args.dtype}: all equal = {report['real']['all_equal']}", flush=True)
        for path, ms in report["real"]["cost_curve_ms_ctx512"].items():
            print(f"cost curve, {path} (ms, ctx 512):", ms, flush=True)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
