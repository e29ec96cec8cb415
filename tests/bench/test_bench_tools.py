"""bench/: every measurement tool starts and explains itself (`--help`), so none rots unnoticed between the
runs that need a quiet machine or the real model; the batch profile is also run on a tiny model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rasd.decoding.proposers import make_proposer
from rasd.decoding.runtime.engine import SpeculativeDecoder
from rasd.decoding.sizing.sizers import FixedSizer
from rasd.decoding.step.batch_decoder import BatchDecoder
from tests.helpers import ROOT, assert_greedy_equal, hf_greedy, load_script, random_prompt, tiny_llama

TOOLS = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))


def test_the_tools_are_the_expected_ones() -> None:
    assert "batch_profile" in TOOLS and "inprocess_load" in TOOLS and "index_bench" in TOOLS


@pytest.mark.parametrize("tool", TOOLS)
def test_help(tool: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / f"{tool}.py"), "--help"], capture_output=True,
                         text=True, timeout=180, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:") and f"bench/{tool}.py" in load_doc(tool)


def load_doc(tool: str) -> str:
    """The tool's docstring names its own path in its example commands."""
    return (ROOT / "bench" / f"{tool}.py").read_text(encoding="utf-8").split('"""')[1]


@pytest.mark.usefixtures("one_thread")
def test_batch_profile_counts_every_step_and_token() -> None:
    script = load_script("batch_profile")
    model = tiny_llama(0)
    prompts = [random_prompt(30, seed) for seed in (1, 2, 3)]
    streams = [SpeculativeDecoder(model, make_proposer("pld"), sizer=FixedSizer(8)).stream(p, 12) for p in prompts]
    result = script.profile(BatchDecoder(model), streams)
    assert result["requests"] == 3 and result["tokens"] == 36
    assert len(result["forwards"]) == len(result["widths"]) == len(result["rows"]) > 0
    assert max(result["rows"]) == 3 and min(result["widths"]) >= 1
    for prompt, stream in zip(prompts, streams, strict=True):
        assert_greedy_equal(model, prompt, stream.output.token_ids, hf_greedy(model, prompt, 12), "batch_profile")
    assert script.summary("pld", result).startswith("pld x 3:")


def test_docstrings_point_at_bench() -> None:
    for tool in TOOLS:
        assert "scripts/" not in load_doc(tool), f"bench/{tool}.py still points at scripts/"
