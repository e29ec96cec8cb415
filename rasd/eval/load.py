"""`rasd load`: drive a running service with concurrent document-QA requests; throughput and latency.

For each concurrency level the same questions are sent by that many client threads at once; aggregate
tokens/s is all completion tokens over the wall time of the level (prefill included). The service remembers
what it answered (prefix cache, response history), so levels after the first run warm; the table says so
(`warm_levels`), and cold numbers need a fresh service per level. The baseline is HF
`generate` greedy on one request at a time, in this process, on the same prompts (the service must be
idle then, so it runs after the load levels), and every service answer is checked against the in-process
engine (`DocQA.ask`, same method) token for token through the text.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SAMPLE_QUESTIONS = [
    "How does the else clause of a for loop work, and when is it skipped?",
    "What does the with statement do with the context manager's __enter__ and __exit__ methods?",
    "How are default parameter values evaluated in a function definition?",
    "What happens when a return statement is executed inside a try block with a finally clause?",
    "How does the global statement change the scope of a name?",
    "What does the nonlocal statement do?",
    "How are chained comparisons like a < b < c evaluated?",
    "What does the assert statement do when optimization is requested?",
    "How does the del statement work on names and on subscriptions?",
    "What is the difference between the is operator and the == operator?",
    "How does a while loop's else clause behave when the loop ends with break?",
    "What does the yield expression do inside a function?",
    "How are keyword-only parameters declared in a function definition?",
    "What does the raise statement do with the from clause?",
    "How does augmented assignment like x += 1 work?",
    "What does the pass statement do?",
]


def register(subparsers: Any) -> Any:
    p = subparsers.add_parser("load", help="load-test a running service with concurrent document-QA requests")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("RASD_API_KEY"), help="default: $RASD_API_KEY")
    p.add_argument("--index", default="sample", help="the service's index (to rebuild prompts for the baseline)")
    p.add_argument("--questions", default=None, help="jsonl with a `question` per line (default: 16 built in)")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated concurrency levels")
    p.add_argument("--limit", type=int, default=None, help="use the first N questions")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--method", default="rasd")
    p.add_argument("--top-k-sources", type=int, default=4)
    p.add_argument("--model", default="default", help="the service's model (for the in-process reference)")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--plot", default=None, help="throughput/latency PNG")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as hung")
    p.add_argument("--repeat", action="store_true",
                   help="ask the questions a second time at each level: what the service remembers (prefix cache, "
                        "response history) is worth the second pass's speed over the first")
    p.add_argument("--level-timeout", type=float, default=900.0,
                   help="seconds after which a level starts no more requests")
    p.set_defaults(func=run_load)
    return p


def load_questions(path: str | None, limit: int | None) -> list[str]:
    if path is None:
        questions = list(SAMPLE_QUESTIONS)
    else:
        lines = Path(path).read_text().splitlines()
        questions = [json.loads(line)["question"] for line in lines if line.strip()]
    return questions[:limit] if limit else questions


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list; None for an empty one."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ask_once(client: Any, question: str, params: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One request on `client` (a `rasd.client.Client` made with `retries=0` and `timeout_s`), no retries:
    its outcome is `ok`, `rejected` (429/503: the service said it is full or down), `error` (any other HTTP
    error, with its message) or `timeout` (no answer in `timeout_s`: a hang would show up here, bounded)."""
    import httpx

    from rasd.client import ApiError

    row: dict[str, Any] = {"question": question, "outcome": "ok"}
    start = time.perf_counter()
    try:
        answer = client.ask(question, **params)
        details = answer.usage.get("prompt_tokens_details") or {}
        row.update(answer=answer.answer, completion_tokens=answer.usage.get("completion_tokens", 0),
                   prompt_tokens=answer.usage.get("prompt_tokens", 0), cached_tokens=details.get("cached_tokens", 0),
                   mean_accepted_tokens=answer.stats.get("mean_accepted_tokens"),
                   sources=[[s.get("doc_id"), s.get("chunk_id")] for s in answer.sources])
    except ApiError as exc:
        row.update(outcome="rejected" if exc.status in (429, 503) else "error", status=exc.status,
                   message=exc.message)
    except httpx.TimeoutException as exc:
        row.update(outcome="timeout", message=f"no answer in {timeout_s:.0f} s ({type(exc).__name__})")
    except httpx.HTTPError as exc:
        row.update(outcome="error", message=f"{type(exc).__name__}: {exc}")
    row["latency_s"] = time.perf_counter() - start
    return row


def ask_fresh(url: str, api_key: str | None, question: str, params: dict[str, Any], timeout_s: float
              ) -> dict[str, Any]:
    """`ask_once` on a new connection (after a kill, a kept-alive one may point at a dead replica)."""
    from rasd.client import Client

    with Client(url, api_key=api_key, retries=0, timeout=timeout_s) as client:
        return ask_once(client, question, params, timeout_s)


def run_level(url: str, api_key: str | None, questions: list[str], concurrency: int, params: dict[str, Any],
              request_timeout_s: float = 300.0, level_timeout_s: float = 900.0) -> dict[str, Any]:
    """All questions through `concurrency` client threads; per-request outcome and latency, the level's
    throughput. Bounded: each request by `request_timeout_s`, and no request starts after
    `level_timeout_s` (those count as `not_sent`)."""
    from rasd.client import Client

    deadline = time.perf_counter() + level_timeout_s
    # One client (one kept-alive connection) per sending thread, as a real load generator holds them: a new
    # httpx client per request costs tens of ms of CPU (its TLS context), taken from the cores being measured.
    local, clients = threading.local(), []

    def one(question: str) -> dict[str, Any]:
        if time.perf_counter() > deadline:
            return {"question": question, "outcome": "not_sent", "latency_s": 0.0}
        if not hasattr(local, "client"):
            local.client = Client(url, api_key=api_key, retries=0, timeout=request_timeout_s)
            clients.append(local.client)
        return ask_once(local.client, question, params, request_timeout_s)

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            rows = list(pool.map(one, questions))
    finally:
        for client in clients:
            client.close()
    wall = time.perf_counter() - start
    done = [r for r in rows if r["outcome"] == "ok"]
    latencies = [r["latency_s"] for r in done]
    tokens = sum(r["completion_tokens"] for r in done)
    outcomes = {k: sum(r["outcome"] == k for r in rows) for k in ("ok", "rejected", "error", "timeout", "not_sent")}
    return {"concurrency": concurrency, "requests": len(rows), "completed": outcomes["ok"],
            "rejected": outcomes["rejected"], "errors": outcomes["error"], "timeouts": outcomes["timeout"],
            "not_sent": outcomes["not_sent"], "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            # prompt tokens the service's prefix cache served (its system prompt, or a question seen before)
            "prompt_tokens": sum(r["prompt_tokens"] for r in done),
            "cached_prompt_tokens": sum(r["cached_tokens"] for r in done),
            "latency_p50_s": percentile(latencies, 0.5), "latency_p95_s": percentile(latencies, 0.95),
            "latency_p99_s": percentile(latencies, 0.99),
            "mean_accepted_tokens": (statistics.mean(r["mean_accepted_tokens"] or 1.0 for r in done)
                                     if done else None), "rows": rows}


def reference(index_spec: str, model: str, questions: list[str], method: str, top_k: int, max_tokens: int,
              dtype: str = "float32") -> dict[str, Any]:
    """In-process answers (identity check) and HF greedy single-request speed on the same prompts, in the
    service's dtype (its `/healthz`): same output is only promised within one dtype."""
    from tqdm import tqdm

    from rasd.apps.docqa import DocQA, open_index
    from rasd.decoding.model.loading import load_model
    from rasd.eval.runners import HFRunner, SamplingConfig

    index, target = open_index(index_spec, model), load_model(model, dtype=dtype)
    qa = DocQA(index, target, method=method, top_k=top_k, max_new_tokens=max_tokens)
    hf = HFRunner("hf", target, SamplingConfig(), repetition=qa.repetition)   # the docqa default rule, as served
    answers, records = {}, []
    for question in tqdm(questions, desc="in-process reference + hf", file=sys.stderr):
        answers[question] = qa.ask(question).answer
        ids, _ = qa.prepare(question)
        records.append(hf.run(ids, max_tokens, None))
    return {"answers": answers, **hf_rates(records)}


def hf_rates(records: list[Any]) -> dict[str, float]:
    """The single-request baseline from HF runs: median decode and median with-prefill tokens/s."""
    decode = [r.tokens_per_s for r in records if r.tokens_per_s]
    e2e = [r.new_tokens / r.total_time_s for r in records]
    return {"hf_tokens_per_s": statistics.median(decode), "hf_e2e_tokens_per_s": statistics.median(e2e)}


def run_load(args: Any) -> int:
    from rasd.client import Client
    from rasd.errors import CliError

    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise CliError("--concurrency needs positive integers, e.g. 1,4,8")
    questions = load_questions(args.questions, args.limit)
    try:
        health = Client(args.url, api_key=args.api_key, retries=0).health()
    except Exception as exc:
        raise CliError(f"no service at {args.url} ({exc}); start one with `rasd serve --index ...`") from exc
    params = {"max_tokens": args.max_tokens, "method": args.method, "top_k_sources": args.top_k_sources,
              "temperature": 0}
    results = []
    for level in levels:
        for n in range(1, 3 if args.repeat else 2):
            print(f"concurrency {level}, pass {n}: {len(questions)} questions ...", file=sys.stderr, flush=True)
            results.append({"pass": n, **run_level(args.url, args.api_key, questions, level, params,
                                                   args.request_timeout, args.level_timeout)})
    dtype = health.get("dtype") if isinstance(health, dict) else None
    ref = reference(args.index, args.model, questions, args.method, args.top_k_sources, args.max_tokens,
                    dtype or "float32")
    for level in results:
        same = [row["answer"] == ref["answers"][row["question"]] for row in level["rows"] if row["outcome"] == "ok"]
        level["identical_to_in_process"] = sum(same) / len(same) if same else None
        level["vs_hf"] = level["tokens_per_s"] / ref["hf_tokens_per_s"]
        level["vs_hf_e2e"] = level["tokens_per_s"] / ref["hf_e2e_tokens_per_s"]
    summary = {"url": args.url, "method": args.method, "max_tokens": args.max_tokens, "questions": len(questions),
               "hf_tokens_per_s": ref["hf_tokens_per_s"], "hf_e2e_tokens_per_s": ref["hf_e2e_tokens_per_s"],
               "levels": results}
    summary["warm_levels"] = warm_levels(results)
    print(format_load_table(summary))
    if summary["warm_levels"]:
        print(format_warm(summary["warm_levels"]))
    if args.repeat:
        print(format_repeats(results))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot_load(summary, args.plot)
    return 0


def _num(value: float | None, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"


def _cached(level: dict[str, Any]) -> str:
    """The share of the level's prompt tokens that came from the prefix cache."""
    prompt = level.get("prompt_tokens") or 0
    return f"{100 * level.get('cached_prompt_tokens', 0) / prompt:>5.1f}%" if prompt else f"{'-':>6}"


def format_load_table(summary: dict[str, Any]) -> str:
    lines = [f"hf greedy, one request at a time: {summary['hf_tokens_per_s']:.2f} tok/s decode, "
             f"{summary['hf_e2e_tokens_per_s']:.2f} tok/s with prefill",
             f"{'conc':>4} {'reqs':>4} {'ok':>3} {'rej':>3} {'err':>3} {'hung':>4} {'wall s':>7} {'agg tok/s':>9} "
             f"{'vs hf':>6} {'vs hf e2e':>9} {'p50 s':>6} {'p99 s':>6} {'acc':>5} {'same':>5} {'cached':>6}"]
    for lv in summary["levels"]:
        conc = f"{lv['concurrency']}" + (f"/{lv['pass']}" if "pass" in lv else "")
        lines.append(f"{conc:>4} {lv['requests']:>4} {lv['completed']:>3} {lv['rejected']:>3} "
                     f"{lv['errors']:>3} {lv['timeouts']:>4} {lv['wall_s']:>7.1f} {lv['tokens_per_s']:>9.2f} "
                     f"{lv['vs_hf']:>5.2f}x {lv['vs_hf_e2e']:>8.2f}x {_num(lv['latency_p50_s'], '.1f', 6)} "
                     f"{_num(lv['latency_p99_s'], '.1f', 6)} {_num(lv['mean_accepted_tokens'], '.2f', 5)} "
                     f"{_num(lv['identical_to_in_process'], '.2f', 5)} {_cached(lv)}")
    return "\n".join(lines)


WARM_SHARE = 0.5   # a first pass with this share of its prompt tokens already cached re-asked answered questions


def warm_levels(levels: list[dict[str, Any]]) -> list[str]:
    """The first passes (`8/1`) after the first level whose prompts the service mostly had cached already.

    Why: every level asks the same questions, and the service remembers what it answered (prefix cache,
    response history), so on one service the levels after the first measure a warm service (on the sample
    index: 97% of prompt tokens cached and 21 accepted tokens a step at concurrency 4, against 6% and 3.7 at
    concurrency 1). `--repeat` measures that on purpose; a level that looks like a first pass should say so."""
    warm = []
    for i, level in enumerate(levels):
        prompt, cached = level.get("prompt_tokens") or 0, level.get("cached_prompt_tokens", 0)
        if i > 0 and level.get("pass", 1) == 1 and prompt and cached >= WARM_SHARE * prompt:
            warm.append(f"{level['concurrency']}/1")
    return warm


def format_warm(names: list[str]) -> str:
    """The warning `rasd load` prints under its table for `warm_levels`."""
    return (f"note: level{'s' if len(names) > 1 else ''} {', '.join(names)} re-asked questions this service had "
            f"answered in an earlier level (most prompt tokens cached; earlier answers draft the new ones), so "
            f"they measure a warm service; for cold numbers run each level against a freshly started service")


def repeat_gains(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency, the second pass over the same questions against the first: tokens/s and mean
    accepted tokens of each, and whether every answer was the same."""
    first = {lv["concurrency"]: lv for lv in levels if lv.get("pass") == 1}
    gains = []
    for again in (lv for lv in levels if lv.get("pass") == 2 and lv["concurrency"] in first):
        before = first[again["concurrency"]]
        answers = {r["question"]: r.get("answer") for r in before["rows"] if r["outcome"] == "ok"}
        same = [r.get("answer") == answers[r["question"]] for r in again["rows"]
                if r["outcome"] == "ok" and r["question"] in answers]
        gains.append({"concurrency": again["concurrency"], "first_tokens_per_s": before["tokens_per_s"],
                      "second_tokens_per_s": again["tokens_per_s"],
                      "speedup": again["tokens_per_s"] / before["tokens_per_s"] if before["tokens_per_s"] else None,
                      "first_accepted": before["mean_accepted_tokens"],
                      "second_accepted": again["mean_accepted_tokens"],
                      "same_answers": sum(same) / len(same) if same else None})
    return gains


def format_repeats(levels: list[dict[str, Any]]) -> str:
    lines = [f"{'conc':>4} {'pass 1 tok/s':>12} {'pass 2 tok/s':>12} {'pass 2/1':>8} {'acc 1':>5} {'acc 2':>5} "
             f"{'same':>5}"]
    for g in repeat_gains(levels):
        lines.append(f"{g['concurrency']:>4} {g['first_tokens_per_s']:>12.2f} {g['second_tokens_per_s']:>12.2f} "
                     f"{_num(g['speedup'], '.2f', 7)}x {_num(g['first_accepted'], '.2f', 5)} "
                     f"{_num(g['second_accepted'], '.2f', 5)} {_num(g['same_answers'], '.2f', 5)}")
    return "\n".join(lines)


def plot_load(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = summary["levels"]
    conc = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [lv["tokens_per_s"] for lv in levels]
    ax1.plot(conc, rates, "o-", label=summary.get("label", "rasd service (aggregate)"))
    hf, hf_e2e = summary["hf_tokens_per_s"], summary.get("hf_e2e_tokens_per_s")
    ax1.axhline(hf, color="gray", ls="--", label="hf greedy, one request (decode)")
    if hf_e2e:   # the like-for-like baseline: the aggregate counts prefill too
        ax1.axhline(hf_e2e, color="gray", ls=":", label="hf greedy, one request (with prefill)")
    for i, (c, rate) in enumerate(zip(conc, rates, strict=True)):
        note = f"{rate / hf:.2f}x" + (f" / {rate / hf_e2e:.2f}x" if hf_e2e else "") + " hf"
        last = i == len(conc) - 1
        ax1.annotate(note, (c, rate), textcoords="offset points", xytext=(-6 if last else 6, -14),
                     ha="right" if last else "left", fontsize=8)
    ax1.set_ylim(0, max(rates + [hf]) * 1.2)
    ax1.set_xlabel("concurrent requests")
    ax1.set_ylabel("tokens/s  (labels: vs hf decode / with prefill)")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.plot(conc, [lv["latency_p50_s"] for lv in levels], "o-", label="p50")
    ax2.plot(conc, [lv["latency_p99_s"] for lv in levels], "s--", label="p99")
    ax2.set_xlabel("concurrent requests")
    ax2.set_ylabel("request latency (s)")
    ax2.legend()
    fig.suptitle(f"document QA load ({summary['method']}, max_tokens {summary['max_tokens']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
