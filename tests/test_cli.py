"""`rasd generate`: one-line errors with a non-zero exit, JSON output, streaming text, on a tiny local model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rasd.cli import main
from rasd.decoding.proposers import METHODS

CORPUS = ("the quick brown fox jumps over the lazy dog . " * 20 + "a b c d e f g h i j k l m n o p . ") * 5


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a real (tiny, trained here) BPE tokenizer, saved like a hub model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-llama")
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                         eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("method", ["ar", "pld", "retrieval", "rasd"])
def test_json_output_is_one_object_with_stats(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str],
                                             method: str) -> None:
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", method, "--prompt",
                           "the quick brown fox jumps over the lazy dog . the quick", "--max-new-tokens", "12",
                           "--sizing", "fixed", "--json")
    assert code == 0
    payload = json.loads(out)
    assert set(payload) >= {"text", "token_ids", "stats"}
    assert 1 <= len(payload["token_ids"]) <= 12
    assert payload["stats"]["new_tokens"] == len(payload["token_ids"])
    assert payload["stats"]["method"] == method


def test_methods_give_identical_tokens(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    outputs = []
    for method in ("ar", "pld"):
        run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", method, "--prompt",
                "a b c d e f g h a b c d", "--max-new-tokens", "20", "--sizing", "fixed", "--json")
    for method in ("ar", "pld", "retrieval", "rasd"):
        _, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", method, "--prompt",
                            "a b c d e f g h a b c d", "--max-new-tokens", "20", "--sizing", "fixed", "--json")
        outputs.append(json.loads(out)["token_ids"])
    assert all(o == outputs[0] for o in outputs[1:])


def test_streaming_text_and_stats_line(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "pld", "--chat",
                             "--prompt", "the lazy dog", "--max-new-tokens", "8", "--sizing", "fixed")
    assert code == 0
    assert out.endswith("\n")
    assert "[pld]" in err and "mean accepted" in err


@pytest.mark.parametrize("args, message", [
    (["--method", "nope", "--prompt", "hi"], "unknown method 'nope'"),
    (["--method", "ar", "--prompt", "   "], "the prompt is empty"),
    (["--method", "draft", "--prompt", "hi"], "needs --draft-model"),
    (["--method", "ar", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--method", "ar", "--prompt", "hi", "--temperature", "-1"], "temperature"),
])
def test_bad_arguments_give_one_line_error(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str],
                                           args: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err and err.startswith("rasd: error:")


def test_prompt_longer_than_context(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "ar",
                           "--prompt", "a b c d " * 40)
    assert code == 2 and "context is 64" in err and err.count("\n") == 1


def test_missing_model_and_prompt_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nowhere"), "--method", "ar",
                           "--prompt", "hi")
    assert code == 2 and "cannot load model" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "generate", "--method", "ar", "--prompt-file", str(tmp_path / "missing.txt"))
    assert code == 2 and "cannot read prompt file" in err


def test_console_script_exit_status(tiny_model_dir: Path) -> None:
    """The real process: non-zero status and a single stderr line."""
    proc = subprocess.run([sys.executable, "-m", "rasd.cli", "generate", "--model", str(tiny_model_dir),
                           "--method", "bogus", "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    expected = f"rasd: error: unknown method 'bogus'; choose one of {', '.join(METHODS)}"
    assert proc.stderr.strip().splitlines() == [expected]


@pytest.mark.parametrize(("args", "message"), [
    (["--prefix-cache-mb", "-1"], "prefix-cache-mb must be >= 0 (got -1)"),
    (["--max-batch", "0"], "max-batch must be >= 1 (got 0)"),
    (["--max-waiting", "-2"], "max-waiting must be >= 0 (got -2)"),
])
def test_serve_limits_out_of_range_give_one_line_error_before_ray_starts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], message: str) -> None:
    import ray

    def no_ray(*_: object, **__: object) -> None:
        raise AssertionError("Ray must not start for a bad limit")

    monkeypatch.setattr(ray, "init", no_ray)
    code, out, err = run_cli(capsys, "serve", *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and err.startswith("rasd: error:")


def test_serve_beyond_loopback_without_a_key_is_refused_before_ray_starts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def no_ray(*_: object, **__: object) -> None:
        raise AssertionError("Ray must not start for a keyless service beyond loopback")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.delenv("RASD_API_KEY", raising=False)
    code, out, err = run_cli(capsys, "serve", "--host", "0.0.0.0")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--host 0.0.0.0 without an API key" in err and "--insecure-no-key" in err


def test_serve_config_checks_its_limits() -> None:
    from rasd.serve.config import ServeConfig

    assert ServeConfig.from_dict({"max_batch": 8, "prefix_cache_mb": 0}).prefix_cache_mb == 0
    with pytest.raises(ValueError, match="prefix_cache_mb must be >= 0"):
        ServeConfig.from_dict({"prefix_cache_mb": -5})
    with pytest.raises(ValueError, match="serve config has unknown keys: modle"):
        ServeConfig.from_dict({"modle": "default"})


def test_stop_waits_for_serve_only_as_long_as_its_bound() -> None:
    """Stopping gives Serve's shutdown and the drain a bound (a replica in a long ingest kept `--stop` waiting
    minutes): a call that returns in time gives its result, one that hangs is given up after the bound, one that
    raises is over (its error printed)."""
    import threading
    import time

    from rasd.serve.lifecycle import bounded

    release = threading.Event()
    start = time.perf_counter()
    assert bounded(lambda: 7, 5.0) == (True, 7)
    assert bounded(lambda: release.wait(30), 0.3) == (False, None)
    assert time.perf_counter() - start < 5.0
    release.set()

    def fails() -> None:
        raise RuntimeError("controller gone")

    assert bounded(fails, 5.0) == (False, None)


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "--dataset", "/no/such.jsonl", "--methods", "ar"], "dataset /no/such.jsonl not found"),
    (["bench", "--dataset", "/no/such.jsonl", "--methods", "ar,spec"], "unknown method 'spec'"),
    (["bench", "--dataset", "/no/such.jsonl", "--methods", "rasd:head"], "options are KEY=VALUE"),
    (["bench", "--dataset", "/no/such.jsonl", "--methods", "ar,rasd:histroy=off"],
     "method 'rasd' has no option 'histroy'; valid: "),
    (["bench", "--dataset", "/no/such.jsonl", "--methods", "pld:max_ngram=many"], "max_ngram='many': expected an"),
    (["bench", "--dataset", "/no/such.jsonl", "--stop-on-repetition", "--repetition-window", "2"],
     "--repetition-window 2: the repetition window must be an integer from 4 to 1024 tokens"),
    (["load", "--concurrency", "a,b"], "--concurrency needs positive integers"),
])
def test_bench_and_load_arguments_give_one_line_error_before_a_model_loads(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], message: str) -> None:
    from rasd.decoding.model import loading as model_loading

    def no_model(*_: object, **__: object) -> None:
        raise AssertionError("no model may load for bad arguments")

    monkeypatch.setattr(model_loading, "load_model", no_model)
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and err.startswith("rasd: error:"), err


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_serve_port_out_of_range_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str], port: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", port])
    assert info.value.code == 2
    assert f"'{port}' is not a TCP port (1-65535)" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), [
    (["train", "eagle", "--steps", "-1"], "--steps -1: give a positive number"),
    (["train", "eagle", "--lr", "0"], "--lr 0.0: give a positive number"),
    (["train", "eagle", "--noise", "-0.5"], "--noise -0.5: give zero or more"),
    (["train", "ldlp", "--k-max", "0"], "--k-max 0: give a positive number"),
    (["train", "eesd", "--batch", "0"], "--batch 0: give a positive number"),
])
def test_training_numbers_give_one_line_error_before_data_or_a_model_is_read(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], message: str) -> None:
    from rasd.decoding.model import loading as model_loading
    from rasd.train import common

    def nothing_read(*_: object, **__: object) -> None:
        raise AssertionError("no data or model may be read for a bad number")

    monkeypatch.setattr(model_loading, "load_model", nothing_read)
    monkeypatch.setattr(common, "load_prompts", nothing_read)
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and err.startswith("rasd: error:"), err
