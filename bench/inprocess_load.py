"""Document-QA load on the in-process scheduler, on any device: `rasd load` without Ray and HTTP.

Why a script: `rasd load` measures the service end to end, which needs Ray, Ray Serve, FAISS and the query
embedder. A lent GPU machine has none of them and no network, so the prompts (question + retrieved sources,
exactly as the service builds them) are made here and replayed there against the same `Service` and
`Scheduler` that a replica runs: continuous batching, one batched verification forward per step. Every
answer is compared token for token with HF `generate` greedy on the same device, and the baseline is measured
in the same run, one request at a time, like `rasd load`'s.

    python bench/inprocess_load.py --save-prompts prompts.jsonl [--index sample] [--limit 16]
    python bench/inprocess_load.py --prompts prompts.jsonl --index DIR --device cuda \
        --concurrency 1,4,8 --out load_cuda.json [--plot load_cuda.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any


def save_prompts(index_spec: str, model: str, limit: int, top_k: int, max_tokens: int, path: str) -> int:
    """Retrieve and build each sample question's prompt, as `/v1/docqa` would; one JSON line per question."""
    from rasd.apps.docqa import DocQA, open_index
    from rasd.decoding.model.loading import load_model
    from rasd.eval.load import SAMPLE_QUESTIONS

    qa = DocQA(open_index(index_spec, model), load_model(model), top_k=top_k, max_new_tokens=max_tokens)
    with open(path, "w") as f:
        for question in SAMPLE_QUESTIONS[:limit]:
            ids, sources = qa.prepare(question)
            f.write(json.dumps({"question": question, "prompt_ids": ids,
                                "sources": [asdict(s) for s in sources]}) + "\n")
    return min(limit, len(SAMPLE_QUESTIONS))


def read_prompts(path: str, method: str, max_tokens: int) -> list[Any]:
    """The saved prompts as the service's `Prepared` requests (greedy)."""
    from rasd.apps.docqa import Source
    from rasd.decoding.step.sampling import SamplingParams
    from rasd.serve.service import Prepared

    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [Prepared(r["prompt_ids"], method, max_tokens, SamplingParams(), [], [Source(**s) for s in r["sources"]])
            for r in rows]


def run_level(svc: Any, preps: list[Any], concurrency: int, timeout_s: float) -> dict[str, Any]:
    """Every request through the scheduler with `concurrency` in flight (a new one joins as one finishes)."""
    pending, outs, lock, done = list(range(len(preps))), {}, threading.Lock(), threading.Semaphore(0)
    started: dict[int, float] = {}

    def submit_next() -> None:
        with lock:
            if not pending:
                return
            i = pending.pop(0)
        started[i] = time.perf_counter()
        stream = svc.compute.run(svc.backend.stream_for, preps[i])

        def sink(kind: str, payload: Any, i: int = i) -> None:
            if kind in ("done", "error"):
                outs[i] = (kind, payload, time.perf_counter() - started[i])
                done.release()
                submit_next()
        svc.backend.scheduler.submit(stream, sink)

    t0 = time.perf_counter()
    for _ in range(concurrency):
        submit_next()
    for _ in preps:
        if not done.acquire(timeout=max(0.0, t0 + timeout_s - time.perf_counter())):
            break
    wall = time.perf_counter() - t0
    ok = {i: o for i, (kind, o, _) in outs.items() if kind == "done"}
    lat = [t for kind, _, t in outs.values() if kind == "done"]
    tokens = sum(len(o.token_ids) for o in ok.values())
    errors = sorted({str(o) for kind, o, _ in outs.values() if kind == "error"})
    return {"concurrency": concurrency, "requests": len(preps), "completed": len(ok), "rejected": 0,
            "errors": sum(kind == "error" for kind, _, _ in outs.values()), "error_messages": errors[:3],
            "timeouts": len(preps) - len(outs),
            "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "latency_p50_s": statistics.median(lat) if lat else None,
            "latency_p99_s": max(lat) if lat else None,
            "mean_accepted_tokens": statistics.mean(o.stats.mean_accepted_tokens or 1.0 for o in ok.values())
            if ok else None, "token_ids": {i: o.token_ids for i, o in ok.items()}}


def hf_reference(target: Any, preps: list[Any], max_tokens: int) -> dict[str, Any]:
    """HF `generate` greedy, one request at a time: tokens (the identity check) and decode / e2e rates."""
    from tqdm import tqdm

    from rasd.eval.load import hf_rates
    from rasd.eval.runners import HFRunner, SamplingConfig

    hf = HFRunner("hf", target, SamplingConfig())
    hf.run(preps[0].prompt_ids, 8, None)            # the first call on a device pays for its set-up
    records = [hf.run(p.prompt_ids, max_tokens, None) for p in tqdm(preps, desc="hf greedy", file=sys.stderr)]
    return {"token_ids": [r.token_ids for r in records], **hf_rates(records)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rasd.serve.service import ServeConfig, Service

    levels = [int(c) for c in args.concurrency.split(",")]
    preps = read_prompts(args.prompts, args.method, args.max_tokens)
    svc = Service(ServeConfig(model=args.model, index=args.index, device=args.device, dtype=args.dtype,
                              max_batch=max(levels), max_waiting=len(preps), threads=args.threads),
                  decode_only=True)    # no query embedding: the prompts are already built
    print(f"device {svc.target.device}, {len(preps)} prompts of {min(len(p.prompt_ids) for p in preps)}-"
          f"{max(len(p.prompt_ids) for p in preps)} tokens", file=sys.stderr)
    results = []
    for level in levels:
        print(f"concurrency {level} ...", file=sys.stderr, flush=True)
        results.append(run_level(svc, preps, level, args.level_timeout))
    ref = hf_reference(svc.target, preps, args.max_tokens)
    for lv in results:
        ids = lv.pop("token_ids")
        same = [ids[i] == ref["token_ids"][i] for i in ids]
        lv["identical_to_in_process"] = sum(same) / len(same) if same else None   # here: HF greedy itself
        lv["differs"] = [i for i in ids if ids[i] != ref["token_ids"][i]]
        lv["vs_hf"] = lv["tokens_per_s"] / ref["hf_tokens_per_s"]
        lv["vs_hf_e2e"] = lv["tokens_per_s"] / ref["hf_e2e_tokens_per_s"]
    svc.close()
    return {"device": str(svc.target.device), "device_name": device_name(args.device), "dtype": args.dtype,
            "method": args.method, "max_tokens": args.max_tokens, "questions": len(preps),
            "label": f"rasd scheduler in-process on {device_name(args.device)} (aggregate)",
            "hf_tokens_per_s": ref["hf_tokens_per_s"], "hf_e2e_tokens_per_s": ref["hf_e2e_tokens_per_s"],
            "levels": results}


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--save-prompts", help="build the sample questions' prompts into this JSONL and stop")
    ap.add_argument("--prompts", help="replay these prompts (from --save-prompts)")
    ap.add_argument("--index", default="sample", help="index folder (its datastore drafts for `rasd`)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--method", default="rasd")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--top-k-sources", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--level-timeout", type=float, default=600.0)
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if args.save_prompts:
        n = save_prompts(args.index, args.model, args.limit, args.top_k_sources, args.max_tokens, args.save_prompts)
        print(f"{n} prompts -> {args.save_prompts}")
        return 0
    if not args.prompts:
        ap.error("give --prompts FILE (made with --save-prompts) or --save-prompts FILE")
    if args.index == "sample":
        from rasd.apps.sample_corpus import ensure_sample_index

        args.index = str(ensure_sample_index(args.model))
    from rasd.eval.load import format_load_table, plot_load

    summary = run(args)
    print(format_load_table(summary).replace(" same", "  =hf"))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot_load(summary, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
