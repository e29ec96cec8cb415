"""What a target model can run, decided once per model instead of at every call site.

Why an object: whether a model's layers may run through the lean forward (`fast_forward`) decides the lean
CPU path, the static CUDA step (`static_step`) and chunked prefill (`step.batch_decoder`), and an EAGLE head
needs the same layer shape. Each of those used to derive it again (and cache it on the HF module as a private
attribute); now they ask `TargetModel.of(model)`. The object is kept in a table keyed weakly by the HF module
(callers hold the module, not this object) and holds the module only weakly, so neither keeps the other alive.
"""

from __future__ import annotations

import weakref

import torch

from rasd.decoding.model.kernels import fast_enabled

# Architectures whose decoder layer is exactly: pre-norm attention (q/k/v/o Linear, rotary, GQA) + pre-norm
# gated SiLU MLP, RMSNorm in float32 — what `fast_forward._layer` computes.
LEAN_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})


class TargetModel:
    """One HF causal LM's forward paths: lean (our layer code) or HF's, decided when first asked."""

    def __init__(self, model: torch.nn.Module):
        self._model = weakref.ref(model)
        self.lean = lean_layers(model)   # the lean forward and the static step can run this model's layers

    @classmethod
    def of(cls, model: torch.nn.Module) -> TargetModel:
        """The one `TargetModel` of this HF module (made on first use)."""
        target = _TARGETS.get(model)
        if target is None:
            target = _TARGETS[model] = cls(model)
        return target

    @property
    def model(self) -> torch.nn.Module | None:
        """The HF module (None once it is gone)."""
        return self._model()

    def runs_lean(self, device: torch.device) -> bool:
        """Whether a forward on `device` takes the lean path now: inside `fast_kernels()`, on the CPU."""
        return self.lean and device.type == "cpu" and fast_enabled()

    def runs_static(self, requested: bool) -> bool:
        """Whether verification runs the static step (`static_step`): requested (`StepConfig.static`), and the
        layers are ones our layer code runs."""
        return requested and self.lean

    def chunks_prefill(self, fast: bool, device: torch.device, static: bool) -> bool:
        """Whether a prompt chunk can ride along a batched step (`fast_forward.forward_mixed`): the dynamic
        lean CPU path only."""
        return fast and device.type == "cpu" and not static and self.lean


_TARGETS: weakref.WeakKeyDictionary[torch.nn.Module, TargetModel] = weakref.WeakKeyDictionary()


def lean_layers(model: torch.nn.Module) -> bool:
    """Llama/Qwen2 with sdpa attention, SiLU MLP, no sliding window, no tensor-parallel split."""
    config = getattr(model, "config", None)
    if config is None or type(model).__name__ not in LEAN_ARCHITECTURES:
        return False
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not hasattr(inner, "rotary_emb"):
        return False
    return (getattr(config, "_attn_implementation", None) == "sdpa"
            and getattr(config, "hidden_act", "silu") == "silu"
            and getattr(config, "pretraining_tp", 1) == 1
            and not getattr(config, "use_sliding_window", False)
            and all(hasattr(layer.self_attn, "q_proj") and not hasattr(layer.self_attn, "q_norm")
                    for layer in layers))
