"""The training commands' configs: each builds its parser (same flags and defaults as the hand-written parsers
it replaced), reads a command line back, and refuses a number out of range in one line."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from rasd.train.config import COMMANDS, EagleConfig, EesdConfig, LdlpConfig, TrainConfig

# The flags and defaults of the parsers before they were built from the configs (`--long-windows` removed: it
# was tried, gave nothing, and never shipped).
OLD_FLAGS: dict[str, dict[str, Any]] = {
    "eagle": {"model": "default", "data": "builtin", "out": None, "seqs": 2000, "seq_len": 384, "steps": None,
              "epochs": 2.0, "batch": 8, "lr": 1e-3, "noise": 0.05, "cls_weight": 1.0, "draft_vocab": 8192,
              "regenerate": 0, "turns": "1", "gen_dtype": "float32", "gen_batch": 128, "temperature": 0.0,
              "samples": 1, "max_answers": None, "ttt": False, "init": None, "average_init": None, "taps": "",
              "eval_seqs": 128, "device": "cpu", "seed": 0, "order_seed": None},
    "eesd": {"model": "default", "data": "builtin", "out": None, "layers": None, "steps": None, "draft_vocab": 8192,
             "seqs": 1600, "prompt_tokens": 32, "gen_tokens": 48, "batch": 8, "lr": 3e-3, "device": "cpu",
             "seed": 0},
    "ldlp": {"model": "default", "drafter": "eesd", "eesd": None, "eagle": None, "data": "builtin", "out": None,
             "k_max": 8, "steps": 2000, "seqs": 1000, "prompt_tokens": 32, "gen_tokens": 48, "under_weight": 2.0,
             "device": "cpu", "seed": 0},
}
OLD_TYPES = {"out": Path, "init": Path, "eesd": Path, "eagle": Path}


def command_parser(config: type[TrainConfig]) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser()
    config.add_parser(top.add_subparsers(), run=lambda c: c)
    return top


def actions(config: type[TrainConfig]) -> dict[str, argparse.Action]:
    sub = next(a for a in command_parser(config)._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[config.COMMAND]._actions if a.dest != "help"}


@pytest.mark.parametrize("config", COMMANDS)
def test_the_parser_has_the_old_flags_and_defaults(config: type[TrainConfig]) -> None:
    built = actions(config)
    assert {dest: a.default for dest, a in built.items()} == OLD_FLAGS[config.COMMAND]
    for dest, action in built.items():
        assert action.option_strings == ["--" + dest.replace("_", "-")] and action.help, dest
        if dest in OLD_TYPES:
            assert action.type is OLD_TYPES[dest], dest
    assert "long_windows" not in built
    assert actions(EagleConfig)["gen_dtype"].choices == ("float32", "bfloat16", "float16")
    assert actions(EagleConfig)["ttt"].nargs == 0          # a switch, as before


@pytest.mark.parametrize("config", COMMANDS)
def test_a_command_line_becomes_its_config(config: type[TrainConfig]) -> None:
    """Every flag given a non-default value reaches its field; the defaults are the dataclass's own."""
    top = command_parser(config)
    assert config.from_args(top.parse_args([config.COMMAND])) == config()
    argv: list[str] = [config.COMMAND]
    expected: dict[str, Any] = {}
    for dest, action in actions(config).items():
        flag = action.option_strings[0]
        if action.nargs == 0:
            argv.append(flag)
            expected[dest] = True
        elif action.choices:
            argv += [flag, action.choices[-1]]
            expected[dest] = action.choices[-1]
        elif action.type in (int, float):
            value = action.type((action.default or 0) + 3)
            argv += [flag, str(value)]
            expected[dest] = value
        else:
            argv += [flag, f"x{dest}"]
            expected[dest] = action.type(f"x{dest}") if action.type else f"x{dest}"
    parsed = top.parse_args(argv)
    built = config.from_args(parsed)
    assert {f.name: getattr(built, f.name) for f in fields(built)} == expected
    assert parsed.func(parsed) == built, "the command's function receives the config"


@pytest.mark.parametrize(("config", "values", "message"), [
    (EagleConfig, {"steps": -1}, "--steps -1: give a positive number"),
    (EagleConfig, {"noise": -0.5}, "--noise -0.5: give zero or more"),
    (EagleConfig, {"max_answers": 0}, "--max-answers 0: give a positive number"),
    (EesdConfig, {"layers": 0}, "--layers 0: give a positive number"),
    (EesdConfig, {"draft_vocab": -1}, "--draft-vocab -1: give zero or more"),
    (LdlpConfig, {"k_max": 0}, "--k-max 0: give a positive number"),
    (LdlpConfig, {"under_weight": 1.0}, "--under-weight must be > 1"),
])
def test_out_of_range_is_one_line_naming_the_flag(config: type[TrainConfig], values: dict[str, Any],
                                                  message: str) -> None:
    config().validate()
    with pytest.raises(ValueError) as caught:
        config(**values).validate()
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_record_is_the_config_as_json() -> None:
    import json

    config = EagleConfig(out=Path("/tmp/head.safetensors"), init=Path("/tmp/parent.safetensors"), order_seed=7)
    record = json.loads(json.dumps(config.record()))
    assert record["out"] == "/tmp/head.safetensors" and record["init"] == "/tmp/parent.safetensors"
    assert set(record) == {f.name for f in fields(EagleConfig)} and config.batch_order_seed == 7
    assert EagleConfig(seed=3).batch_order_seed == 3
