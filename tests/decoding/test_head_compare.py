"""Heads compared position by position: the paired difference's arithmetic, and the comparison of two heads
trained by `rasd train eagle` on a tiny model, which must read the training report's own held-out numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rasd.cli import main
from rasd.train.head_compare import compare_heads, format_comparison, paired_differences
from tests.decoding.test_eagle import conversations_file
from tests.decoding.test_eesd import tiny_model_dir  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def test_paired_difference_counts_where_one_head_is_right_and_the_other_wrong() -> None:
    ok = torch.ones(1, 3, 4, dtype=torch.bool)                    # one depth, 3 sequences of 4 positions
    ok[0, 2, 3] = False                                          # a position after EOS counts for neither
    a = torch.zeros(1, 3, 4, dtype=torch.bool)
    b = torch.zeros(1, 3, 4, dtype=torch.bool)
    b[0, 0, :2] = True                                           # B right where A is wrong: +2 in sequence 0
    a[0, 1, 0] = True                                            # A right where B is wrong: -1 in sequence 1
    a[0, 2, :] = b[0, 2, :] = True                               # both right: no difference
    (diff,) = paired_differences(a & ok, b & ok, ok)
    assert diff.positions == 11 and diff.depth == 1
    assert diff.difference == pytest.approx(1 / 11)
    # cluster-robust over sequences: residuals per sequence d_k - mean * n_k
    mean = 1 / 11
    spread = (2 - 4 * mean) ** 2 + (-1 - 4 * mean) ** 2 + (0 - 3 * mean) ** 2
    assert diff.se == pytest.approx(math.sqrt(spread * 3 / 2) / 11)
    (same,) = paired_differences(a, a, ok)
    assert same.difference == 0 and same.se == 0


def test_two_trained_heads_compared_on_the_held_out_text_of_their_report(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from rasd.decoding.model.loading import load_model

    monkeypatch.setenv("RASD_HOME", str(tmp_path / "home"))
    data = conversations_file(tmp_path)
    args = ["train", "eagle", "--model", str(tiny_model_dir), "--data", str(data), "--seqs", "16", "--seq-len", "64",
            "--batch", "4", "--draft-vocab", "40", "--eval-seqs", "4"]
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert main([*args, "--steps", "5", "--out", str(first)]) == 0
    assert main([*args, "--steps", "40", "--lr", "3e-3", "--out", str(second)]) == 0
    target = load_model(str(tiny_model_dir), dtype="float32")
    result = compare_heads(target, [first, second], str(data), 4, str(tiny_model_dir))
    for row, head in zip(result["heads"], (first, second), strict=True):
        report = json.loads(head.with_suffix(".json").read_text())
        # the report's held-out positions, scored the same way (the file's fp16 weights may flip a near tie)
        assert [p["positions"] for p in row["against_first"]] == report["agreement"]["positions"]
        assert row["top1"] == pytest.approx(report["agreement"]["top1"], abs=0.03)
    ref, other = (row["against_first"] for row in result["heads"])
    assert all(p["difference"] == 0 for p in ref)
    top1 = [row["top1"] for row in result["heads"]]
    for p in other:
        assert p["difference"] == pytest.approx(top1[1][p["depth"] - 1] - top1[0][p["depth"] - 1], abs=1e-3)
    assert "paired against the first" in format_comparison(result)


def test_average_init_saves_the_mean_of_the_trained_head_and_its_parent(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import load_file

    monkeypatch.setenv("RASD_HOME", str(tmp_path / "home"))
    args = ["train", "eagle", "--model", str(tiny_model_dir), "--data", str(conversations_file(tmp_path)),
            "--seqs", "16", "--seq-len", "64", "--batch", "4", "--draft-vocab", "40", "--eval-seqs", "4"]
    parent, trained, averaged = (tmp_path / f"{n}.safetensors" for n in ("parent", "trained", "averaged"))
    assert main([*args, "--steps", "5", "--out", str(parent)]) == 0
    more = [*args, "--steps", "20", "--lr", "3e-3", "--init", str(parent)]
    assert main([*more, "--out", str(trained)]) == 0
    assert main([*more, "--out", str(averaged), "--average-init", "0.5"]) == 0, "resumes the finished training"
    p, t, a = (load_file(str(f)) for f in (parent, trained, averaged))
    assert torch.equal(a["draft_vocab"], p["draft_vocab"])
    for key in ("fc.weight", *[k for k in a if k.startswith("layer.")][:3]):
        assert not torch.equal(t[key], p[key])
        assert torch.allclose(a[key].float(), 0.5 * t[key].float() + 0.5 * p[key].float(), atol=2e-3), key
    report, report_t = (json.loads(f.with_suffix(".json").read_text()) for f in (averaged, trained))
    assert report["average_init"] == 0.5 and report["agreement_trained"] == report_t["agreement"]
    for bad, why in ((["--average-init", "0.5"], "give --init"), (["--init", str(parent), "--average-init", "0"],
                                                                   "above 0")):
        assert main([*args, "--out", str(tmp_path / "x.safetensors"), *bad]) == 2
        assert why in capsys.readouterr().err
