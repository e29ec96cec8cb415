"""The training commands' settings, typed: one dataclass per command (`EagleConfig`, `EesdConfig`, `LdlpConfig`,
their common part in `TrainConfig`) whose fields build the command's parser and are what its training function
takes and its report records.

Each field states its flag's help, its default and its range once (`option`); `add_parser` makes `--<name>` of
every field, `from_args` reads them back, `validate` refuses a number out of range in one line before any data
or model is read (`rasd train eagle --steps -1` once computed 20 minutes of target features before failing).
"""

from __future__ import annotations

import argparse
import types
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

POSITIVE, NON_NEGATIVE = "a positive number", "zero or more"


def option(default: Any, help: str = "", *, at_least: str | None = None, choices: tuple[str, ...] | None = None,
           metavar: str | None = None) -> Any:
    """A training setting: its default, its flag's `help` and, for numbers, its range (`POSITIVE` or
    `NON_NEGATIVE`; None, the unset value of an optional number, is always allowed)."""
    metadata = {"help": help, "at_least": at_least, "choices": choices, "metavar": metavar}
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """What every training command takes: the target, the data, where the result goes, the device and seed."""

    COMMAND: ClassVar[str] = ""
    HELP: ClassVar[str] = ""

    model: str = option("default", "target: HF hub id, local path or `default`")
    data: str = option("builtin", "JSONL(.gz) prompts or `builtin`")
    out: Path | None = option(None, "where the weights go (default under $RASD_HOME)")
    device: str = option("cpu", "torch device of the target while training")
    seed: int = option(0, "random seed (data order, sampled answers, initial weights)")

    @classmethod
    def add_parser(cls, sub: Any, run: Any) -> argparse.ArgumentParser:
        """`rasd train <COMMAND>`: a flag per field, its default, type, help and choices taken from the field."""
        p = sub.add_parser(cls.COMMAND, help=cls.HELP)
        hints = get_type_hints(cls)
        for spec in fields(cls):
            flag, meta = "--" + spec.name.replace("_", "-"), spec.metadata
            kind = _base(hints[spec.name])
            if kind is bool:
                p.add_argument(flag, action="store_true", help=meta["help"])
                continue
            extra = {k: meta[k] for k in ("choices", "metavar") if meta[k] is not None}
            p.add_argument(flag, type=None if kind is str else kind, default=spec.default, help=meta["help"],
                           **extra)
        p.set_defaults(func=lambda args: run(cls.from_args(args)))
        return p

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Any:
        """The config of a parsed command line (each flag's dest is its field)."""
        given = vars(args)
        return cls(**{spec.name: given[spec.name] for spec in fields(cls)})

    def validate(self) -> None:
        """A one-line ValueError naming the flag of the first number out of its range."""
        for spec in fields(self):
            wanted, value = spec.metadata.get("at_least"), getattr(self, spec.name)
            if wanted is None or value is None:
                continue
            if (value <= 0) if wanted == POSITIVE else (value < 0):
                raise ValueError(f"--{spec.name.replace('_', '-')} {value}: give {wanted}")

    def record(self) -> dict[str, Any]:
        """The config as the report stores it (JSON: paths as text)."""
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def _base(hint: Any) -> Any:
    """`int | None` -> int: the type a flag's text is converted to."""
    if get_origin(hint) in (Union, types.UnionType):
        (hint,) = [arg for arg in get_args(hint) if arg is not type(None)]
    return hint


@dataclass
class EagleConfig(TrainConfig):
    """`rasd train eagle` (`rasd.train.eagle_head.train_eagle`)."""

    COMMAND: ClassVar[str] = "eagle"
    HELP: ClassVar[str] = "train the target's EAGLE draft head on its own features"

    data: str = option("builtin", "JSONL(.gz) of conversations (ShareGPT `conversations`) or `builtin` (ShareGPT "
                                  "from ../shared/data when present, else the CPython language reference, offline)")
    out: Path | None = option(None, "default: $RASD_HOME/eagle/<model>.safetensors")
    seqs: int = option(2000, "training conversations", at_least=POSITIVE)
    seq_len: int = option(384, "tokens per conversation (its first ones)", at_least=POSITIVE)
    steps: int | None = option(None, "optimizer steps (default: --epochs over the data)", at_least=POSITIVE)
    epochs: float = option(2.0, "passes over the data when --steps is not given", at_least=POSITIVE)
    batch: int = option(8, "conversations per optimizer step", at_least=POSITIVE)
    lr: float = option(1e-3, "peak learning rate", at_least=POSITIVE)
    noise: float = option(0.05, "uniform noise on input features (EAGLE)", at_least=NON_NEGATIVE)
    cls_weight: float = option(1.0, "weight of the cross-entropy beside the L1", at_least=NON_NEGATIVE)
    draft_vocab: int = option(8192, "restrict the head's output to the target's N most written tokens (0 = all)",
                              at_least=NON_NEGATIVE)
    regenerate: int = option(0, "train on the target's own answers (this many tokens) to the conversations' user "
                                "turns (--turns; greedy, or sampled with --temperature) instead of the conversations "
                                "as they are: EAGLE-3's data, what the head will draft", at_least=NON_NEGATIVE,
                             metavar="TOKENS")
    turns: str = option("1", "with --regenerate: which user turns of each conversation are prompts, 1-based and "
                             "comma separated (`2` continues a head trained on the first turns on prompts it never "
                             "saw)")
    gen_dtype: str = option("float32", "with --regenerate: write the answers with a copy of the target in this dtype "
                                       "(bfloat16: several times faster on AMX CPUs and GPUs; the text is that "
                                       "copy's own)", choices=("float32", "bfloat16", "float16"))
    gen_batch: int = option(128, "with --regenerate: answers written at once (and cached together); bigger batches "
                                 "run faster where memory allows", at_least=POSITIVE)
    temperature: float = option(0.0, "with --regenerate: sample the answers at this temperature (seeded by --seed) "
                                     "instead of greedy: more distinct text from the same prompts")
    samples: int = option(1, "with --regenerate and --temperature: answers drawn per prompt (each with its own "
                             "seed): more training text from the same conversations")
    max_answers: int | None = option(None, "with --regenerate: answer only the first N prompts of --turns (per "
                                           "draw); a multiple of --gen-batch keeps the cached chunks a longer run "
                                           "reuses", at_least=POSITIVE)
    ttt: bool = option(False, "EAGLE-3's training-time test: also train depth 2 on the head's own predicted "
                              "features")
    init: Path | None = option(None, "continue training this head (its weights and draft vocabulary) instead of a "
                                     "new one")
    average_init: float | None = option(None, "with --init: save W x the trained weights + (1 - W) x the --init "
                                              "head's (weight averaging, as model soups / WiSE-FT: a continued head "
                                              "averaged with its parent held out better than either, "
                                              "docs/lab-notes/eagle.md)", metavar="W")
    taps: str = option("", "EAGLE-3's fused features: target layers (0-based, comma separated, e.g. 2,15) read "
                           "beside the final features; with --init of a plain head, they start at zero weight")
    eval_seqs: int = option(128, "held-out prompts (conversations never trained on)", at_least=POSITIVE)
    order_seed: int | None = option(None, "seed of the training order and the input noise only (default: --seed); "
                                          "a new one continues a head (--init) on the same cached answers without "
                                          "replaying its parent's batches")

    @property
    def batch_order_seed(self) -> int:
        """`--order-seed`, else `--seed`: the text stays keyed by --seed while the batches can be drawn anew."""
        return self.seed if self.order_seed is None else self.order_seed


@dataclass
class EesdConfig(TrainConfig):
    """`rasd train eesd` (`rasd.train.eesd.train_eesd`)."""

    COMMAND: ClassVar[str] = "eesd"
    HELP: ClassVar[str] = "self-distil EESD's exit layer on the target's own generations"

    data: str = option("builtin", "JSONL(.gz) prompts (Spec-Bench `turns`, ShareGPT `conversations`, "
                                  "`prompt`/`text`) or `builtin` (CPython language reference, offline)")
    out: Path | None = option(None, "default: $RASD_HOME/eesd/<model>.safetensors")
    layers: int | None = option(None, "N shared target layers (default: a third)", at_least=POSITIVE)
    steps: int | None = option(None, "optimizer steps (default: 4 epochs)", at_least=POSITIVE)
    draft_vocab: int = option(8192, "restrict the draft's LM head to the target's N most written tokens (0 = all)",
                              at_least=NON_NEGATIVE)
    seqs: int = option(1600, "prompts to continue (10%% held out)", at_least=POSITIVE)
    prompt_tokens: int = option(32, "tokens of each prompt window", at_least=POSITIVE)
    gen_tokens: int = option(48, "tokens the target continues each prompt with", at_least=POSITIVE)
    batch: int = option(8, "sequences per optimizer step", at_least=POSITIVE)
    lr: float = option(3e-3, "learning rate", at_least=POSITIVE)


@dataclass
class LdlpConfig(TrainConfig):
    """`rasd train ldlp` (`rasd.train.ldlp.train_ldlp`)."""

    COMMAND: ClassVar[str] = "ldlp"
    HELP: ClassVar[str] = "train AdaEAGLE's draft length predictor for a drafter"

    data: str = option("builtin", "JSONL(.gz) prompts or `builtin` (see `rasd train eesd`)")
    out: Path | None = option(None, "default: $RASD_HOME/ldlp/<model>--<drafter>.safetensors")
    drafter: str = option("eesd", "`eagle` (the target's EAGLE head, AdaEAGLE's drafter), `eesd` (the trained "
                                  "self-draft) or a draft model path/id")
    eesd: Path | None = option(None, "exit-layer weights (default under $RASD_HOME/eesd/)")
    eagle: Path | None = option(None, "EAGLE head (default: trained under $RASD_HOME/eagle/, else the shipped one)")
    k_max: int = option(8, "the longest draft the predictor may ask for", at_least=POSITIVE)
    steps: int = option(2000, "optimizer steps", at_least=POSITIVE)
    seqs: int = option(1000, "prompts to continue", at_least=POSITIVE)
    prompt_tokens: int = option(32, "tokens of each prompt window", at_least=POSITIVE)
    gen_tokens: int = option(48, "tokens the target continues each prompt with", at_least=POSITIVE)
    under_weight: float = option(2.0, "λ > 1: weight of under-prediction")

    def validate(self) -> None:
        super().validate()
        if self.under_weight <= 1:
            raise ValueError("--under-weight must be > 1 (under-prediction costs more)")


COMMANDS: tuple[type[TrainConfig], ...] = (EagleConfig, EesdConfig, LdlpConfig)
