"""One ``EngineArgs`` for every engine knob (spec/architecture.md, ARCH-2): ``LLM``'s keywords, every engine
command's flags and their defaults, the scheduler's config and the tensor-parallel workers' spec all come from its
fields."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
from pathlib import Path
from typing import Any

import pytest

from optimized.benchmarks import policies as policies_bench
from optimized.benchmarks import serve as serve_bench
from optimized.cli import run
from optimized.cli.command import build_parser
from optimized.core.config import SchedulerConfig
from optimized.engine.args import EngineArgs, EngineArgsError, knob_of
from optimized.engine.assembly import RunnerSpec
from optimized.entry.llm import LLM
from tests.engine_fixtures import checkpoint

pytestmark = pytest.mark.usefixtures("engine_env")
FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]
# Every command that builds an engine: what it needs besides engine flags, the defaults it sets itself, and the
# fields it gives no flag (it sets them itself).
ENGINE_COMMANDS: dict[str, tuple[list[str], dict[str, Any], tuple[str, ...]]] = {
    "run": ([], run.ENGINE_DEFAULTS, ()),
    "generate": (["hi"], {}, ("seed",)),  # its --seed is the requests' (SamplingParams.seed), not the engine's
    "serve": ([], {}, ()),
    "bench throughput": ([], {}, ("trace", "trace_wall_times")),  # its --trace is a mode of its own
    "bench serve": ([], {}, serve_bench.NOT_PASSED),
    "bench policies": ([], policies_bench.ENGINE_DEFAULTS, policies_bench.NOT_PASSED),  # it runs every policy
}


def _subparser(command: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = build_parser()
    for word in command.split():
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subparsers.choices[word]
    return parser


@pytest.mark.clause("ARCH-2")
@pytest.mark.parametrize("command", list(ENGINE_COMMANDS))
def test_every_engine_command_has_a_flag_per_knob_with_its_default(command: str) -> None:
    """ARCH-2: each engine command has one flag per EngineArgs field (but those it declares it sets itself), each
    named after the field (or the field's own flag), defaulting to the field's default (or the command's declared
    own), and saying that default in its help; parsed with no engine flag it gives EngineArgs' defaults."""
    needed, own, unflagged = ENGINE_COMMANDS[command]
    args = build_parser().parse_args([*command.split(), *needed])
    assert set(args.engine_args_fields) == set(FIELDS) - set(unflagged)
    assert EngineArgs.from_cli_args(args) == dataclasses.replace(EngineArgs(), **own)
    actions = {a.dest: a for a in _subparser(command)._actions if a.dest in args.engine_args_fields}
    assert set(actions) == set(args.engine_args_fields)
    for name, action in actions.items():
        knob = knob_of(name)
        default = own.get(name, EngineArgs.__dataclass_fields__[name].default)
        assert action.default == default, name
        assert (knob.flag or "--" + name.replace("_", "-")) in action.option_strings, name
        assert action.help is not None and action.help.endswith(f"(default: {knob.shown(default)})"), action.help


@pytest.mark.clause("ARCH-2", "KNOB-2")
@pytest.mark.parametrize("command", ["run", "generate", "serve", "bench throughput", "bench serve"])
def test_max_num_batched_tokens_reaches_every_command(command: str) -> None:
    """ARCH-2: `--max-num-batched-tokens` (missing from run and generate before) sets the knob on every command."""
    needed = ENGINE_COMMANDS[command][0]
    args = build_parser().parse_args([*command.split(), *needed, "--max-num-batched-tokens", "40"])
    assert EngineArgs.from_cli_args(args).max_num_batched_tokens == 40


@pytest.mark.clause("ARCH-2")
def test_llm_takes_exactly_the_fields_and_refuses_a_misspelled_one() -> None:
    """ARCH-2: LLM(model=None, **kwargs): the model positional or by name, the rest EngineArgs' fields by name;
    a misspelled keyword is a ValueError naming it (and the field it is nearest to), before anything loads."""
    params = list(inspect.signature(LLM.__init__).parameters.values())
    either, rest = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_KEYWORD
    assert [(p.name, p.kind) for p in params] == [("self", either), ("model", either), ("kwargs", rest)]
    assert params[1].default is None and FIELDS[0] == "model" and EngineArgs().model is None
    with pytest.raises(ValueError, match=r"'max_num_seq' is not an engine argument \(did you mean 'max_num_seqs'\?\)"):
        LLM(max_num_seq=4)
    with pytest.raises(ValueError, match="'block_size' is not an engine argument"):
        LLM(block_size=4)  # the flag's name, not the field's


def _every_field_set(tmp_path: Path) -> dict[str, Any]:
    """A value for every field, none its default."""
    given: dict[str, Any] = {
        "model": checkpoint("qwen3"), "dtype": "float64", "device": "cpu", "kvcache_block_size": 4,
        "num_kvcache_blocks": 24, "max_num_seqs": 3, "max_num_batched_tokens": 40, "scheduling_policy": "priority",
        "lpm_patience": 3, "max_model_len": 64,
        "gpu_memory_utilization": 0.5, "cpu_kvcache_gib": 0.25, "enforce_eager": True, "check": True,
        "check_full_every": 5, "attention_backend": "torch", "batch_invariant": False, "seed": 7,
        "tensor_parallel_size": 2, "trace": tmp_path / "run.jsonl", "trace_wall_times": True,
    }
    assert list(given) == FIELDS  # a new field gets a value here
    assert all(value != getattr(EngineArgs(), name) for name, value in given.items())
    return given


@pytest.mark.clause("ARCH-2", "KNOB-2")
def test_every_field_reaches_the_engine(tmp_path: Path) -> None:
    """ARCH-2: every field given to LLM is the engine's setting (LLM.settings), and the scheduler's config is
    derived from them (max_num_batched_tokens from the keyword to the scheduler)."""
    given = {**_every_field_set(tmp_path), "tensor_parallel_size": 1}
    llm = LLM(**given)
    assert llm.settings == EngineArgs(**given)
    config = llm.engine.scheduler.config
    assert (config.num_blocks, config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == (24, 4, 3, 40)
    assert (config.policy, config.patience) == ("priority", 3)
    assert llm.checked and llm.traced and llm.limits.max_model_len == 64
    llm.close()


@pytest.mark.clause("ARCH-2")
def test_cli_flags_give_another_command_the_same_settings(tmp_path: Path) -> None:
    """ARCH-2: ``cli_flags`` (how bench serve starts its server) parsed by serve's flags gives the same EngineArgs,
    every field set."""
    settings = EngineArgs(**{**_every_field_set(tmp_path), "model": str(checkpoint("qwen3")),
                             "trace": str(tmp_path / "run.jsonl")})
    args = build_parser().parse_args(["serve", *settings.cli_flags()])
    assert EngineArgs.from_cli_args(args) == settings
    assert EngineArgs().cli_flags() == []


BAD: dict[str, object] = {
    "model": "", "dtype": "int8", "device": "tpu", "kvcache_block_size": 1, "num_kvcache_blocks": 0,
    "max_num_seqs": 0, "max_num_batched_tokens": True, "scheduling_policy": "fifo", "lpm_patience": -1,
    "max_model_len": 1, "gpu_memory_utilization": 1.5,
    "cpu_kvcache_gib": math.inf, "enforce_eager": "no", "check": 1, "check_full_every": 0,
    "attention_backend": "flash",
    "batch_invariant": "yes", "seed": 1.5, "tensor_parallel_size": 0, "trace": "", "trace_wall_times": 1,
}


@pytest.mark.clause("ARCH-2", "KNOB-4")
@pytest.mark.parametrize("name", FIELDS)
def test_each_field_refuses_a_bad_value_naming_it(name: str) -> None:
    """ARCH-2: EngineArgs validates each field once, a bad value a ValueError naming the field; a field's help is
    set."""
    assert list(BAD) == FIELDS
    with pytest.raises(ValueError, match=f"^{name} "):
        EngineArgs(**{name: BAD[name]})  # type: ignore[arg-type]
    assert knob_of(name).help


@pytest.mark.clause("ARCH-2")
def test_the_scheduler_config_and_the_workers_spec_derive_from_it(tmp_path: Path) -> None:
    """ARCH-2: the scheduler's config and the tensor-parallel workers' RunnerSpec are EngineArgs' fields of the
    same names (the spec only once every None is resolved: a None left is refused by name)."""
    settings = EngineArgs(**_every_field_set(tmp_path))
    assert settings.scheduler_config(num_blocks=9, eos=5) == SchedulerConfig(9, 4, 3, 40, 5, "priority", 3)
    spec = RunnerSpec.of(settings, threads=2)
    for field in dataclasses.fields(RunnerSpec):
        if field.name != "threads":
            expected = getattr(settings, field.name)
            assert getattr(spec, field.name) == (str(expected) if field.name == "model" else expected), field.name
    with pytest.raises(ValueError, match=r"unresolved engine settings: \['dtype'\]"):
        RunnerSpec.of(dataclasses.replace(settings, dtype=None), threads=1)


@pytest.mark.clause("ARCH-2", "CLI-2")
def test_generate_seed_is_every_requests_seed(capsys: pytest.CaptureFixture[str]) -> None:
    """CLI-2: generate's --seed is SamplingParams.seed, as it was before EngineArgs: every prompt draws with it, so
    the same prompt twice gives the same text (as the engine's seed, the two draws differed); the engine's seed
    stays its default."""
    args = build_parser().parse_args(["generate", "--seed", "5", "hi"])
    assert args.seed == 5 and EngineArgs.from_cli_args(args).seed == EngineArgs().seed
    from optimized.cli import main

    assert main(["generate", "--max-tokens", "6", "--temperature", "0.8", "--seed", "5", "--device", "cpu",
                 "hi", "hi"]) == 0
    lines = capsys.readouterr().out.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("--- 'hi' -> ")]
    assert len(heads) == 2
    first, second = lines[heads[0]:heads[1]], lines[heads[1]:]
    assert first == second


@pytest.mark.clause("ARCH-2")
def test_a_torch_device_is_taken_as_its_name() -> None:
    """ARCH-2: LLM(device=torch.device("cpu")) worked before EngineArgs and works again: a torch.device is its
    str() ('cuda:1'), judged by the device rule like a name."""
    import torch

    assert EngineArgs(device=torch.device("cuda", 1)).device == "cuda:1"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^device must be 'cpu', 'cuda' or 'cuda:N'.*got 'cpu:7'"):
        EngineArgs(device=torch.device("cpu", 7))  # type: ignore[arg-type]
    llm = LLM(checkpoint("qwen3"), device=torch.device("cpu"), num_kvcache_blocks=8, max_model_len=32)
    assert llm.settings.device == "cpu" and llm.device == torch.device("cpu")
    llm.close()


@pytest.mark.clause("ARCH-2", "CLI-2")
def test_a_refusal_names_fields_in_python_and_flags_on_the_command_line() -> None:
    """ARCH-2, CLI-2: EngineArgs' refusal is an EngineArgsError carrying the field; in Python its message names the
    field, and from_cli_args names the flags instead (``--trace-wall-times needs --trace FILE``), from the field
    it carries, never from the message's text."""
    with pytest.raises(EngineArgsError, match=r"^trace_wall_times needs trace ") as refused:
        EngineArgs(trace_wall_times=True)
    assert refused.value.field == "trace_wall_times"
    with pytest.raises(EngineArgsError, match=r"^max_num_seqs must be an integer >= 1, got 0$") as refused:
        EngineArgs(max_num_seqs=0)
    assert refused.value.field == "max_num_seqs"
    args = build_parser().parse_args(["serve", "--trace-wall-times"])
    with pytest.raises(ValueError, match=r"^--trace-wall-times needs --trace FILE "):
        EngineArgs.from_cli_args(args)
    args = build_parser().parse_args(["serve"])
    args.kvcache_block_size = 1  # a value only a command's own default could hold (the parser refuses it)
    with pytest.raises(ValueError, match=r"^--block-size N must be an integer >= 2, got 1$"):
        EngineArgs.from_cli_args(args)


@pytest.mark.clause("ENG-21")
def test_numpy_numbers_are_taken_as_the_numbers_they_stand_for() -> None:
    """ENG-21: `num_kvcache_blocks=np.int64(64)` was refused ('must be an integer >= 1, got np.int64(64)'); numpy
    integers and reals are now Python's int and float, checked as any value, and numpy's bool is no number."""
    import numpy as np

    args = EngineArgs.of(num_kvcache_blocks=np.int64(64), max_num_seqs=np.uint8(4), cpu_kvcache_gib=np.float32(0.5))
    assert (args.num_kvcache_blocks, args.max_num_seqs, args.cpu_kvcache_gib) == (64, 4, 0.5)
    assert type(args.num_kvcache_blocks) is int and type(args.max_num_seqs) is int
    assert type(args.cpu_kvcache_gib) is float
    for bad, field_name in ((dict(num_kvcache_blocks=np.int64(0)), "num_kvcache_blocks"),
                            (dict(max_num_seqs=np.bool_(True)), "max_num_seqs"), (dict(check=np.bool_(True)), "check"),
                            (dict(cpu_kvcache_gib=np.float64("nan")), "cpu_kvcache_gib")):
        with pytest.raises(ValueError, match=f"^{field_name} must be "):
            EngineArgs.of(**bad)
