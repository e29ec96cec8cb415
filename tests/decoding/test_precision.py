"""`--dtype auto`: the fastest dtype that is exact against its own plain decoding, measured once per machine.

The choice logic runs on stubbed timings (the machine's real speeds are whatever they are); the timing-and-check
itself runs for real on tiny random Llamas, where bf16 must come out exact and fp32 is the reference.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from rasd.decoding.model import precision
from rasd.decoding.model.kernels.forms import onednn_bf16
from rasd.decoding.model.loading import LoadedModel, ModelLoadError, load_model
from tests.helpers import tiny_llama


class Loads:
    """A loader that hands out tiny models and counts what it was asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, dtype: str) -> LoadedModel:
        self.asked.append(dtype)
        with torch.inference_mode(False):
            model = copy.deepcopy(tiny_llama(0)).to(getattr(torch, dtype))
        return LoadedModel(model=model, tokenizer=None, name="tiny", device="cpu", dtype=dtype)


@pytest.fixture(autouse=True)
def measured_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite pins `auto` to float32 (conftest); these tests choose among the real candidates."""
    monkeypatch.delenv("RASD_DTYPE_CANDIDATES", raising=False)


@pytest.fixture
def native(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RASD_NATIVE_BF16", "1")


def stub_timings(monkeypatch: pytest.MonkeyPatch, results: dict[str, tuple[float, bool]]) -> None:
    def timed(model: torch.nn.Module) -> tuple[float, bool]:
        return results[str(next(model.parameters()).dtype).removeprefix("torch.")]

    monkeypatch.setattr(precision, "_time_and_check", timed)


def test_a_machine_without_native_bf16_runs_float32_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RASD_NATIVE_BF16", "0")
    loads = Loads()
    choice = precision.choose("tiny-none", "cpu", loads)
    assert choice.dtype == "float32" and "no native bf16" in choice.reason and loads.asked == []


@pytest.mark.usefixtures("native")
def test_bf16_is_chosen_when_exact_and_faster_and_the_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    stub_timings(monkeypatch, {"float32": (10000.0, False), "bfloat16": (6000.0, True)})
    loads = Loads()
    first = precision.choose("tiny-faster", "cpu", loads)
    assert first.dtype == "bfloat16" and first.step_ms == {"float32": 10000.0, "bfloat16": 6000.0}
    assert "bfloat16 6.00 s" in first.reason and loads.asked == ["float32", "bfloat16"]
    again = precision.choose("tiny-faster", "cpu", loads)
    assert again == first and loads.asked == ["float32", "bfloat16"], "read from the machine's file, not measured"


@pytest.mark.usefixtures("native")
@pytest.mark.parametrize(("bf16", "why"), [((9.8, True), "not 5% faster"), ((4.0, False), "not exact")])
def test_auto_never_picks_a_dtype_that_is_slower_or_not_exact(monkeypatch: pytest.MonkeyPatch,
                                                               bf16: tuple[float, bool], why: str) -> None:
    stub_timings(monkeypatch, {"float32": (10.0, False), "bfloat16": bf16})
    choice = precision.choose(f"tiny-{why}", "cpu", Loads())
    assert choice.dtype == "float32", why
    if not bf16[1]:
        assert "bfloat16 not exact" in choice.reason


@pytest.mark.skipif(not onednn_bf16(),
                    reason="this CPU has no oneDNN bf16 kernels")
def test_the_real_check_finds_bf16_exact_on_a_tiny_llama() -> None:
    ms, exact = precision._time_and_check(Loads()("bfloat16").model)
    assert exact and ms > 0


def test_an_unknown_dtype_is_a_one_line_error_before_loading() -> None:
    with pytest.raises(ModelLoadError, match="choose auto, int8, int4 or one of"):
        load_model("default", dtype="float8")


def test_load_model_auto_keeps_why_and_says_it_only_when_it_is_news(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: Any) -> None:
    """Pinned to fp32 nothing is measured: the reason is kept (for /healthz), stderr stays quiet (a CLI error is
    one line); a measured or non-fp32 choice is printed."""
    monkeypatch.setenv("RASD_DTYPE_CANDIDATES", "float32")
    loaded = load_model("default", dtype="auto")
    assert loaded.dtype == "float32" and "the only candidate" in loaded.dtype_reason
    assert "rasd: dtype" not in capsys.readouterr().err
    monkeypatch.setattr(precision, "choose", lambda *_: precision.DtypeChoice("float32", "measured", {"a": 1.0}))
    load_model("default", dtype="auto")
    assert "rasd: dtype float32 (measured)" in capsys.readouterr().err


def test_auto_never_quantizes_and_the_candidates_can_be_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RASD_NATIVE_BF16", "0")
    assert precision.candidates("cpu", "default") == ["float32"]
    monkeypatch.setenv("RASD_NATIVE_BF16", "1")
    assert precision.candidates("cpu", "default") == ["float32", "bfloat16"]
    assert precision.candidates("cpu", "HuggingFaceTB/SmolLM2-360M") == ["float32", "bfloat16"]
    monkeypatch.setenv("RASD_DTYPE_CANDIDATES", "float32,int4")
    assert precision.candidates("cpu", "default") == ["float32", "int4"]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_real_check_finds_weight_only_dtypes_exact(dtype: str) -> None:
    from rasd.decoding.model.kernels.linear import quantize_model

    model = quantize_model(Loads()("bfloat16").model, int(dtype[3:]))
    assert precision._time_and_check(model)[1]
