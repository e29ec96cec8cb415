"""`rasd ingest-check`: does a large ingest stall the streams that are running beside it?

A running service gets one `POST /v1/documents` of `--mb` megabytes while client threads keep streaming
completions back to back (`--streams` at a time, `--max-tokens` each) until the ingest answers. Every token
chunk's arrival time is recorded; the result is the longest wait for a token while the ingest ran (between
two tokens of one stream, and from sending a request to its first token), the ingest's duration and rate,
and a PNG of every wait against time with the ingest shaded.

The text is real prose, not random words: CPython's language reference (the sample corpus every machine
has), its paragraphs shuffled per document with a seed so no two documents are the same (a duplicate would
embed as fast as any other, but a reader of the index would see copies). `--text PATH` ingests files instead.
Every loop is bounded: streams stop when the ingest answers or after `--timeout` seconds.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPT = ", ".join(str(i) for i in range(1, 40)) + ","     # a count the model goes on with: never stops early


def register(subparsers: Any) -> Any:
    p = subparsers.add_parser("ingest-check", help="ingest a large batch through a running service while "
                                                   "streams run; report the longest wait for a token")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="default: $RASD_API_KEY")
    p.add_argument("--mb", type=float, default=10.0, help="megabytes of text to ingest (UTF-8)")
    p.add_argument("--doc-kb", type=float, default=256.0, help="size of each document")
    p.add_argument("--text", default=None, help="a file or folder of .txt/.md to ingest instead of the sample")
    p.add_argument("--streams", type=int, default=1, help="streams running at a time")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--method", default="ar")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds before the check gives up (10 MB took over 30 min on a 2-core CPU)")
    p.add_argument("--max-wait", type=float, default=2.0, help="exit 1 when a token waited longer (seconds)")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--plot", default=None, help="PNG of every wait for a token against time")
    p.set_defaults(func=run_ingest_check_cli)
    return p


# ---------------------------------------------------------------------------------------------- the text


def sample_paragraphs() -> list[str]:
    """Paragraphs of CPython's language reference (`pydoc_data.topics`, shipped with every Python)."""
    from pydoc_data.topics import topics

    return [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 40]


def file_paragraphs(path: str) -> list[str]:
    """Paragraphs of a file, or of every .txt/.md under a folder."""
    root = Path(path)
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files if f.suffix in (".txt", ".md")
             or f == root]
    return [p.strip() for text in texts for p in text.split("\n\n") if p.strip()]


def make_documents(paragraphs: list[str], total_bytes: int, doc_bytes: int, seed: int = 0) -> list[dict[str, str]]:
    """Documents of about `doc_bytes` each, `total_bytes` in all (UTF-8), paragraphs shuffled per document."""
    if not paragraphs:
        raise ValueError("no text to ingest")
    rng, docs, size = random.Random(seed), [], 0
    while size < total_bytes:
        want, parts, n = min(doc_bytes, total_bytes - size), [], 0
        while n < want:
            part = rng.choice(paragraphs)
            parts.append(part)
            n += len(part.encode("utf-8")) + 2
        text = "\n\n".join(parts)
        docs.append({"title": f"ingest-check {len(docs)}", "source": "rasd ingest-check", "text": text})
        size += len(text.encode("utf-8"))
    return docs


# ---------------------------------------------------------------------------------------------- measuring


@dataclass
class StreamLog:
    """One stream: when it was sent, when each token chunk arrived, how it ended."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    error: str | None = None


def waits_within(logs: list[StreamLog], start: float, end: float) -> tuple[list[tuple[float, float]], list[float]]:
    """(time, seconds) of every wait for a token that ended inside [start, end] (a token's gap since the
    previous token of its stream), and the first-token waits (request sent -> first token) inside it."""
    gaps, firsts = [], []
    for log in logs:
        if log.arrivals and start <= log.arrivals[0] <= end:
            firsts.append(log.arrivals[0] - log.sent)
        for a, b in zip(log.arrivals, log.arrivals[1:], strict=False):
            if start <= b <= end:
                gaps.append((b, b - a))
    return gaps, firsts


def stream_loop(client: Any, params: dict[str, Any], logs: list[StreamLog], done: threading.Event,
                deadline: float) -> None:
    """Stream completions back to back until `done` (the ingest answered) or the deadline."""
    while not done.is_set() and time.monotonic() < deadline:
        log = StreamLog(sent=time.monotonic())
        logs.append(log)
        try:
            for text in client.complete_stream(PROMPT, **params):
                if text:                                 # not the closing chunk
                    log.arrivals.append(time.monotonic())
                if time.monotonic() > deadline:
                    break
        except Exception as exc:   # noqa: BLE001 — recorded: a stream error is a finding, not a crash
            log.error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)


def run_ingest_check(url: str, api_key: str | None, docs: list[dict[str, str]], streams: int = 1,
                     max_tokens: int = 128, method: str = "ar", timeout_s: float = 1800.0) -> dict[str, Any]:
    """Streams run; once each has a token, the ingest is sent; streams go on until it answers."""
    from rasd.client import Client

    deadline = time.monotonic() + timeout_s
    params = {"max_tokens": max_tokens, "temperature": 0, "method": method}
    logs: list[StreamLog] = []
    done = threading.Event()
    clients = [Client(url, api_key=api_key, retries=0, timeout=timeout_s) for _ in range(streams + 1)]
    threads = [threading.Thread(target=stream_loop, args=(c, params, logs, done, deadline), daemon=True)
               for c in clients[:streams]]
    try:
        for t in threads:
            t.start()
        _wait_for_tokens(logs, streams, deadline)
        result = _ingest(clients[-1], docs)
        done.set()
        for t in threads:
            t.join(max(deadline - time.monotonic(), 1.0))
    finally:
        done.set()
        for c in clients:
            c.close()
    return summarize(logs, result, docs, streams, max_tokens, method)


def _wait_for_tokens(logs: list[StreamLog], streams: int, deadline: float) -> None:
    """Until every stream is producing tokens (the ingest must land on running streams)."""
    while time.monotonic() < deadline:
        if sum(1 for log in logs if log.arrivals) >= streams:
            return
        time.sleep(0.05)


def _ingest(client: Any, docs: list[dict[str, str]]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        answer = client.add_documents(docs)
        error = None
    except Exception as exc:   # noqa: BLE001 — reported in the summary
        answer, error = {}, f"{type(exc).__name__}: {exc}"
    return {"start": start, "end": time.monotonic(), "answer": answer, "error": error}


def summarize(logs: list[StreamLog], ingest: dict[str, Any], docs: list[dict[str, str]], streams: int,
              max_tokens: int, method: str) -> dict[str, Any]:
    """The numbers a person asks for: longest waits during the ingest, against the usual one."""
    start, end = ingest["start"], ingest["end"]
    gaps, firsts = waits_within(logs, start, end)
    before, _ = waits_within(logs, float("-inf"), start)
    mb = sum(len(d["text"].encode("utf-8")) for d in docs) / 1e6
    seconds = [g for _, g in gaps]
    return {
        "mb": round(mb, 3), "documents": len(docs), "ingest_s": round(end - start, 2),
        "ingest_mb_per_s": round(mb / max(end - start, 1e-9), 4), "ingest_answer": ingest["answer"],
        "ingest_error": ingest["error"], "streams": streams, "max_tokens": max_tokens, "method": method,
        "requests": len(logs), "stream_errors": [log.error for log in logs if log.error],
        "tokens_during": len(seconds),
        "max_gap_s": round(max(seconds), 3) if seconds else None,
        "median_gap_s": round(statistics.median(seconds), 4) if seconds else None,
        "median_gap_before_s": round(statistics.median([g for _, g in before]), 4) if before else None,
        "max_first_token_s": round(max(firsts), 3) if firsts else None,
        "gaps": [[round(t - start, 3), round(g, 4)] for t, g in gaps],
    }


def verdict(summary: dict[str, Any], max_wait: float) -> list[str]:
    """What broke the promise (empty: kept): an ingest that failed, a stream error, a token later than max_wait."""
    problems = []
    if summary["ingest_error"]:
        problems.append(f"the ingest failed: {summary['ingest_error']}")
    if summary["stream_errors"]:
        problems.append(f"{len(summary['stream_errors'])} stream(s) failed: {summary['stream_errors'][0]}")
    if not summary["tokens_during"]:
        problems.append("no token arrived while the ingest ran (nothing measured)")
    elif summary["max_gap_s"] > max_wait:
        problems.append(f"a stream waited {summary['max_gap_s']:.2f} s for a token (limit {max_wait:g} s)")
    return problems


def format_summary(summary: dict[str, Any]) -> str:
    s = summary
    return "\n".join([
        f"ingested {s['mb']:.1f} MB in {s['documents']} documents in {s['ingest_s']:.1f} s "
        f"({s['ingest_mb_per_s']:.3f} MB/s): {s['ingest_answer'] or s['ingest_error']}",
        f"{s['streams']} stream(s) of {s['max_tokens']} tokens ({s['method']}), {s['requests']} requests, "
        f"{s['tokens_during']} tokens during the ingest",
        f"wait for a token during the ingest: max {s['max_gap_s']} s, median {s['median_gap_s']} s "
        f"(before it: median {s['median_gap_before_s']} s); first token of a request sent during it: "
        f"max {s['max_first_token_s']} s",
    ])


def plot_waits(summary: dict[str, Any], path: str, max_wait: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.axvspan(0, summary["ingest_s"], color="tab:orange", alpha=0.15, label="ingest running")
    if summary["gaps"]:
        t, g = zip(*summary["gaps"], strict=True)
        ax.plot(t, g, ".", ms=3, label="wait for a token")
    ax.axhline(max_wait, color="tab:red", lw=1, ls="--", label=f"{max_wait:g} s")
    ax.set_xlabel("seconds since the ingest was sent")
    ax.set_ylabel("seconds since the previous token")
    ax.set_title(f"{summary['mb']:.1f} MB ingest beside {summary['streams']} stream(s)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_ingest_check_cli(args: Any) -> int:
    import os

    from rasd.errors import CliError

    if args.mb <= 0 or args.doc_kb <= 0 or args.streams < 1 or args.max_tokens < 1:
        raise CliError("--mb, --doc-kb, --streams and --max-tokens must be positive")
    paragraphs = file_paragraphs(args.text) if args.text else sample_paragraphs()
    docs = make_documents(paragraphs, int(args.mb * 1e6), int(args.doc_kb * 1e3))
    summary = run_ingest_check(args.url, args.api_key or os.environ.get("RASD_API_KEY"), docs, args.streams,
                               args.max_tokens, args.method, args.timeout)
    print(format_summary(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot:
        plot_waits(summary, args.plot, args.max_wait)
    problems = verdict(summary, args.max_wait)
    for p in problems:
        print(f"FAIL: {p}")
    return 1 if problems else 0
