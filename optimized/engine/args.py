"""``EngineArgs``: every engine knob, defined once (spec/architecture.md, ARCH-2).

Invariant: an ``EngineArgs`` that exists is valid. Each field carries its rule (a ``Knob``: kind, least value,
choices) and its help; ``__post_init__`` checks every field by its rule and refuses a bad value with a ValueError
naming the field, before anything loads. What only the model or the machine can tell (max_model_len against the
model, tensor-parallel divisibility, whether CUDA is there, the memory budget) is checked where they are known
(optimized/entry/build.py). A None means "chosen when the engine is built"; ``LLM.settings`` holds the choices.

``LLM(**kwargs)`` takes exactly these names (``of``); every command that builds an engine gets one flag per field
from ``add_cli_args`` (``--`` and the name with dashes, or the knob's ``flag``), its help ending with the default,
and ``from_cli_args`` reads them back. ``cli_flags`` is the inverse: the flags that give another command these
settings. This module imports no torch, so the command line is parsed before anything heavy loads.
"""

from __future__ import annotations

import argparse
import difflib
import math
import numbers
import operator
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeGuard

from kernels.backend_names import BACKEND_NAMES
from optimized.core.config import DEFAULT_PATIENCE, MINIMUMS, POLICIES, SchedulerConfig
from optimized.core.errors import is_strict_int
from optimized.engine import arg_types

DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
_FLAGGED = "engine_args_fields"  # the namespace attribute listing the fields a parser has flags for
Namer = Callable[[str], str]  # how a message spells a field: its name in Python, its flag on the command line


class EngineArgsError(ValueError):
    """A refused setting. ``field`` is the one refused; the message names every field by its name, and
    ``worded(namer)`` is the same message with each field spelled by ``namer`` (a command line's flags)."""

    def __init__(self, field: str, wording: Callable[[Namer], str]) -> None:
        super().__init__(wording(str))
        self.field = field
        self._wording = wording

    def worded(self, namer: Namer) -> str:
        return self._wording(namer)


def _refused(name: str, rule: str) -> EngineArgsError:
    """The refusal of ``name``'s value: '<name> <rule>'."""
    return EngineArgsError(name, lambda n: f"{n(name)} {rule}")


@dataclass(frozen=True)
class Knob:
    """One field's rule, help and flag.

    ``kind``: "int" (an integer >= ``least``; any integer when None), "fraction" (a number in (0, 1]), "amount" (a
    positive finite number), "bool", "choice" (one of ``choices``), "folder" (an existing folder), "file" (a path)
    or "device" ("cpu", "cuda" or "cuda:N"). A field whose default is None may also be None, which ``unset`` says
    the meaning of.
    """

    help: str
    kind: str
    least: int | None = 1
    choices: tuple[str, ...] = ()
    unset: str = ""
    flag: str | None = None  # when not "--" + the field's name with dashes
    metavar: str | None = None

    def check(self, name: str, value: object, nullable: bool) -> None:
        if value is None and nullable:
            return
        if self.kind == "int" and not (is_strict_int(value) and (self.least is None or value >= self.least)):
            bound = "" if self.least is None else f" >= {self.least}"
            raise _refused(name, f"must be an integer{bound}, got {value!r}")
        if self.kind == "fraction" and not (_number(value) and 0 < value <= 1):
            raise _refused(name, f"must be in (0, 1], got {value!r}")
        if self.kind == "amount" and not (_number(value) and 0 < value < math.inf):
            raise _refused(name, f"must be a positive finite number, got {value!r}")
        if self.kind == "bool" and not isinstance(value, bool):
            raise _refused(name, f"must be a bool, got {value!r}")
        if self.kind == "choice" and value not in self.choices:
            raise _refused(name, f"must be one of {list(self.choices)}, got {value!r}")
        if self.kind == "folder":
            _check_folder(name, value)
        if self.kind == "file" and (not isinstance(value, (str, Path)) or str(value) == ""):
            raise _refused(name, f"must be a file path or None, got {value!r}")
        if self.kind == "device" and not arg_types.is_device_name(value):
            raise _refused(name, f"must be {arg_types.DEVICE_RULE}, got {value!r}")

    def parse(self) -> Callable[[str], Any]:
        """The argparse type of the flag: the same rule, refused at parse time (CLI-2)."""
        parsers: dict[str, Callable[[str], Any]] = {
            "int": arg_types.any_int if self.least is None else arg_types.bounded_int(self.least),
            "fraction": arg_types.fraction,
            "amount": arg_types.positive_seconds,
            "folder": arg_types.checkpoint_folder,
            "file": arg_types.file_path,
            "device": arg_types.device_name,
        }
        return parsers.get(self.kind, str)

    def shown(self, default: object) -> str:
        """The help's default."""
        if default is None:
            return self.unset
        if isinstance(default, bool):
            return "on" if default else "off"
        return str(default)


def _plain_number(value: object) -> object:
    """A numpy (or other registered) integer or real as the ``int`` or ``float`` it stands for, so a value computed
    with numpy is taken as Python's would be (ENG-21); bools, numpy's included, and anything else unchanged."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    return operator.index(value) if isinstance(value, numbers.Integral) else float(value)


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_folder(name: str, value: object) -> None:
    if not isinstance(value, (str, Path)):
        raise _refused(name, f"must be a checkpoint folder path or None, got {type(value).__name__}")
    if value == "":  # Path("") is the current directory, surely not what was meant
        raise _refused(name, "must be a checkpoint folder path or None, got an empty string")
    if not Path(value).is_dir():
        raise _refused(name, f"must be a checkpoint folder, got {str(value)!r}")


def _knob(help: str, kind: str, **rule: Any) -> dict[str, Knob]:
    """A field's metadata: its ``Knob``."""
    return {"knob": Knob(help, kind, **rule)}


def knob_of(name: str) -> Knob:
    """The rule and help of the field ``name``."""
    knob: Knob = _FIELDS[name].metadata["knob"]
    return knob


@dataclass(frozen=True)
class EngineArgs:
    """The engine's settings: the model, its numbers, the KV cache, the scheduler's knobs, the plug-ins."""

    model: str | Path | None = field(default=None, metadata=_knob(
        "checkpoint folder", "folder", unset="the embedded default model", metavar="DIR"))
    dtype: str | None = field(default=None, metadata=_knob(
        "the weights' and the KV cache's dtype", "choice", choices=DTYPE_NAMES,
        unset="bfloat16 on CUDA, float32 on the CPU"))
    device: str | None = field(default=None, metadata=_knob(
        "cuda, cuda:N or cpu", "device", unset="cuda when available"))
    kvcache_block_size: int = field(default=16, metadata=_knob(
        "tokens per KV-cache block", "int", least=MINIMUMS["block_size"], flag="--block-size"))
    num_kvcache_blocks: int | None = field(default=None, metadata=_knob(
        "KV-cache blocks", "int", least=MINIMUMS["num_blocks"], unset="what the memory budget holds"))
    max_num_seqs: int = field(default=256, metadata=_knob("sequences per step", "int", least=MINIMUMS["max_num_seqs"]))
    max_num_batched_tokens: int = field(default=8192, metadata=_knob(
        "prompt tokens per prefill step (under mixed: every token of a step, decodes included)", "int",
        least=MINIMUMS["max_num_batched_tokens"]))
    scheduling_policy: str = field(default="lesson", metadata=_knob(
        "who runs each step (spec/policies.md): lesson (the lesson's: prefill first, first come first served), "
        "mixed (decodes first, then prefill chunks in the same step), priority (requests by their priority, lower "
        "first, then arrival), lpm (the longest cached prefix first, a request passed over --lpm-patience times "
        "goes next)", "choice", choices=POLICIES))
    lpm_patience: int = field(default=DEFAULT_PATIENCE, metadata=_knob(
        "lpm: how often a waiting request may be passed over before it is due (0: the lesson's order)", "int",
        least=0))
    max_model_len: int | None = field(default=None, metadata=_knob(
        "prompt + completion tokens", "int", least=2, unset="the model's"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_knob(
        "the fraction of GPU memory the engine may use, in (0, 1]", "fraction", metavar="F"))
    cpu_kvcache_gib: float = field(default=0.5, metadata=_knob(
        "the KV cache's memory budget on the CPU, without --num-kvcache-blocks", "amount", metavar="GIB"))
    enforce_eager: bool | None = field(default=None, metadata=_knob(
        "no CUDA-graph decode (--no-enforce-eager: CUDA graphs required)", "bool",
        unset="graphs where they can run"))
    check: bool = field(default=False, metadata=_knob(
        "shadow every step with the reference scheduler (check mode)", "bool"))
    check_full_every: int = field(default=32, metadata=_knob(
        "check mode compares the whole states every this many steps (spec/check.md, CHECK-3)", "int", least=1))
    attention_backend: str | None = field(default=None, metadata=_knob(
        "the attention kernels", "choice", choices=BACKEND_NAMES,
        unset="flash-attn or triton on CUDA, the C kernels (cpu) or torch on the CPU"))
    batch_invariant: bool | None = field(default=None, metadata=_knob(
        "batch-invariant kernels: a request's tokens and logits the same bits whatever the batch, chunking, "
        "preemption, prefix cache or thread count (spec/batch-invariance.md; CPU, float32 or float64, the 'cpu' "
        "attention backend, any tensor-parallel size)", "bool",
        unset="on in float32 on the CPU with the 'cpu' attention backend, else off"))
    seed: int = field(default=0, metadata=_knob(
        "seed of the seeds unseeded requests draw (run and bench throughput: of their workload too)", "int",
        least=None))
    tensor_parallel_size: int = field(default=1, metadata=_knob(
        "split the model over this many processes (spec/parallel.md; under torchrun: its WORLD_SIZE)", "int"))
    trace: str | Path | None = field(default=None, metadata=_knob(
        "record the run in FILE as it happens (spec/trace.md); replay it with nanoverify replay", "file",
        unset="none", metavar="FILE"))
    trace_wall_times: bool = field(default=False, metadata=_knob(
        "with --trace: record each step's wall times", "bool"))

    def __post_init__(self) -> None:
        torch = sys.modules.get("torch")  # a torch.device exists only once torch is imported
        if torch is not None and isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))  # torch.device("cuda", 1) is 'cuda:1'
        for f in fields(self):
            value = getattr(self, f.name)
            plain = _plain_number(value)
            if plain is not value:
                object.__setattr__(self, f.name, plain)
            knob_of(f.name).check(f.name, plain, f.default is None)
        if self.trace_wall_times and self.trace is None:
            raise EngineArgsError("trace_wall_times", lambda n: f"{n('trace_wall_times')} needs {n('trace')} "
                                  "(the file the wall times are recorded in)")

    @classmethod
    def of(cls, **kwargs: Any) -> EngineArgs:
        """``EngineArgs(**kwargs)``; a name that is no field is a ValueError naming it (and the field it is
        nearest to)."""
        for name in kwargs:
            if name not in _FIELDS:
                near = difflib.get_close_matches(name, list(_FIELDS), n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(f"{name!r} is not an engine argument{hint}; they are EngineArgs' fields")
        return cls(**kwargs)

    def as_kwargs(self) -> dict[str, Any]:
        """Every field by name: ``LLM(**args.as_kwargs())`` builds an engine with these settings."""
        return {name: getattr(self, name) for name in _FIELDS}

    def scheduler_config(self, num_blocks: int, eos: int) -> SchedulerConfig:
        """The scheduler's knobs (spec/knobs.md): these, with the KV blocks the memory budget gave."""
        return SchedulerConfig(num_blocks=num_blocks, block_size=self.kvcache_block_size,
                               max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               eos=eos, policy=self.scheduling_policy, patience=self.lpm_patience)

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser, defaults: Mapping[str, Any] | None = None,
                     exclude: Collection[str] = ()) -> None:
        """A flag for every field but those in ``exclude`` (a command that sets them itself), each defaulting to
        the field's default, or to ``defaults``' for a command with its own (``run``'s smaller KV cache)."""
        defaults = dict(defaults or {})
        unknown = (set(defaults) | set(exclude)) - set(_FIELDS)
        if unknown:
            raise ValueError(f"not engine arguments: {sorted(unknown)}")
        flagged = []
        for name, f in _FIELDS.items():
            if name in exclude:
                continue
            knob = knob_of(name)
            default = defaults.get(name, f.default)
            options: dict[str, Any] = {"dest": name, "default": default,
                                       "help": f"{knob.help} (default: {knob.shown(default)})"}
            if knob.kind == "bool":
                options["action"] = _Switch
            else:
                options.update(type=knob.parse(), metavar=knob.metavar or ("N" if knob.kind == "int" else None))
                if knob.choices:
                    options.update(choices=knob.choices, metavar=None)
            p.add_argument(knob.flag or _flag(name), **options)
            flagged.append(name)
        p.set_defaults(**{_FLAGGED: tuple(flagged)})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The settings ``add_cli_args``' flags hold; the fields it gave no flag keep their defaults. A refusal
        names the flags (``--trace-wall-times needs --trace FILE``), not the fields."""
        try:
            return cls(**{name: getattr(args, name) for name in getattr(args, _FLAGGED)})
        except EngineArgsError as e:
            raise ValueError(e.worded(_flag_with_value)) from None

    def cli_flags(self) -> list[str]:
        """The flags that give another command these settings (those that differ from the defaults)."""
        flags: list[str] = []
        for name, f in _FIELDS.items():
            value = getattr(self, name)
            if value == f.default:
                continue
            flag = knob_of(name).flag or _flag(name)
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            else:
                flags += [flag, str(value)]
        return flags


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_with_value(name: str) -> str:
    """The flag that sets ``name`` as a usage line shows it: ``--trace FILE``, ``--check``."""
    knob = knob_of(name)
    flag = knob.flag or _flag(name)
    if knob.kind == "bool":
        return flag
    return f"{flag} {knob.metavar or ('N' if knob.kind == 'int' else name.upper())}"


class _Switch(argparse.BooleanOptionalAction):
    """``--name`` / ``--no-name``, its help as given (Python 3.11's action appends the default itself)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = kwargs.get("help")


_FIELDS = {f.name: f for f in fields(EngineArgs)}
