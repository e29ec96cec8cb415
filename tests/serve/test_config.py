"""`ServeConfig`: the one typed path from `rasd serve` flags and serve_config.yaml to the deployments."""

from __future__ import annotations

import argparse
import pickle
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from rasd.errors import CliError
from rasd.serve.config import ConfigError, RouterOptions, ServeConfig
from rasd.serve.options import register

# `rasd serve` flags that run the command rather than configure the service
PROCESS_FLAGS = {"host", "port", "address", "ray_host", "detach", "stop", "insecure_no_key", "grace_s"}
# flags that fill a field from another form (`ServeConfig.from_args`)
FORM_FLAGS = {"limit": "limits", "allowed_host": "allowed_hosts", "draft_worker_resources": "draft_worker_options",
              "verifier_gpus": "verifier_options", "verifier_resources": "verifier_options"}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser()
    register(top.add_subparsers())
    return top


def serve_actions() -> dict[str, argparse.Action]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {a.dest: a for a in sub._actions if a.dest != "help"}


@pytest.mark.parametrize(("values", "field"), [
    ({"replicas": 0}, "replicas"),
    ({"max_batch": 0}, "max_batch"),
    ({"max_waiting": -1}, "max_waiting"),
    ({"threads": 0}, "threads"),
    ({"draft_timeout_s": -1.0}, "draft_timeout_s"),
    ({"verifier_timeout_s": 0}, "verifier_timeout_s"),
    ({"verifier_step_timeout_s": "300"}, "verifier_step_timeout_s"),
    ({"max_batch": "8"}, "max_batch"),
    ({"replicas": True}, "replicas"),
    ({"graphs": "yes"}, "graphs"),
    ({"limits": {"max_stop": -3}}, "limits.max_stop"),
    ({"limits": {"max_stopp": 3}}, "limits"),
    ({"limits": [1]}, "limits"),
    ({"router": {"imbalance": -1}}, "router.imbalance"),
    ({"router": {"imbalanse": 1}}, "router"),
    ({"verifier_options": {"num_gpus": -1}}, "verifier_options"),
    ({"modle": "default"}, "serve config"),
])
def test_a_bad_value_is_one_line_naming_its_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ServeConfig.from_dict(values)
    message = str(caught.value)
    assert caught.value.field == field and message.startswith(field + " ") and "\n" not in message


def test_a_bad_value_stops_the_builder_before_any_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray.serve")
    from rasd.serve import app

    def no_deployment(*_: Any, **__: Any) -> None:
        raise AssertionError("a bad config must not reach the deployments")

    monkeypatch.setattr(app.RasdServer, "options", no_deployment)
    with pytest.raises(ValueError, match="^replicas must be >= 1"):
        app.build_app({"replicas": 0})


def test_every_flag_is_a_field_or_a_process_flag_and_defaults_come_from_the_fields() -> None:
    actions = serve_actions()
    names = set(ServeConfig.names())
    for dest, action in actions.items():
        assert dest in names or dest in PROCESS_FLAGS or dest in FORM_FLAGS, dest
        if dest in names:
            assert action.default == getattr(ServeConfig(), dest), dest
            assert action.help, dest
    flagged = {f.name for f in fields(ServeConfig) if f.metadata["flag"]}
    assert flagged <= set(actions)


def round_trip_value(action: argparse.Action, tmp_path: Path) -> tuple[list[str], Any]:
    """A non-default command line for one flag, and the value its field must then hold."""
    flag = action.option_strings[0]
    if action.dest == "graphs":
        return [flag], False
    if action.nargs == 0:           # store_true
        return [flag], True
    if action.dest == "index":
        return [flag, str(tmp_path)], str(tmp_path)
    if action.dest == "dtype":     # a name torch has (checked by `validate`)
        return [flag, "bfloat16"], "bfloat16"
    if action.type in (int, float):
        value = action.type((action.default or 0) + 3)
        return [flag, str(value)], value
    return [flag, f"x-{action.dest}"], f"x-{action.dest}"


def test_from_args_round_trips_every_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RASD_API_KEY", raising=False)
    names = set(ServeConfig.names())
    for dest, action in serve_actions().items():
        if dest not in names:
            continue
        argv, expected = round_trip_value(action, tmp_path)
        if dest == "draft_workers":      # workers need a model they can load: a plain draft model
            argv += ["--draft-worker-model", "some/model"]
        config = ServeConfig.from_args(parser().parse_args(["serve", *argv]))
        assert getattr(config, dest) == expected, dest
    forms = {"limits": (["--limit", "max_stop=4", "--limit", "max_n=2"], {"max_stop": 4, "max_n": 2}),
             "draft_worker_options": (["--draft-worker-resources", '{"rasd_draft": 1}'],
                                      {"resources": {"rasd_draft": 1}}),
             "verifier_options": (["--verifier-gpus", "0.5", "--verifier-resources", '{"v": 1}'],
                                  {"num_gpus": 0.5, "resources": {"v": 1}})}
    for name, (argv, expected) in forms.items():
        assert getattr(ServeConfig.from_args(parser().parse_args(["serve", *argv])), name) == expected, name
    plain = ServeConfig.from_args(parser().parse_args(["serve"]))
    assert plain.threads is not None and plain.threads >= 1          # resolved: the cores of this node
    assert plain == ServeConfig.from_dict({"threads": plain.threads})   # flags and YAML meet in one config


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtype", "float8"], "dtype must be auto or one of"),
    (["--replicas", "0"], "replicas must be >= 1 (got 0)"),
    (["--limit", "max_stop=0"], "limits.max_stop must be a positive integer"),
    (["--limit", "max_stopp=1"], "limits has unknown names: max_stopp"),
    (["--limit", "max_stop"], "--limit takes NAME=INTEGER"),
    (["--verifier-gpus", "-1"], "--verifier-gpus must be >= 0"),
    (["--index", "/nowhere/index"], "index folder not found"),
])
def test_bad_flags_are_one_line_cli_errors_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(CliError) as caught:
        ServeConfig.from_args(parser().parse_args(["serve", *argv]))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_serve_config_yaml_is_read_through_the_config() -> None:
    config = ServeConfig.from_yaml("serve_config.yaml")
    assert config.model == "default" and config.max_batch == 8 and config.threads == 2
    assert config.limits == {"max_body_bytes": 2097152, "max_prompt_chars": 200000}
    with pytest.raises(ValueError, match="no application named 'other'"):
        ServeConfig.from_yaml("serve_config.yaml", app="other")


def test_config_travels_through_pickle_unchanged() -> None:
    """Ray ships the bound config to each replica by pickling it."""
    config = ServeConfig.from_dict({"limits": {"max_stop": 4}, "router": {"imbalance": 2}, "threads": 1})
    assert pickle.loads(pickle.dumps(config)) == config


def test_router_options_are_the_routers_parameters() -> None:
    pytest.importorskip("ray.serve")
    import inspect

    from rasd.serve.router import PrefixAffinityRouter

    params = list(inspect.signature(PrefixAffinityRouter.initialize_state).parameters)[1:]
    assert [f.name for f in fields(RouterOptions)] == params
