"""The compute thread: queued calls run on one thread, and a service does all its torch work there.

Why it matters (rasd/decoding/runtime/compute.py): with torch running on two threads, libgomp stops spinning and
every decoding step of the service got up to 1.5x slower. The behaviour tested here is where work runs,
not how fast it runs.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rasd.decoding.runtime.compute import ComputeThread


def test_calls_run_on_the_compute_thread_in_order_and_return_or_raise() -> None:
    compute = ComputeThread(threads=1)
    try:
        seen: list[tuple[int, int]] = []
        futures = [compute.call(lambda i=i: seen.append((i, threading.get_ident())) or i * i) for i in range(5)]
        assert [f.result(timeout=10) for f in futures] == [0, 1, 4, 9, 16]
        assert [i for i, _ in seen] == list(range(5))
        assert {ident for _, ident in seen} == {compute._thread.ident} != {threading.get_ident()}
        assert compute.run(torch.get_num_threads) == 1 == compute.torch_threads
        with pytest.raises(ZeroDivisionError):
            compute.run(lambda: 1 / 0)
        assert compute.run(lambda: "still running") == "still running"
        # a call made from the compute thread itself runs at once instead of waiting behind itself
        assert compute.run(lambda: compute.run(lambda: 7) + 1) == 8
        assert asyncio.run(compute.acall(lambda x: x + 1, 41)) == 42
    finally:
        compute.close()
    assert not compute.is_alive()
    with pytest.raises(RuntimeError, match="stopped"):
        compute.call(lambda: None)


def test_closing_fails_the_calls_still_queued_and_tells_the_worker() -> None:
    compute = ComputeThread()
    gate = threading.Event()
    told: list[str] = []

    class Worker:
        def has_work(self) -> bool:
            return False

        def work_once(self) -> None:
            pass

        def stopped(self) -> None:
            told.append("stopped")

    compute.attach(Worker())
    running = threading.Event()
    blocker = compute.call(lambda: running.set() or gate.wait(10))
    assert running.wait(10)
    queued = compute.call(lambda: "never")
    closer = threading.Thread(target=compute.close)
    closer.start()
    gate.set()
    closer.join(10)
    assert blocker.result(timeout=10) is True
    with pytest.raises(RuntimeError, match="stopped"):
        queued.result(timeout=10)
    assert told == ["stopped"]


def test_background_slices_yield_to_decoding_steps() -> None:
    """An ingest's embedding slices (`run_background`) while requests decode: between two slices the worker
    gets at least as much time as the slice took, so a stream never waits more than one slice; with no
    request decoding, slices run back to back."""
    compute = ComputeThread()
    events: list[tuple[str, float, float]] = []
    steps_left = [0]

    class Worker:
        def has_work(self) -> bool:
            return steps_left[0] > 0

        def work_once(self) -> None:
            if steps_left[0] > 0:
                start = time.perf_counter()
                time.sleep(0.01)
                steps_left[0] -= 1
                events.append(("step", start, time.perf_counter()))

        def stopped(self) -> None:
            pass

    def slice_() -> None:
        start = time.perf_counter()
        time.sleep(0.05)
        events.append(("slice", start, time.perf_counter()))

    try:
        compute.attach(Worker())
        compute.run(lambda: steps_left.__setitem__(0, 400))
        for _ in range(5):
            compute.run_background(slice_)
        kinds = [kind for kind, _, _ in events]
        assert kinds.count("slice") == 5
        slices = [i for i, kind in enumerate(kinds) if kind == "slice"]
        for a, b in zip(slices, slices[1:], strict=False):
            stepped = sum(end - start for kind, start, end in events[a + 1:b] if kind == "step")
            assert stepped >= 0.8 * (events[a][2] - events[a][1]), (a, b, kinds)
        compute.run(lambda: steps_left.__setitem__(0, 0))
        events.clear()
        for _ in range(3):
            compute.run_background(slice_)
        assert [kind for kind, _, _ in events] == ["slice"] * 3      # idle: no steps owed, none run
    finally:
        compute.close()


@pytest.mark.slow
def test_a_worker_that_raises_does_not_stop_the_thread() -> None:
    """The scheduler fails its own requests on a bad step; should anything still escape `work_once`, the
    thread must go on serving calls and steps (a dead compute thread would leave every request hanging)."""
    compute = ComputeThread()
    calls: list[int] = []

    class Worker:
        def has_work(self) -> bool:
            return len(calls) < 2

        def work_once(self) -> None:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug in a step")

        def stopped(self) -> None:
            pass

    try:
        compute.attach(Worker())
        assert compute.call(lambda: "still serving").result(timeout=10) == "still serving"
        deadline = time.monotonic() + 10
        while compute.call(lambda: len(calls)).result(timeout=10) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) >= 2 and compute.is_alive()
    finally:
        compute.close()


def test_a_service_runs_all_its_torch_work_on_its_compute_thread(tmp_path: Path) -> None:
    """Decoding, query embedding and document ingest of a real service: every forward on one thread."""
    from rasd.decoding.model.kernels.linear import LINEARS
    from rasd.index import Document, build_index
    from rasd.index.embed import load_embedder
    from rasd.serve.openai import DocQARequest
    from rasd.serve.service import ServeConfig, Service
    from tests.helpers import DOCS, QUESTION

    index = tmp_path / "index"
    build_index([Document(text=t, title=title) for title, t in DOCS[:2]], index)
    service = Service(ServeConfig(index=str(index), threads=1))
    assert LINEARS.role(service.target.model.lm_head).head, "kernel forms chosen at start-up"
    threads: dict[str, set[int]] = {"target": set(), "embedder": set()}

    def recorder(name: str) -> Any:
        return lambda module, args: threads[name].add(threading.get_ident())

    service.target.model.lm_head.register_forward_pre_hook(recorder("target"))
    load_embedder(service.index.embedder_name)[0].register_forward_pre_hook(recorder("embedder"))
    try:
        ids, sources = service.docqa_prompt(QUESTION, 2, 16)
        request = DocQARequest(question=QUESTION, max_tokens=16)
        output = asyncio.run(service.run(service.prepare(request, ids, "rasd", 16, sources)))
        assert output.token_ids
        title, text = DOCS[2]
        assert service.add_documents([{"text": text, "title": title}])["added"] == 1
    finally:
        service.close()
    compute = service.compute._thread.ident
    assert threads["target"] == {compute}, "prefill and decoding steps ran on the compute thread only"
    assert threads["embedder"] == {compute}, "query and document embedding ran on the compute thread only"
