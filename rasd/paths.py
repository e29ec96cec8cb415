"""Where rasd keeps what it learns or converts: every artefact path under `$RASD_HOME`, in one place.

Nothing here creates a folder; callers write through `rasd.fsio` (atomic: temp name, fsync, rename)."""

from __future__ import annotations

import os
import re
from pathlib import Path

DEFAULT_MODEL = "default"                        # the embedded model's name on the command line
DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"  # its folder, and the stem of what ships for it


def rasd_home() -> Path:
    """Root of rasd's caches (converted models, cost curves): `$RASD_HOME` or `~/.cache/rasd`."""
    return Path(os.environ.get("RASD_HOME", Path.home() / ".cache" / "rasd")).expanduser()


def slug(name: str) -> str:
    """A model or drafter name as one safe file-name part (hub ids contain "/")."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name)).strip("_") or "model"


def model_dir(dirname: str) -> Path:
    """A converted model (the embedded GGUF as safetensors): `$RASD_HOME/models/<dirname>/`."""
    return rasd_home() / "models" / dirname


def eesd_path(model_name: str) -> Path:
    """Default EESD exit-layer weights: `$RASD_HOME/eesd/<model>.safetensors`."""
    return rasd_home() / "eesd" / f"{slug(model_name)}.safetensors"


def eagle_path(model_name: str) -> Path:
    """An EAGLE head trained here (`rasd train eagle`): `$RASD_HOME/eagle/<model>.safetensors`."""
    return rasd_home() / "eagle" / f"{slug(model_name)}.safetensors"


def ldlp_path(model_name: str, drafter: str) -> Path:
    """Default trained LDLP: `$RASD_HOME/ldlp/<model>--<drafter>.safetensors`."""
    return rasd_home() / "ldlp" / f"{slug(model_name)}--{slug(drafter)}.safetensors"


def recycling_path(model_name: str) -> Path:
    """A target's persisted Token Recycling matrix: `$RASD_HOME/recycling/<model>.npz`."""
    return rasd_home() / "recycling" / f"{slug(model_name)}.npz"


def kernel_choices_path(machine: str) -> Path:
    """The skinny-product forms measured on one machine (`decoding.kernels`): `$RASD_HOME/kernels/<machine>.json`."""
    return rasd_home() / "kernels" / f"{slug(machine)}.json"


def cost_dir() -> Path:
    """Measured cost curves, one JSON per (model, device, dtype, threads, context bucket)."""
    return rasd_home() / "cost"


def selfgen_dir(model_name: str) -> Path:
    """The target's cached greedy continuations (training data of the self-distilled drafters)."""
    return rasd_home() / "selfgen" / slug(model_name)


def bench_index_dir(digest: str) -> Path:
    """An index `rasd bench --docqa` built for one benchmark row, keyed by content hash."""
    return rasd_home() / "bench-indexes" / digest


def sample_index_path(model: str = "default") -> Path:
    """The bundled sample corpus (Python language reference) indexed for `model`'s tokenizer."""
    return rasd_home() / "indexes" / f"python-reference-{slug(model)}"
