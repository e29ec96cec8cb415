"""Batch document QA with Ray Data (`rasd.apps.batch_job`): inputs, atomic parts, resume, equality with the
in-process pipeline, and `ray start --head` + `ray job submit` end to end.

Ray runs locally only: `ray.init(address="local")` in this process, or a head started by the test in its own
temporary folder, on free ports, in its own session (killed by session id afterwards, never `ray stop`, which
would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rasd.apps import batch_job as batch
from rasd.apps.batch_job import BatchError, done_ids, main, part_files, read_questions, write_part
from tests.helpers import free_ports, kill_session

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = [
    {"id": "for-else", "question": "How does the else clause of a for loop work?"},
    {"id": "with", "question": "What does the with statement do?"},
    {"id": "lambda", "question": "What is a lambda expression?"},
]
MAX_TOKENS = 16
TOP_K = 2          # two sources: prompts of ~450 tokens instead of ~870 keep prefill short on 2 cores


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------ inputs (no Ray, no model)


def test_read_questions_jsonl_and_parquet(tmp_path: Path) -> None:
    t = read_questions(write_jsonl(tmp_path / "q.jsonl", QUESTIONS))
    assert t.column("id").to_pylist() == ["for-else", "with", "lambda"]
    pq.write_table(pa.table({"question": ["a?", "b?", "c?"], "extra": [1, 2, 3]}), tmp_path / "q.parquet")
    t = read_questions(tmp_path / "q.parquet", limit=2)
    assert t.column("id").to_pylist() == ["0", "1"] and t.column("question").to_pylist() == ["a?", "b?"]
    pq.write_table(pa.table({"id": [7, 8], "question": ["a?", "b?"]}), tmp_path / "ints.parquet")
    assert read_questions(tmp_path / "ints.parquet").column("id").to_pylist() == ["7", "8"]


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("no-column", "no 'question' column (columns: id, text)"),
    ("empty-jsonl", "has no rows"),
    ("empty-parquet", "has no rows"),
    ("blank-question", "row 1 (id b): the question is empty"),
    ("duplicate-id", "id 'a' appears more than once"),
    ("wrong-suffix", "must be .parquet or .jsonl"),
])
def test_bad_inputs_give_one_line_errors_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    case: str, message: str) -> None:
    make = {
        "missing": lambda p: p.with_suffix(".jsonl"),
        "no-column": lambda p: write_jsonl(p.with_suffix(".jsonl"), [{"id": 1, "text": "x"}]),
        "empty-jsonl": lambda p: write_jsonl(p.with_suffix(".jsonl"), []),
        "empty-parquet": lambda p: p.with_suffix(".parquet"),
        "blank-question": lambda p: write_jsonl(p.with_suffix(".jsonl"), [{"id": "a", "question": "x?"},
                                                                          {"id": "b", "question": "  "}]),
        "duplicate-id": lambda p: write_jsonl(p.with_suffix(".jsonl"), [{"id": "a", "question": "x?"},
                                                                        {"id": "a", "question": "y?"}]),
        "wrong-suffix": lambda p: write_jsonl(p.with_suffix(".csv"), QUESTIONS),
    }
    path = make[case](tmp_path / "q")
    if case == "empty-parquet":
        pq.write_table(pa.table({"question": pa.array([], pa.string())}), path)
    with pytest.raises(BatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_questions(path)
    # the CLI: one line on stderr, exit 2, nothing started (the index is never even opened)
    assert main(["--input", str(path), "--output", str(tmp_path / "out"), "--index", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rasd batch: error: ") and message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_bad_index_and_options_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    assert main(["--input", str(q), "--output", str(tmp_path / "out"), "--index", str(tmp_path / "no-index")]) == 2
    assert "rasd batch: error:" in capsys.readouterr().err
    assert main(["--input", str(q), "--output", str(tmp_path / "o"), "--index", "x", "--method", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(["--input", str(q), "--output", str(tmp_path / "o"), "--index", "x", "--max-tokens", "0"]) == 2


def test_actor_cpus_fit_the_nodes_that_carry_the_resources(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    nodes = [{"CPU": 0}, {"CPU": 16, "rasd_retrieval": 1}, {"CPU": 8, "GPU": 1, "rasd_verifier": 1}]
    assert batch.default_num_cpus(nodes, 1) == 16                       # never more than one node has
    assert batch.default_num_cpus(nodes, 4) == 6                        # 24 CPUs over 4 actors
    assert batch.default_num_cpus(nodes, 1, num_gpus=1, resources={"rasd_verifier": 1}) == 8
    assert batch.default_num_cpus(nodes, 1, resources={"nowhere": 1}) == 1
    q = write_jsonl(tmp_path / "q.jsonl", QUESTIONS)
    assert main(["--input", str(q), "--output", str(tmp_path / "o"), "--index", "x", "--resources", "[1]"]) == 2
    assert "--resources must be a JSON object" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ atomic parts


def _rows(ids: list[str]) -> pa.Table:
    return pa.Table.from_pylist([{"id": i, "question": "q?", "answer": "a", "sources": [], "new_tokens": 1,
                                  "tokens_per_s": 0.0, "mean_accepted": 1.0, "method": "ar", "prompt_tokens": 3,
                                  "finish_reason": "length", "latency_s": 0.1, "error": None} for i in ids],
                                schema=batch.SCHEMA)


def test_parts_are_atomic_and_half_written_files_never_count(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    write_part(out, _rows(["a", "b"]))
    assert done_ids(out) == {"a", "b"} and len(part_files(out)) == 1
    # a crash between writing the temporary and renaming it: nothing new is committed, nothing left behind
    def crash(src: Any, dst: Any) -> None:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(batch.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        write_part(out, _rows(["c"]))
    monkeypatch.undo()
    assert done_ids(out) == {"a", "b"} and sorted(p.name for p in out.iterdir()) == [p.name for p in part_files(out)]
    # what a SIGKILL mid-write leaves (a truncated hidden temporary) is ignored by readers and by resume
    (out / ".part-crashed.parquet.tmp").write_bytes(b"PAR1 truncated")
    assert done_ids(out) == {"a", "b"}
    assert pq.read_table(out).num_rows == 2          # pyarrow's dataset reader skips hidden files too
    batch.remove_stale_temporaries(out)
    assert not (out / ".part-crashed.parquet.tmp").exists()


def _hidden(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("."))


def test_sigterm_while_a_part_is_written_commits_it_then_stops(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A real SIGTERM to this process in the middle of a part's write: the part is finished and committed, no
    further batch is asked for, and the job reports what it committed (a rerun resumes after it)."""
    out = tmp_path / "out"
    out.mkdir()
    real_write = batch.pq.write_table

    def write_signalled(table: pa.Table, where: Any, *args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        real_write(table, where, *args, **kwargs)

    def tables() -> Iterator[pa.Table]:
        yield _rows(["a", "b"])
        raise AssertionError("asked for another batch after SIGTERM")

    monkeypatch.setattr(batch.pq, "write_table", write_signalled)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(batch.BatchInterrupted) as stopped:
        batch.write_parts(tables(), out)
    assert (stopped.value.signum, stopped.value.answered, stopped.value.parts) == (signal.SIGTERM, 2, 1)
    assert done_ids(out) == {"a", "b"} and _hidden(out) == []
    assert signal.getsignal(signal.SIGTERM) == before, "the handler is put back"


def test_sigterm_while_a_batch_is_answered_drops_it_and_a_second_one_mid_write_discards_the_part(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    out.mkdir()

    def tables() -> Iterator[pa.Table]:
        yield _rows(["a"])
        os.kill(os.getpid(), signal.SIGTERM)          # while the next batch is being answered
        time.sleep(30)
        yield _rows(["b"])

    start = time.monotonic()
    with pytest.raises(batch.BatchInterrupted) as stopped:
        batch.write_parts(tables(), out)
    assert stopped.value.parts == 1 and time.monotonic() - start < 20
    assert done_ids(out) == {"a"} and _hidden(out) == []

    real_write = batch.pq.write_table

    def write_signalled_twice(table: pa.Table, where: Any, *args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)          # the second one stops at once, mid-write
        real_write(table, where, *args, **kwargs)

    monkeypatch.setattr(batch.pq, "write_table", write_signalled_twice)
    with pytest.raises(batch.BatchInterrupted) as stopped:
        batch.write_parts(iter([_rows(["c"])]), out)
    assert stopped.value.parts == 0
    assert done_ids(out) == {"a"} and _hidden(out) == [], "the half-written part was discarded"


def test_resume_refuses_an_output_made_with_other_options(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    batch.check_config(out, {"method": "rasd", "max_tokens": 16})
    batch.check_config(out, {"method": "rasd", "max_tokens": 16})     # same options: fine
    with pytest.raises(BatchError, match="max_tokens=16 \\(now 32\\)"):
        batch.check_config(out, {"method": "rasd", "max_tokens": 32})


# ------------------------------------------------------------------------------------ end to end, real model


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    import ray

    # never a running cluster; the custom resource of cluster.yaml's GPU nodes, to check actors are routed by it
    ray.init(address="local", num_cpus=2, resources={batch.VERIFIER_RESOURCE: 1}, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def sample_index() -> str:
    from rasd.apps.sample_corpus import ensure_sample_index

    return str(ensure_sample_index("default"))


@pytest.mark.slow
def test_batch_answers_equal_in_process_docqa_and_resume_skips_done_rows(tmp_path: Path, local_ray: None,
                                                                         sample_index: str) -> None:
    from rasd.apps.docqa import DocQA
    from rasd.decoding.model.loading import load_model
    from rasd.index.store import Index

    out = tmp_path / "answers"
    first = batch.run_batch(write_jsonl(tmp_path / "q1.jsonl", QUESTIONS[:1]), out, "sample",
                            max_tokens=MAX_TOKENS, top_k=TOP_K, concurrency=1, progress=False,
                            resources={batch.VERIFIER_RESOURCE: 1})
    assert (first.answered, first.skipped, first.total) == (1, 0, 1)

    # resume: the same output with one more question decodes only the new one
    asked = QUESTIONS[:2]
    second = batch.run_batch(write_jsonl(tmp_path / "q2.jsonl", asked), out, "sample",
                             max_tokens=MAX_TOKENS, top_k=TOP_K, concurrency=1, progress=False)
    assert (second.answered, second.skipped, second.total) == (1, 1, 2)
    table = pq.read_table(out)
    rows = {r["id"]: r for r in table.to_pylist()}
    assert table.num_rows == 2 and sorted(rows) == sorted(q["id"] for q in asked)
    assert set(table.column_names) >= {"id", "question", "answer", "sources", "new_tokens", "tokens_per_s",
                                       "mean_accepted", "method"}

    # a third run has nothing left to do and starts no actor
    third = batch.run_batch(write_jsonl(tmp_path / "q2b.jsonl", asked), out, "sample",
                            max_tokens=MAX_TOKENS, top_k=TOP_K, progress=False)
    assert (third.answered, third.skipped, third.parts) == (0, 2, 0)
    with pytest.raises(BatchError, match="other options"):     # other options never mix into this output
        batch.run_batch(tmp_path / "q2b.jsonl", out, "sample", max_tokens=MAX_TOKENS + 1, top_k=TOP_K)

    # greedy: every answer is the in-process pipeline's answer for the same question, token for token
    qa = DocQA(Index.open(sample_index), load_model("default"), method="rasd", max_new_tokens=MAX_TOKENS,
               top_k=TOP_K)
    for q in asked:
        row, ref = rows[q["id"]], qa.ask(q["question"])
        assert row["error"] is None and row["method"] == "rasd"
        assert row["answer"] == ref.answer, q["id"]
        assert [(s["doc_id"], s["chunk_id"]) for s in row["sources"]] == [(s.doc_id, s.chunk_id)
                                                                          for s in ref.sources]
        assert row["new_tokens"] == ref.stats.new_tokens and row["mean_accepted"] >= 1.0


# ------------------------------------------------------------------------------------ ray start --head + job submit


@pytest.fixture
def ray_head() -> Iterator[dict[str, Any]]:
    """`ray start --head` in a temporary folder, on free ports, with its own token (token auth stays on)."""
    temp = Path(tempfile.mkdtemp(prefix="rj-", dir="/tmp"))     # short: Ray's socket paths have a length limit
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), RAY_USAGE_STATS_ENABLED="0")
    gcs, dash, client, agent, agent_grpc, rt_env, metrics, objm, nodem = free_ports(9)
    ray_cli = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray_cli, "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--include-dashboard=true", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={rt_env}", f"--metrics-export-port={metrics}",
         f"--object-manager-port={objm}", f"--node-manager-port={nodem}", f"--temp-dir={temp}", "--num-cpus=2",
         "--disable-usage-stats"],
        env=env, stdout=open(temp / "head.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/api/version", timeout=2)
                break
            except urllib.error.HTTPError:
                break                                   # up (an auth refusal still means it answers)
            except OSError:
                if head.poll() is not None or time.time() > deadline:
                    pytest.fail(f"ray start --head did not come up:\n{(temp / 'head.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"url": url, "env": env, "ray": ray_cli}
    finally:
        kill_session(head.pid)
        head.wait(timeout=10)
        subprocess.run(["rm", "-rf", str(temp)], check=False)


@pytest.mark.slow
def test_ray_job_submit_runs_the_batch_pipeline(tmp_path: Path, sample_index: str,
                                                ray_head: dict[str, Any]) -> None:
    q = write_jsonl(tmp_path / "q.jsonl", QUESTIONS[:1])
    out = tmp_path / "answers"
    cmd = [ray_head["ray"], "job", "submit", "--address", ray_head["url"], "--working-dir", str(REPO), "--",
           sys.executable, "-m", "rasd.apps.batch_job", "--input", str(q), "--output", str(out),
           "--index", sample_index, "--max-tokens", "8", "--top-k", "1", "--no-progress"]
    # without the token the job API refuses (token auth is on and stays on)
    no_token = {k: v for k, v in ray_head["env"].items() if not k.startswith("RAY_AUTH")}
    no_token["HOME"] = str(tmp_path)                    # no ~/.ray/auth_token to fall back on
    refused = subprocess.run(cmd, env=no_token, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "Authentication required" in refused.stdout + refused.stderr
    done = subprocess.run(cmd, env=ray_head["env"], capture_output=True, text=True, timeout=240, cwd=REPO)
    log = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in log, log[-4000:]
    assert "rasd batch: answered 1, skipped 0" in log
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["for-else"] and rows[0]["answer"] and rows[0]["new_tokens"] == 8
