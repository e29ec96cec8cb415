"""cluster.yaml: accepted by Ray's own cluster-launcher checks, and routing by the resource names rasd uses.

`ray up` merges Ray's provider defaults into the file (`prepare_config`), then validates it against
ray/autoscaler/ray-schema.json and its own rules (`validate_config`) before it calls the cloud. The test runs
exactly those two steps (no cloud account here), then checks what the schema cannot: that the custom resources
are the ones the batch pipeline and the README name, that GPU nodes verify and CPU nodes retrieve, and that the
CPU nodes install the CPU build of torch.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rasd.apps.batch_job import RETRIEVAL_RESOURCE, VERIFIER_RESOURCE

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def ray_up_checks(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` does to the file before it touches the provider; raises on an invalid config."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def test_cluster_yaml_passes_rays_own_validation(config: dict[str, Any]) -> None:
    import ray.autoscaler

    assert (Path(ray.autoscaler.__file__).parent / "ray-schema.json").exists()
    prepared = ray_up_checks(config)
    assert prepared["provider"]["type"] == "aws" and prepared["head_node_type"] in prepared["available_node_types"]
    assert not re.search(r"<[^>]*>|\bTODO\b|CHANGEME|xxx", (REPO / "cluster.yaml").read_text()), "placeholder left"


@pytest.mark.parametrize("breakage", [
    "misspelt top-level key", "misspelt node-type key", "resource amount not an integer", "no provider",
    "head type not a node type", "min_workers above max_workers",
])
def test_broken_copies_fail_validation(config: dict[str, Any], breakage: str) -> None:
    broken = copy.deepcopy(config)
    if breakage == "misspelt top-level key":
        broken["setup_comands"] = broken.pop("setup_commands")
    elif breakage == "misspelt node-type key":
        broken["available_node_types"]["rasd.gpu"]["resource"] = broken["available_node_types"]["rasd.gpu"].pop(
            "resources")
    elif breakage == "resource amount not an integer":
        broken["available_node_types"]["rasd.cpu"]["resources"][RETRIEVAL_RESOURCE] = "one"
    elif breakage == "no provider":
        del broken["provider"]
    elif breakage == "head type not a node type":
        broken["head_node_type"] = "rasd.headd"
    elif breakage == "min_workers above max_workers":
        broken["max_workers"] = 0
    with pytest.raises(Exception) as info:      # jsonschema.ValidationError, ValueError or KeyError, as Ray raises
        ray_up_checks(broken)
    assert info.type.__name__ in ("ValidationError", "ValueError", "KeyError"), info.value


def test_custom_resources_are_the_ones_rasd_uses(config: dict[str, Any]) -> None:
    types = config["available_node_types"]
    by_resource = {name: [t for t, spec in types.items() if name in spec["resources"]]
                   for name in (RETRIEVAL_RESOURCE, VERIFIER_RESOURCE)}
    assert by_resource == {RETRIEVAL_RESOURCE: ["rasd.cpu"], VERIFIER_RESOURCE: ["rasd.gpu"]}
    custom = {r for spec in types.values() for r in spec["resources"] if r not in ("CPU", "GPU", "memory")}
    assert custom == {RETRIEVAL_RESOURCE, VERIFIER_RESOURCE}
    assert types["rasd.gpu"]["resources"].get("GPU", 0) >= 1 and "GPU" not in types["rasd.cpu"]["resources"]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}        # no model on the head
    # the names in the docs: the README and the file's own usage header
    readme = (REPO / "README.md").read_text()
    header = (REPO / "cluster.yaml").read_text().split("cluster_name:")[0]
    for name in (RETRIEVAL_RESOURCE, VERIFIER_RESOURCE):
        assert name in readme and name in header


def test_setup_installs_cpu_torch_on_cpu_nodes_and_cuda_torch_on_gpu_nodes(config: dict[str, Any]) -> None:
    prepared = ray_up_checks(config)
    cpu_setup = prepared["setup_commands"]                          # head and rasd.cpu
    gpu_setup = prepared["available_node_types"]["rasd.gpu"]["worker_setup_commands"]
    assert "rasd.cpu" not in config["available_node_types"] or \
        "worker_setup_commands" not in config["available_node_types"]["rasd.cpu"]
    torch_pin = re.search(r"torch==[\d.]+", (REPO / "Makefile").read_text()).group(0)
    assert any(torch_pin in c and "whl/cpu" in c for c in cpu_setup)
    assert any(torch_pin in c and "whl/cpu" not in c for c in gpu_setup)
    for setup in (cpu_setup, gpu_setup):                            # torch first, so rasd's bare `torch` is met
        torch_at = next(i for i, c in enumerate(setup) if torch_pin in c)
        rasd_at = next(i for i, c in enumerate(setup) if "pip install" in c and "~/rasd" in c)
        assert torch_at < rasd_at
    assert config["file_mounts"]["~/rasd"] == "."
    assert all("RAY_AUTH_MODE=token" in c for c in config["head_start_ray_commands"] + config[
        "worker_start_ray_commands"] if "ray start" in c)
