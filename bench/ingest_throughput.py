"""HTTP ingest throughput against `rasd index build` on the same text (MB/s, nothing else running).

    rasd index build README.md --out /tmp/seed-index && rasd serve --index /tmp/seed-index &
    .venv/bin/python bench/ingest_throughput.py --url http://127.0.0.1:8000 --mb 3 \\
        --data ../shared/data/corpus/wikitext2_raw_test/wiki.test.raw ../shared/data/longbench/longbench_dev.jsonl

The same documents (the first `--mb` megabytes of the files, cut into `--doc-kb` pieces; a .jsonl gives each
row's `text`, else its `context`) are written to a folder and built by the `rasd index build` command (a
subprocess: its wall time includes starting Python and loading the embedder, a few seconds), then sent to a
running service as one ingest job (`POST /v1/documents` with `"async": true`, polled to its end). The service
must have an index with the default tokenizer and embedder and no stream running. Reported: MB/s of each,
their ratio (issue 67 asks >= 0.8), and the job's own run time from its record (queue wait excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/ingest_throughput.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running service (rasd serve --index ...)")
    p.add_argument("--api-key", default=os.environ.get("RASD_API_KEY"), help="default: $RASD_API_KEY")
    p.add_argument("--data", nargs="+", default=["../shared/data/corpus/wikitext2_raw_test/wiki.test.raw"],
                   help="text files (.txt, .raw, .md) and .jsonl files")
    p.add_argument("--mb", type=float, default=3.0, help="megabytes of text (UTF-8)")
    p.add_argument("--doc-kb", type=float, default=256.0, help="size of each document")
    p.add_argument("--skip-cli", action="store_true", help="only the HTTP ingest")
    p.add_argument("--skip-http", action="store_true", help="only `rasd index build`")
    p.add_argument("--json", default=None, help="results JSON")
    return p.parse_args(argv)


def texts_of(path: Path) -> list[str]:
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [str(r.get("text") or r.get("context") or "") for r in rows]
    return [path.read_text(encoding="utf-8", errors="replace")]


def documents(paths: list[str], mb: float, doc_kb: float) -> list[dict[str, str]]:
    """The first `mb` MB of the files' text, in documents of about `doc_kb` KB (cut at a character)."""
    want, size, docs = int(mb * 1e6), int(doc_kb * 1e3), []
    total = 0
    for path in paths:
        for text in texts_of(Path(path)):
            for i in range(0, len(text), size):
                piece = text[i:i + size]
                if not piece.strip():
                    continue
                docs.append({"title": f"{Path(path).stem} {len(docs)}", "text": piece})
                total += len(piece.encode("utf-8"))
                if total >= want:
                    return docs
    if not docs:
        raise SystemExit("no text in --data")
    return docs


def megabytes(docs: list[dict[str, str]]) -> float:
    return sum(len(d["text"].encode("utf-8")) for d in docs) / 1e6


def run_cli(docs: list[dict[str, str]], folder: Path) -> dict[str, Any]:
    """`rasd index build` over the documents written as .txt files; wall time of the command."""
    text = folder / "text"
    text.mkdir()
    for i, d in enumerate(docs):
        (text / f"doc{i:05d}.txt").write_text(d["text"], encoding="utf-8")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rasd.cli", "index", "build", str(text), "--out", str(folder / "index"),
                    "--quiet"], check=True)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "mb_per_s": round(megabytes(docs) / seconds, 5)}


def run_http(docs: list[dict[str, str]], url: str, api_key: str | None) -> dict[str, Any]:
    """One ingest job through the service, polled to its end."""
    from rasd.client import Client

    start = time.perf_counter()
    with Client(url, api_key=api_key, timeout=600) as client:
        answer = client.add_documents(docs, as_job=True, progress=True)
        seconds = time.perf_counter() - start
        job = client._get(f"/v1/documents/jobs/{answer['job']}")
    ran = job["updated"] - job["started"] if job.get("started") else None
    return {"seconds": round(seconds, 2), "mb_per_s": round(megabytes(docs) / seconds, 5),
            "job_run_s": None if ran is None else round(ran, 2), "added": answer["added"],
            "num_chunks": answer.get("num_chunks")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    docs = documents(args.data, args.mb, args.doc_kb)
    result: dict[str, Any] = {"mb": round(megabytes(docs), 3), "documents": len(docs)}
    with tempfile.TemporaryDirectory(prefix="rasd-ingest-bench-") as folder:
        if not args.skip_cli:
            result["cli"] = run_cli(docs, Path(folder))
            print(f"rasd index build: {result['mb']} MB in {result['cli']['seconds']} s = "
                  f"{result['cli']['mb_per_s']} MB/s", flush=True)
    if not args.skip_http:
        result["http"] = run_http(docs, args.url, args.api_key)
        print(f"HTTP ingest job: {result['mb']} MB in {result['http']['seconds']} s = "
              f"{result['http']['mb_per_s']} MB/s (job ran {result['http']['job_run_s']} s)", flush=True)
    if "cli" in result and "http" in result:
        result["ratio"] = round(result["http"]["mb_per_s"] / result["cli"]["mb_per_s"], 3)
        print(f"HTTP / CLI: {result['ratio']}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
