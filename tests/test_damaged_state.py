"""Damaged files under $RASD_HOME are a warning and a cold start, never a crash or a failed request.

The recycling matrix (read at a replica's start, saved while it serves), cost curves and the self-generation
cache of training: truncated, garbage and foreign files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rasd.decoding.proposers import RecyclingMatrix
from rasd.decoding.sizing.cost import CURVE_VERSION, load_or_measure
from rasd.distributed.backend import LocalBackend
from rasd.train.common import generation_key, greedy_continuations
from tests.helpers import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def saved_matrix(path: Path, vocab: int = 10) -> None:
    matrix = RecyclingMatrix(vocab, k=3)
    logits = torch.full((1, vocab), -5.0)
    logits[0, 2:5] = torch.tensor([3.0, 2.0, 1.0])
    matrix.update([1], logits)
    matrix.save(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not_a_matrix"])
def test_a_damaged_recycling_matrix_starts_cold_with_a_warning(tmp_path: Path, damage: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "m.npz"
    saved_matrix(path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00\xff" * 100, "empty": b"",
                      "not_a_matrix": b"PK\x03\x04" + data[4:40]}[damage])
    with caplog.at_level(logging.WARNING):
        matrix = RecyclingMatrix.load_or_new(path, 10, k=3)
    assert matrix.updates == 0 and not matrix.known(1)
    assert "starting cold" in caplog.text


def test_an_intact_matrix_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "m.npz"
    saved_matrix(path)
    assert RecyclingMatrix.load_or_new(path, 10, k=3).known(1)


def test_a_failed_save_during_serving_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The home became read-only (here: the target path is a folder): the request that triggered the save
    must not fail, and the previous file is untouched."""
    blocked = tmp_path / "matrix.npz"
    blocked.mkdir()
    service = SimpleNamespace(recycling=RecyclingMatrix(10, k=3), recycling_path=blocked)
    service.save_recycling = lambda: LocalBackend.save_recycling(service)
    with caplog.at_level(logging.WARNING):
        LocalBackend.save_recycling_quietly(service)
    assert "could not save the recycling matrix" in caplog.text
    assert blocked.is_dir()


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"key": 3}', "\udcff"])
def test_a_damaged_cost_curve_is_measured_again(tmp_path: Path, content: str) -> None:
    model = tiny_llama(0)
    curve = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    path = next(tmp_path.glob(f"*-v{CURVE_VERSION}.json"))
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    from rasd.decoding.sizing import cost

    cost._TRUSTED.clear()
    again = load_or_measure(model, "tiny", "cpu", "float32", 100, cache_dir=tmp_path)
    assert again.sizes == curve.sizes and all(t > 0 for t in again.latency_s)
    assert json.loads(path.read_text())["key"] == again.key, "the damaged file was replaced"


def test_a_damaged_self_generation_cache_is_regenerated(tmp_path: Path) -> None:
    model = tiny_llama(0)
    prompts = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
    first = greedy_continuations(model, prompts, 4, batch=2, eos=[], cache=tmp_path)
    file = tmp_path / f"{generation_key(model, prompts, 4, [])}.pt"
    assert file.exists()
    file.write_bytes(file.read_bytes()[:20])
    assert torch.equal(greedy_continuations(model, prompts, 4, batch=2, eos=[], cache=tmp_path), first)
    assert torch.equal(torch.load(file), first), "the cache was written again"
