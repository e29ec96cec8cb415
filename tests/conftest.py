"""Shared fixtures and helpers: tiny random Llama models, HF `generate` references, χ² helpers.

Tiny models run with one torch thread (`one_thread`): at this size thread start-up costs more than the
arithmetic, and two threads fighting another process for two cores made a tiny step ~50x slower.
Real-model tests keep torch's default threads (cost curves are cached per thread count).
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Read-mostly parts of $RASD_HOME that are expensive to build (the converted embedded model, sample and
# benchmark indexes, trained exit layers, the embedded model's cached self-generations): linked from the real
# home, built once. Only the embedded model's `selfgen` folder: tiny test models' would pile up in the real home.
SHARED_HOME_PARTS = ("models", "indexes", "bench-indexes", "eesd", "ldlp", "selfgen/default")


@pytest.fixture(scope="session", autouse=True)
def rasd_home_for_tests(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A session-scoped $RASD_HOME, so that what tests learn stays out of the developer's home.

    Why: the Token Recycling matrix and the cost curves are written back to $RASD_HOME, and `rasd serve`
    hot-starts from them; tests (random prompts, tiny models) would otherwise leave their matrix and a cost
    curve per temporary model there. Set in os.environ, so Ray workers and CLI subprocesses inherit it.
    """
    from rasd.decoding.model.loading import rasd_home

    real, before = rasd_home(), os.environ.get("RASD_HOME")
    home = tmp_path_factory.mktemp("rasd_home")
    for part in SHARED_HOME_PARTS:
        (real / part).mkdir(parents=True, exist_ok=True)
        (home / part).parent.mkdir(parents=True, exist_ok=True)
        (home / part).symlink_to(real / part, target_is_directory=True)
    os.environ["RASD_HOME"] = str(home)
    # `--dtype auto` (the CLI and service default) takes fp32 in tests whatever the CPU: outputs compared with
    # fp32 references stay machine-independent; bf16 / int4 are tested where asked for (test_row_exact,
    # test_precision)
    native_before = os.environ.get("RASD_DTYPE_CANDIDATES")
    os.environ["RASD_DTYPE_CANDIDATES"] = "float32"
    try:
        yield home
    finally:
        if before is None:
            os.environ.pop("RASD_HOME", None)
        else:
            os.environ["RASD_HOME"] = before
        if native_before is None:
            os.environ.pop("RASD_DTYPE_CANDIDATES", None)
        else:
            os.environ["RASD_DTYPE_CANDIDATES"] = native_before


@pytest.fixture(scope="module", autouse=True)
def return_freed_memory() -> Iterator[None]:
    """After each test file: collect, and give glibc's freed pages back to the system (`malloc_trim`).

    Why: models, services and their threads freed by one file stayed in the process's malloc arenas, so the
    suite's process grew by 1-4 GB a file to 17.7 GB, and Ray's memory monitor (95% of a 24 GB machine) killed
    the Serve replicas of the next tests. Trimmed, a service built and closed three times stays at 2.6 GB."""
    yield
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to trim this way
        pass


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The Serve app on a local Ray: real embedded model, a small real index, an API key.

    Session-scoped: test_serve.py and test_web.py share one app start (the model load dominates).
    """
    pytest.importorskip("ray.serve")
    httpx = pytest.importorskip("httpx")
    import ray
    from ray import serve

    from rasd.index import Document, build_index
    from rasd.serve.app import build_app
    from tests.helpers import DOCS, KEY, free_port

    index = tmp_path_factory.mktemp("serve") / "index"
    build_index([Document(text=t, source=f"test:{title}", title=title) for title, t in DOCS], index)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a running cluster
    port = free_port()   # after ray.init: Ray's own processes take ephemeral ports while starting
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = {"index": str(index), "api_key": KEY, "max_batch": 4, "max_waiting": 1, "max_tokens_limit": 512,
              "threads": 2}
    serve.run(build_app(config), name="rasd-test", route_prefix="/")
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=300)
    yield {"client": client, "url": f"http://127.0.0.1:{port}", "index": index}
    client.close()
    serve.shutdown()
    ray.shutdown()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run a tiny-model test with one torch thread, restoring the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
