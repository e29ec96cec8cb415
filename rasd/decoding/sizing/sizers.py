"""The tree-size policies by name: `SIZINGS` and `make_sizer`, the one place a policy is picked.

Each policy implements the `Sizer` protocol (`sizing.protocol`) in a module of its own:

- `cost` (default): `CostAwareSizer` (`sizing.cost_aware`), expected tokens per second against the
  target's measured cost curve, from acceptance learnt online (`sizing.acceptance`).
- `fixed`, `heuristic`, `threshold`: `sizing.simple` (a node count, HF's depth schedule, a confidence cut).
- `thompson` (EESD): `ThompsonSizer` (`sizing.thompson`), a Thompson-sampled depth limit.
- `ldlp` (AdaEAGLE): `LDLPSizer` (`sizing.ldlp`), a trained draft-length predictor (`rasd train ldlp`) with
  the DDD stopping rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rasd.decoding.sizing.cost import CostCurve
from rasd.decoding.sizing.cost_aware import CostAwareSizer
from rasd.decoding.sizing.ldlp import LDLPSizer, load_controller
from rasd.decoding.sizing.protocol import Sizer
from rasd.decoding.sizing.simple import FixedSizer, HeuristicSizer, ThresholdSizer
from rasd.decoding.sizing.thompson import ThompsonSizer

__all__ = ["SIZINGS", "CostAwareSizer", "FixedSizer", "HeuristicSizer", "LDLPSizer", "Sizer", "ThompsonSizer",
           "ThresholdSizer", "make_sizer"]

SIZINGS = ("cost", "fixed", "heuristic", "threshold", "thompson", "ldlp")


def make_sizer(name: str, max_nodes: int = 64, curve_for: Callable[[int], CostCurve] | None = None,
               **options: Any) -> Sizer:
    """The sizing policy called `name` (see SIZINGS); `cost` needs the target's cost-curve provider."""
    if name == "cost":
        if curve_for is None:
            raise ValueError("sizing 'cost' needs the target's cost curve (curve_for)")
        return CostAwareSizer(curve_for, max_nodes=max_nodes, **options)
    if name == "fixed":
        return FixedSizer(max_nodes)
    if name == "heuristic":
        return HeuristicSizer(max_nodes, **options)
    if name == "threshold":
        return ThresholdSizer(max_nodes, **options)
    if name == "thompson":
        return ThompsonSizer(max_nodes, **options)
    if name == "ldlp":
        if "controller" in options:
            return LDLPSizer(options["controller"], max_nodes)
        if options.get("target") is None:
            raise ValueError("sizing 'ldlp' needs the target model and a trained LDLP (`rasd train ldlp`)")
        return LDLPSizer(load_controller(options["target"], options.get("path"), options.get("model_name", "default"),
                                         options.get("drafter", "eesd")), max_nodes)
    raise ValueError(f"unknown sizing {name!r}; choose one of {', '.join(SIZINGS)}")
