"""Batch document QA with Ray Data: a file of questions in, Parquet answers with sources and statistics out.

    python -m rasd.apps.batch_job --input questions.jsonl --output answers/ --index sample [--method rasd]
    ray job submit --working-dir . -- python -m rasd.apps.batch_job --input ... --output ... --index ...

Each question goes through the in-process document-QA pipeline (`DocQA.ask`: retrieval, cited prompt,
speculative decoding with the index as datastore) inside a Ray Data `map_batches` whose callable class loads
the model and opens the index once per actor; `--concurrency` actors run side by side.

The output is a folder of Parquet parts written by the driver as results stream in. Each part is written to a
hidden temporary file, fsynced and renamed into place, so a crash never leaves a half-written part that a
later run counts as done (Parquet readers and this module skip names starting with `.` or `_`). Rerunning with
the same `--output` skips every question whose id is already in a part: that is how a job resumes. SIGTERM or
SIGINT (`ray job stop`, a supervisor, Ctrl+C) stops the job the same clean way: a part being written is
finished and committed, the batch still being answered is dropped (a rerun answers it), and the job exits
128 + the signal's number saying how far it got.
`_batch.json` records the options that change answers (model, index, method, max tokens, top-k); a rerun with
different ones is refused rather than mixing two kinds of answer in one output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rasd.cli_options import add_repetition_args, repetition_window
from rasd.decoding.runtime.repetition import DEFAULT_WINDOW, check_window
from rasd.fsio import crash_point, fsync_dir, write_json_atomic

PART_PREFIX = "part-"
VERIFIER_RESOURCE = "rasd_verifier"     # custom resource of cluster.yaml's GPU nodes (the target model runs there)
RETRIEVAL_RESOURCE = "rasd_retrieval"   # custom resource of cluster.yaml's CPU nodes (retrieval shards, drafters)
CONFIG_NAME = "_batch.json"
SOURCE_TYPE = pa.struct([("doc_id", pa.int64()), ("chunk_id", pa.int64()), ("score", pa.float64())])
SCHEMA = pa.schema([
    ("id", pa.string()),
    ("question", pa.string()),
    ("answer", pa.string()),
    ("sources", pa.list_(SOURCE_TYPE)),
    ("new_tokens", pa.int64()),
    ("tokens_per_s", pa.float64()),
    ("mean_accepted", pa.float64()),
    ("method", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("latency_s", pa.float64()),
    ("error", pa.string()),            # null when answered; the message of a question the pipeline refused
])


class BatchError(Exception):
    """A user-facing error (missing input, missing column, empty input, option mismatch): one line, exit 2."""


class BatchInterrupted(Exception):
    """Stopped by a signal: `answered` rows in `parts` parts are committed; a rerun resumes after them."""

    def __init__(self, signum: int, answered: int = 0, parts: int = 0):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.answered, self.parts = signum, answered, parts


class _Signalled(BaseException):
    """Raised by `StopOnSignal`'s handler where the main thread is (BaseException: no `except Exception` eats it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StopOnSignal:
    """SIGTERM/SIGINT while parts are written: outside a part's write the job stops at once (the batch being
    answered is dropped); during one, the write completes and commits first. A second signal stops at once
    even mid-write (`write_part` then removes its temporary: never a half-written part)."""

    def __init__(self) -> None:
        self.signum = 0
        self.writing = False
        self._before: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._before[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        again = bool(self.signum)
        self.signum = signum
        if again or not self.writing:
            raise _Signalled(signum)

    @contextlib.contextmanager
    def part(self) -> Iterator[None]:
        """Around one part's write: a signal that arrives meanwhile takes effect once it is committed."""
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.signum:
            raise _Signalled(self.signum)


@dataclass
class BatchResult:
    """What a run did: rows answered now, rows skipped as already done, rows in the output altogether."""

    answered: int
    skipped: int
    total: int
    parts: int
    output: Path
    seconds: float


# ------------------------------------------------------------------------------------------------ input


def read_questions(path: str | Path, limit: int | None = None) -> pa.Table:
    """`id` (string) and `question` columns from a .parquet or .jsonl file; ids default to the row number."""
    path = Path(path)
    if not path.exists():
        raise BatchError(f"input file {path} does not exist")
    if not path.is_file():
        raise BatchError(f"input {path} is not a file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            table = pq.read_table(path)
        elif suffix in (".jsonl", ".json", ".ndjson"):
            import pyarrow.json as pj

            table = pj.read_json(path) if path.stat().st_size else pa.table({})
        else:
            raise BatchError(f"input {path} must be .parquet or .jsonl")
    except (pa.ArrowInvalid, OSError) as exc:
        raise BatchError(f"cannot read {path}: {str(exc).splitlines()[0]}") from exc
    if table.num_rows == 0:
        raise BatchError(f"input {path} has no rows")
    if "question" not in table.column_names:
        cols = ", ".join(table.column_names) or "none"
        raise BatchError(f"input {path} has no 'question' column (columns: {cols})")
    questions = table.column("question").to_pylist()
    if "id" in table.column_names:
        ids = [None if v is None else str(v) for v in table.column("id").to_pylist()]
    else:
        ids = [str(i) for i in range(len(questions))]
    for row, (qid, q) in enumerate(zip(ids, questions, strict=True)):
        if qid is None or qid == "":
            raise BatchError(f"input {path} row {row}: the id is empty")
        if not isinstance(q, str) or not q.strip():
            raise BatchError(f"input {path} row {row} (id {qid}): the question is empty")
    seen: set[str] = set()
    for qid in ids:
        if qid in seen:
            raise BatchError(f"input {path}: id {qid!r} appears more than once")
        seen.add(qid)
    out = pa.table({"id": pa.array(ids, pa.string()), "question": pa.array(questions, pa.string())})
    return out.slice(0, limit) if limit is not None else out


# ------------------------------------------------------------------------------------------------ output


def part_files(output: Path) -> list[Path]:
    """Committed parts only: temporary files (hidden names) are never counted."""
    if not output.is_dir():
        return []
    return sorted(p for p in output.iterdir() if p.name.startswith(PART_PREFIX) and p.suffix == ".parquet")


def done_ids(output: Path) -> set[str]:
    """Ids already answered in `output`'s committed parts."""
    ids: set[str] = set()
    for part in part_files(output):
        ids.update(str(v) for v in pq.read_table(part, columns=["id"]).column("id").to_pylist())
    return ids


def write_part(output: Path, table: pa.Table) -> Path:
    """Write one part atomically: hidden temporary file, fsync, rename, fsync the folder.

    `RASD_INDEX_CRASH_AT=batch-part` exits between the fsynced temporary and the rename (crash tests).
    """
    name = f"{PART_PREFIX}{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:12]}.parquet"
    final = output / name
    tmp = output / f".{name}.tmp"
    try:
        pq.write_table(table.cast(SCHEMA), tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        crash_point("batch-part")
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(output)
    return final


def remove_stale_temporaries(output: Path) -> None:
    """Temporaries left by a crashed run hold nothing committed; drop them."""
    for p in output.glob(f".{PART_PREFIX}*.tmp"):
        p.unlink(missing_ok=True)


def check_config(output: Path, config: dict[str, Any]) -> None:
    """Refuse to resume into an output written with options that change the answers; record them otherwise."""
    path = output / CONFIG_NAME
    if path.exists():
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BatchError(f"cannot read {path}: {exc}") from exc
        diff = [f"{k}={before.get(k)!r} (now {v!r})" for k, v in config.items() if before.get(k) != v]
        if diff:
            raise BatchError(f"{output} holds answers made with other options: {', '.join(diff)}; "
                             "use another --output or the same options")
        return
    write_json_atomic(path, config)


# ------------------------------------------------------------------------------------------------ the actor


class Answerer:
    """Ray Data callable class: model and index loaded once per actor, then `DocQA.ask` per question."""

    def __init__(self, index: str, model: str = "default", method: str = "rasd", max_tokens: int = 128,
                 top_k: int = 4, threads: int = 0, device: str = "cpu", dtype: str = "auto",
                 repetition: int = DEFAULT_WINDOW):
        import torch

        from rasd.apps.docqa import DocQA
        from rasd.decoding.model.loading import load_model
        from rasd.index.store import Index

        if threads:
            torch.set_num_threads(threads)   # Ray sets OMP_NUM_THREADS=1 unless the actor asked for CPUs
        target = load_model(model, device=device, dtype=dtype)
        self.method = method
        self.qa = DocQA(Index.open(index), target, method=method, max_new_tokens=max_tokens, top_k=top_k,
                        repetition=repetition)

    def answer(self, qid: str, question: str) -> dict[str, Any]:
        """One output row; a question the pipeline refuses (e.g. too long alone) gets `error`, not a crash."""
        start = time.perf_counter()
        try:
            a = self.qa.ask(question)
        except ValueError as exc:
            return {"id": qid, "question": question, "answer": "", "sources": [], "new_tokens": 0,
                    "tokens_per_s": 0.0, "mean_accepted": 0.0, "method": self.method, "prompt_tokens": 0,
                    "finish_reason": "error", "latency_s": time.perf_counter() - start, "error": str(exc)}
        return {"id": qid, "question": question, "answer": a.answer,
                "sources": [{"doc_id": s.doc_id, "chunk_id": s.chunk_id, "score": s.score} for s in a.sources],
                "new_tokens": a.stats.new_tokens, "tokens_per_s": a.stats.tokens_per_s,
                "mean_accepted": a.stats.mean_accepted_tokens, "method": self.method,
                "prompt_tokens": a.prompt_tokens, "finish_reason": a.finish_reason,
                "latency_s": time.perf_counter() - start, "error": None}

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = [self.answer(qid, q) for qid, q in zip(batch.column("id").to_pylist(),
                                                      batch.column("question").to_pylist(), strict=True)]
        return pa.Table.from_pylist(rows, schema=SCHEMA)


# ------------------------------------------------------------------------------------------------ the job


def resolve_index(spec: str, model: str) -> str:
    """An index folder, checked on the driver; `sample` is built here once, never inside the actors."""
    from rasd.index.store import Index, IndexOpenError

    if spec == "sample":
        from rasd.apps.sample_corpus import ensure_sample_index

        spec = str(ensure_sample_index(model))
    try:
        Index.open(spec)
    except IndexOpenError as exc:
        raise BatchError(str(exc)) from exc
    return str(Path(spec).resolve())


def batch_methods() -> list[str]:
    """The methods a batch job runs: every registered one that needs no separate draft model (the job
    loads none)."""
    from rasd.decoding.proposers.registry import METHODS, REQUIRED_DRAFT

    return [name for name, spec in METHODS.items() if spec.draft != REQUIRED_DRAFT]


def run_batch(input: str | Path, output: str | Path, index: str, method: str = "rasd", max_tokens: int = 128,
              concurrency: int = 1, limit: int | None = None, model: str = "default", top_k: int = 4,
              num_cpus: float | None = None, num_gpus: float = 0, resources: dict[str, float] | None = None,
              batch_size: int = 4, address: str | None = None, progress: bool = True,
              repetition: int = DEFAULT_WINDOW) -> BatchResult:
    """Answer every question of `input` not yet in `output`; Ray is started (and stopped) if not running.

    `address`: a Ray cluster to join; by default RAY_ADDRESS (set by `ray job submit`) or a new local Ray,
    never a cluster that merely happens to run on this machine. `num_gpus` > 0 runs the model on CUDA;
    `resources` (e.g. {"rasd_verifier": 1}) places the actors on the nodes that carry them (cluster.yaml).
    `repetition`: the repetition stop's window (`runtime.repetition`; 0: off).
    """
    start = time.perf_counter()
    if method not in batch_methods():
        raise BatchError(f"unknown method {method!r}; choose one of {', '.join(batch_methods())}")
    if resources is not None and not isinstance(resources, dict):
        raise BatchError("--resources must be a JSON object, e.g. '{\"rasd_verifier\": 1}'")
    if num_gpus < 0 or any(not isinstance(v, int | float) or v < 0 for v in (resources or {}).values()):
        raise BatchError("--num-gpus and --resources amounts must be non-negative numbers")
    if max_tokens < 1 or concurrency < 1 or top_k < 1 or batch_size < 1 or (limit is not None and limit < 1):
        raise BatchError("--max-tokens, --concurrency, --top-k, --batch-size and --limit must be at least 1")
    try:
        if repetition:
            check_window(repetition)
    except ValueError as exc:
        raise BatchError(f"--repetition-window: {exc}") from exc
    questions = read_questions(input, limit)
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise BatchError(f"output {output} exists and is not a folder")
    index_path = resolve_index(index, model)
    output.mkdir(parents=True, exist_ok=True)
    actor = {"index": index_path, "model": model, "method": method, "max_tokens": max_tokens, "top_k": top_k,
             "repetition": repetition}
    check_config(output, actor)
    remove_stale_temporaries(output)
    done = done_ids(output)
    todo = questions.filter(pa.array([qid not in done for qid in questions.column("id").to_pylist()]))
    skipped = questions.num_rows - todo.num_rows
    answered = parts = 0
    if todo.num_rows:
        answered, parts = _run_ray(todo, output, actor, concurrency, num_cpus, num_gpus, resources or {},
                                   batch_size, address, progress)
    return BatchResult(answered=answered, skipped=skipped, total=len(done_ids(output)), parts=parts,
                       output=output, seconds=time.perf_counter() - start)


def default_num_cpus(nodes: list[dict[str, float]], concurrency: int, num_gpus: float = 0,
                     resources: dict[str, float] | None = None) -> int:
    """CPUs (= torch threads) per actor: the eligible nodes' CPUs shared by the actors, never more than one
    eligible node has (an actor asking for more than any node offers would never be scheduled)."""
    need = dict(resources or {}, **({"GPU": num_gpus} if num_gpus else {}))
    cpus = [int(n.get("CPU", 0)) for n in nodes if all(n.get(k, 0) >= v for k, v in need.items())]
    if not cpus or max(cpus) < 1:
        return 1
    return max(1, min(max(cpus), sum(cpus) // concurrency))


def _run_ray(todo: pa.Table, output: Path, actor: dict[str, Any], concurrency: int, num_cpus: float | None,
             num_gpus: float, resources: dict[str, float], batch_size: int, address: str | None,
             progress: bool) -> tuple[int, int]:
    """Answer `todo` in an actor pool of `Answerer(**actor)`s, writing a part per finished batch."""
    import ray
    from tqdm import tqdm

    started = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or "local"
        extra = {"include_dashboard": False} if address == "local" else {}
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", **extra)
        started = True
    try:
        import ray.data

        logging.getLogger("ray.data").setLevel(logging.WARNING)   # no per-dataset INFO lines on stderr
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False          # our own bar counts rows written, not blocks
        ctx.execution_options.preserve_order = False
        if num_cpus is None:
            num_cpus = default_num_cpus([n["Resources"] for n in ray.nodes() if n.get("Alive")], concurrency,
                                        num_gpus, resources)
        threads = max(1, int(num_cpus))
        # one block per batch, made on the driver: a repartition would need CPU tasks that the actors,
        # holding every CPU of a small cluster, leave no room for (the job then waits forever)
        ds = ray.data.from_arrow([todo.slice(i, batch_size) for i in range(0, todo.num_rows, batch_size)])
        answers = ds.map_batches(
            Answerer, batch_format="pyarrow", batch_size=batch_size, num_cpus=num_cpus, num_gpus=num_gpus or None,
            resources=resources or None,
            compute=ray.data.ActorPoolStrategy(size=concurrency),
            fn_constructor_kwargs={**actor, "threads": threads, "device": "cuda" if num_gpus else "cpu"})
        with tqdm(total=todo.num_rows, unit="q", desc="rasd batch", disable=not progress,
                  file=sys.stderr) as bar:
            return write_parts(answers.iter_batches(batch_size=None, batch_format="pyarrow"), output, bar.update)
    finally:
        if started:
            ray.shutdown()


def write_parts(tables: Iterable[pa.Table], output: Path, progress: Any = None) -> tuple[int, int]:
    """Commit each table as a part; (rows, parts). SIGTERM/SIGINT stops cleanly (`StopOnSignal`) and raises
    `BatchInterrupted` with what was committed. Installed here, after `ray.init`, which sets its own handler."""
    answered = parts = 0
    with StopOnSignal() as stop:
        try:
            for table in tables:
                if table.num_rows == 0:
                    continue
                with stop.part():
                    write_part(output, table)
                    answered += table.num_rows
                    parts += 1
                if progress is not None:
                    progress(table.num_rows)
        except _Signalled as signalled:
            raise BatchInterrupted(signalled.signum, answered, parts) from None
    return answered, parts


# ------------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rasd.apps.batch_job",
                                description="Batch document QA over a .parquet/.jsonl file of questions (Ray Data)")
    p.add_argument("--input", required=True, help="questions: a `question` column, optional `id`")
    p.add_argument("--output", required=True, help="output folder of Parquet parts; rerunning resumes")
    p.add_argument("--index", required=True, help="index folder, or `sample` (the Python language reference)")
    p.add_argument("--model", default="default", help="HF hub id, local path, or `default` (SmolLM2-135M)")
    p.add_argument("--method", default="rasd", help="decoding method (default rasd)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per answer")
    p.add_argument("--top-k", type=int, default=4, help="retrieved chunks cited in each prompt")
    add_repetition_args(p, on=True)
    p.add_argument("--concurrency", type=int, default=1, help="actors, each with its own model")
    p.add_argument("--num-cpus", type=float, default=None,
                   help="CPUs (= torch threads) per actor; default: the cluster's CPUs / concurrency")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per actor (> 0: the model runs on CUDA)")
    p.add_argument("--resources", type=json.loads, default=None,
                   help=f'custom Ray resources per actor, JSON, e.g. \'{{"{VERIFIER_RESOURCE}": 1}}\' (cluster.yaml)')
    p.add_argument("--batch-size", type=int, default=4, help="questions per map_batches call (and per part)")
    p.add_argument("--limit", type=int, default=None, help="only the first N questions of the input")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, as `ray job submit` sets, else a new local Ray)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _repetition(args: argparse.Namespace) -> int:
    """The flags' repetition window, a bad one as a `BatchError`."""
    try:
        return repetition_window(args)
    except ValueError as exc:
        raise BatchError(str(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        result = run_batch(args.input, args.output, args.index, method=args.method, max_tokens=args.max_tokens,
                           concurrency=args.concurrency, limit=args.limit, model=args.model, top_k=args.top_k,
                           num_cpus=args.num_cpus, num_gpus=args.num_gpus, resources=args.resources,
                           batch_size=args.batch_size, address=args.address,
                           progress=not args.no_progress, repetition=_repetition(args))
    except BatchError as exc:
        print(f"rasd batch: error: {exc}", file=sys.stderr)
        return 2
    except BatchInterrupted as stop:
        print(f"rasd batch: stopped by {stop}: {stop.answered} answered in {stop.parts} new parts, all committed; "
              f"rerun the same command to resume", file=sys.stderr)
        return 128 + stop.signum
    except KeyboardInterrupt:
        return 130
    print(f"rasd batch: answered {result.answered}, skipped {result.skipped} already done, "
          f"{result.total} rows in {result.output} ({result.seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
