"""`rasd index build|add|compact|info|search|repair`: the retrieval index from the command line.

Index problems a person can fix (missing folder, binary file, mismatched tokenizer, corrupt manifest) are
raised as IndexStoreError and turned into the CLI's one-line `rasd: error: ...` with exit status 2.
Progress (tokenizing, embedding) and notes (IVF falling back to flat, skipped empty documents) go to stderr;
stdout carries only results.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from rasd.index.errors import IndexStoreError

_HANDLER_MARK = "_rasd_index_cli"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `index` and its subcommands; each handler is `args.func(args) -> exit code`."""
    parser = subparsers.add_parser("index", help="build, grow, inspect and search a retrieval index",
                                   description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="index_command", required=True)
    _add_build(sub)
    _add_add(sub)
    p = sub.add_parser("compact", help="merge all segments into one (no re-embedding)")
    p.add_argument("dir", type=Path)
    p.add_argument("--faiss", choices=["flat", "ivf", "hnsw"], default=None,
                   help="vector index kind of the merged segment (default: the index's)")
    _add_quiet(p)
    p.set_defaults(func=run_compact)
    p = sub.add_parser("info", help="counts, sizes, model and embedder of an index")
    p.add_argument("dir", type=Path)
    p.add_argument("--verify", action="store_true", help="also check every file's sha256")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_info)
    p = sub.add_parser("repair", help="commit a manifest rebuilt from the intact segments (corrupt manifest, "
                       "damaged segment); reports which segments were kept and skipped")
    p.add_argument("dir", type=Path)
    p.add_argument("--model", default="default",
                   help="the index's model, used only when no manifest is readable (default: default)")
    p.add_argument("--embedder", default="default",
                   help="the index's embedder, used only when no manifest is readable (default: default)")
    _add_quiet(p)
    p.set_defaults(func=run_repair)
    p = sub.add_parser("search", help="the chunks closest to a query")
    p.add_argument("dir", type=Path)
    p.add_argument("query")
    p.add_argument("-k", type=int, default=5, help="number of hits (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object per hit")
    p.set_defaults(func=run_search)
    return parser


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars or notes")


def _add_build(sub: Any) -> None:
    p = sub.add_parser("build", help="build a new index from .txt/.md/.jsonl/.parquet files and folders")
    p.add_argument("docs", nargs="+", type=Path, help="files or folders of documents")
    p.add_argument("--out", type=Path, required=True, help="index folder to create")
    p.add_argument("--model", default="default", help="target model whose tokenizer fills the token datastore")
    p.add_argument("--embedder", default="default", help="sentence-transformers model (default: all-MiniLM-L6-v2)")
    p.add_argument("--chunk-tokens", type=int, default=192, help="chunk length in target tokens")
    p.add_argument("--overlap", type=int, default=32, help="tokens shared by consecutive chunks")
    p.add_argument("--faiss", choices=["flat", "ivf", "hnsw"], default="flat", help="vector index kind")
    p.add_argument("--overwrite", action="store_true", help="replace an index already at --out")
    _add_quiet(p)
    p.set_defaults(func=run_build)


def _add_add(sub: Any) -> None:
    p = sub.add_parser("add", help="append documents to an index as a new segment")
    p.add_argument("dir", type=Path)
    p.add_argument("docs", nargs="+", type=Path, help="files or folders of documents")
    p.add_argument("--model", default=None, help="must tokenize like the index's model (default: the index's)")
    _add_quiet(p)
    p.set_defaults(func=run_add)


# --------------------------------------------------------------------------------------------- handlers


def _setup_logging(quiet: bool) -> None:
    """Index notes on stderr as `rasd: ...` (once per process, however often main() runs)."""
    logger = logging.getLogger("rasd.index")
    if not any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("rasd: %(message)s"))
        setattr(handler, _HANDLER_MARK, True)
        logger.addHandler(handler)
    for h in logger.handlers:
        if getattr(h, _HANDLER_MARK, False):
            h.stream = sys.stderr          # the current stderr (tests swap it)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def _guard(fn: Any, args: argparse.Namespace) -> int:
    """Run a handler, turning index errors into the CLI's one-line error."""
    from rasd.errors import CliError

    _setup_logging(getattr(args, "quiet", False))
    try:
        return int(fn(args) or 0)
    except IndexStoreError as exc:
        raise CliError(str(exc)) from exc


def _summary(index: Any) -> str:
    return (f"{index.root}: {index.num_documents} documents, {index.num_chunks} chunks, "
            f"{index.num_tokens} tokens in {len(index.segments)} segment(s)")


def run_build(args: argparse.Namespace) -> int:
    def go(a: argparse.Namespace) -> int:
        from rasd.index.writer import build_index

        index = build_index(a.docs, a.out, model=a.model, embedder=a.embedder, chunk_tokens=a.chunk_tokens,
                            overlap=a.overlap, faiss=a.faiss, overwrite=a.overwrite, progress=not a.quiet)
        print(_summary(index))
        return 0
    return _guard(go, args)


def run_add(args: argparse.Namespace) -> int:
    def go(a: argparse.Namespace) -> int:
        from rasd.index.writer import add_documents

        print(_summary(add_documents(a.dir, a.docs, model=a.model, progress=not a.quiet)))
        return 0
    return _guard(go, args)


def run_compact(args: argparse.Namespace) -> int:
    def go(a: argparse.Namespace) -> int:
        from rasd.index.writer import compact_index

        print(_summary(compact_index(a.dir, faiss=a.faiss)))
        return 0
    return _guard(go, args)


def run_repair(args: argparse.Namespace) -> int:
    def go(a: argparse.Namespace) -> int:
        from rasd.index.repair import repair_index

        for line in repair_index(a.dir, model=a.model, embedder=a.embedder).lines():
            print(line)
        return 0
    return _guard(go, args)


def index_info(index: Any) -> dict[str, Any]:
    """What `rasd index info` shows, as a dict."""
    m = index.manifest
    segments = [{"name": s["name"], "documents": s["num_documents"], "chunks": s["num_chunks"],
                 "tokens": s["num_tokens"], "faiss": s["faiss"],
                 "bytes": sum(int(f["bytes"]) for f in s["files"].values())} for s in m["segments"]]
    return {"path": str(index.root), "format_version": m["format_version"], "created": m.get("created"),
            "updated": m.get("updated"), "tokenizer": m["tokenizer"]["name"],
            "vocab_size": m["tokenizer"].get("vocab_size"), "embedder": m["embedder"]["name"],
            "embedding_dim": m["embedder"]["dim"], "chunking": m["chunking"], "faiss": m["faiss"],
            "documents": index.num_documents, "chunks": index.num_chunks, "tokens": index.num_tokens,
            "bytes": sum(s["bytes"] for s in segments), "segments": segments}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run_info(args: argparse.Namespace) -> int:
    def go(a: argparse.Namespace) -> int:
        from rasd.index.store import Index

        info = index_info(Index.open(a.dir, verify=a.verify))
        if a.verify:
            info["verified"] = True
        if a.json:
            print(json.dumps(info))
            return 0
        print(f"index      {info['path']} (format {info['format_version']}, updated {info['updated']})")
        print(f"tokenizer  {info['tokenizer']} (vocabulary {info['vocab_size']})")
        print(f"embedder   {info['embedder']} (dim {info['embedding_dim']}), faiss {info['faiss']}")
        print(f"chunks of  {info['chunking']['chunk_tokens']} tokens, overlap {info['chunking']['overlap']}")
        print(f"contents   {info['documents']} documents, {info['chunks']} chunks, {info['tokens']} tokens, "
              f"{_mb(info['bytes'])} on disk")
        for s in info["segments"]:
            print(f"  {s['name']}: {s['documents']} docs, {s['chunks']} chunks, {s['tokens']} tokens, "
                  f"{s['faiss']}, {_mb(s['bytes'])}")
        if a.verify:
            print("checksums  all files match the manifest")
        return 0
    return _guard(go, args)


def run_search(args: argparse.Namespace) -> int:
    def go(a: argparse.Namespace) -> int:
        from rasd.errors import CliError
        from rasd.index.store import Index

        if a.k < 1:
            raise CliError("-k must be at least 1")
        if not a.query.strip():
            raise CliError("the query is empty")
        hits = Index.open(a.dir).search(a.query, k=a.k)
        for rank, hit in enumerate(hits, 1):
            if a.json:
                print(json.dumps({"rank": rank, **hit.__dict__}))
            else:
                text = " ".join(hit.text.split())
                print(f"{rank}. [{hit.score:.3f}] doc {hit.doc_id} chunk {hit.chunk_id} "
                      f"{hit.title or hit.source}\n   {text[:300]}{'...' if len(text) > 300 else ''}")
        return 0
    return _guard(go, args)
