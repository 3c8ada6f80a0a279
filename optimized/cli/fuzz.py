"""``nanoverify fuzz``: run the registered state machines under the ``fuzz`` profile until time runs out.

The run is a sequence of chunks, round-robin over the machines; chunk ``c``
runs ``CHUNK_EXAMPLES`` examples seeded with ``seed + c``, so the same
``--seed`` replays the same chunks. A failure stops the run (exit 1) and prints,
under headings of this command's own, the failing program, its
``@reproduce_failure`` blob and the commands that reproduce it; a run that
finds nothing exits 0. ``--minutes inf`` runs until interrupted: Ctrl-C then
prints the progress so far, the line saying so on standard error (CLI-4), and
exits 130 (spec/cli.md, CLI-6). A ``--reproduce`` blob that does not decode is
bad input (exit 2), not a finding.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from optimized.engine import arg_types

if TYPE_CHECKING:
    import hypothesis
    from hypothesis.stateful import RuleBasedStateMachine

    from optimized.verify.machines import Stats

HELP = "fuzz the scheduler with the hypothesis state machines (fuzz profile) for N minutes"
CHUNK_EXAMPLES = 5
PROGRESS_EVERY_S = 10.0
INTERRUPTED = 128 + 2  # the shell's status for a command ended by SIGINT
BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=arg_types.minutes, default=None,
                   help="how long to fuzz (fractions allowed; required); inf runs until Ctrl-C, which prints the "
                   "progress and exits 130")
    p.add_argument("--seed", type=arg_types.any_int, default=None, help="seed of the run (default: random, printed)")
    p.add_argument("--machine", default=None, help="run only this registered machine")
    p.add_argument("--no-shrink", action="store_true",
                   help="report the first failing program as found, without minimising it (faster)")
    p.add_argument("--reproduce", metavar="BLOB", default=None,
                   help="rerun one failure from its @reproduce_failure blob (needs --machine)")


def main(args: argparse.Namespace) -> int:
    from optimized.verify import machines

    if args.reproduce is None and args.minutes is None:
        print("nanoverify fuzz: --minutes is required (a number >= 0, or inf)", file=sys.stderr)
        return 2
    names = [args.machine] if args.machine is not None else list(machines.MACHINES)
    if args.reproduce is not None and args.machine is None:
        print("nanoverify fuzz: --reproduce needs --machine", file=sys.stderr)
        return 2
    factories: dict[str, type[RuleBasedStateMachine]] = {}
    for name in names:
        try:
            factories[name] = machines.load(name)
        except ValueError as e:
            print(f"nanoverify fuzz: {e}", file=sys.stderr)
            return 2
    if args.reproduce is not None:
        return reproduce(args.machine, factories[args.machine], args.reproduce)
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    print(f"nanoverify fuzz: seed {seed}, {args.minutes:g} minutes, machines {', '.join(factories)}", flush=True)
    return fuzz(factories, seed, args.minutes, not args.no_shrink)


def fuzz(factories: dict[str, type[RuleBasedStateMachine]], seed: int, minutes: float, shrink: bool) -> int:
    from optimized.verify.machines import Stats

    stats = {name: Stats() for name in factories}
    start = time.monotonic()
    last_report = start
    chunk = 0
    order = list(factories)
    # At least one chunk per machine, however short the run.
    while chunk < len(order) or time.monotonic() - start < minutes * 60.0:
        name = order[chunk % len(order)]
        try:
            error = run_chunk(factories[name], stats[name], seed + chunk, shrink)
        except KeyboardInterrupt:
            report_progress(start, stats)
            print(f"nanoverify fuzz: interrupted after {time.monotonic() - start:.1f}s ({chunk} chunks), "
                  "nothing found", file=sys.stderr, flush=True)
            return INTERRUPTED
        if error is not None:
            report_progress(start, stats)
            report_failure(name, error, f"--minutes {minutes:g} --seed {seed}{'' if shrink else ' --no-shrink'}")
            return 1
        chunk += 1
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:
            report_progress(start, stats)
            last_report = time.monotonic()
    report_progress(start, stats)
    print(f"nanoverify fuzz: nothing found in {time.monotonic() - start:.1f}s ({chunk} chunks)")
    return 0


def run_chunk(machine: type[RuleBasedStateMachine], stats: Stats, chunk_seed: int,
              shrink: bool) -> BaseException | None:
    """One chunk of examples under the fuzz profile; the exception hypothesis raised, if any."""
    import hypothesis

    from optimized.verify.machines import FUZZ_SETTINGS

    phases = list(hypothesis.Phase) if shrink else [
        p for p in hypothesis.Phase if p not in (hypothesis.Phase.shrink, hypothesis.Phase.explain)]
    settings = hypothesis.settings(**{**FUZZ_SETTINGS, "max_examples": CHUNK_EXAMPLES, "phases": phases})
    test = machine_test(machine, stats, settings)
    test = hypothesis.seed(chunk_seed)(test)
    return call(test)


def machine_test(machine: type[RuleBasedStateMachine], stats: Stats,
                 settings: hypothesis.settings) -> Callable[[], None]:
    from hypothesis.stateful import get_state_machine_test

    from optimized.verify.machines import counting

    return get_state_machine_test(counting(machine, stats), settings=settings)


def call(test: Callable[[], None]) -> BaseException | None:
    try:
        test()
    except KeyboardInterrupt:
        raise
    except Exception as e:  # any failure of the machine is a finding to report, not a crash
        return e
    return None


def reproduce(name: str, machine: type[RuleBasedStateMachine], blob: str) -> int:
    import hypothesis

    from optimized.verify.machines import FUZZ_SETTINGS, Stats

    check_blob(blob)
    test = machine_test(machine, Stats(), hypothesis.settings(**FUZZ_SETTINGS))
    test = hypothesis.reproduce_failure(hypothesis.__version__, blob.encode())(test)
    error = call(test)
    # DidNotReproduce is how hypothesis says the recorded program now runs past its failure point.
    if error is None or isinstance(error, hypothesis.errors.DidNotReproduce):
        print(f"{name}: the blob no longer fails{f' ({error})' if error is not None else ''}")
        return 0
    report_failure(name, error, None)
    return 1


def check_blob(blob: str) -> None:
    """ValueError unless ``blob`` decodes as a @reproduce_failure blob: a typo is bad input, not a finding."""
    from hypothesis.core import decode_failure  # what reproduce_failure itself decodes with
    from hypothesis.errors import InvalidArgument

    if not blob.isascii():
        raise ValueError(f"--reproduce: not a @reproduce_failure blob (not ASCII): {blob[:40]!r}")
    try:
        decode_failure(blob.encode())
    except InvalidArgument:
        raise ValueError(f"--reproduce: not a @reproduce_failure blob: {blob[:40]!r}") from None


def report_progress(start: float, stats: dict[str, Stats]) -> None:
    elapsed = time.monotonic() - start
    for name, s in stats.items():
        rate = s.rule_applications / elapsed if elapsed > 0 else 0.0
        print(f"[{elapsed:7.1f}s] {name}: {s.examples} examples, {rate:.0f} rule applications/s, {s.steps} steps, "
              f"{s.requests} requests, {s.preemptions} preemptions, {s.prefix_hit_tokens} prefix-hit tokens, "
              f"{s.aborts} aborts, {s.violations} violations", flush=True)


def report_failure(name: str, error: BaseException, rerun: str | None) -> None:
    from optimized.verify.machines import MACHINES

    notes = [str(n) for n in getattr(error, "__notes__", [])]
    print(f"FAILURE in machine {name}: {type(error).__name__}: {error}")
    program = [note for note in notes if "@reproduce_failure" not in note]
    if program:
        print(f"The failing program ({len(program)} notes from hypothesis):")
        for note in program:
            print(note)
    blob = next((m for m in map(BLOB.search, notes) if m is not None), None)
    print("To reproduce:")
    if blob is not None:
        print(f"  nanoverify fuzz --machine {name} --reproduce {blob.group(2)}")
        print(f"  or decorate {MACHINES[name]}.TestCase with @reproduce_failure({blob.group(1)!r}, "
              f"b{blob.group(2)!r}) (hypothesis {blob.group(1)})")
    if rerun is not None:
        print(f"  rerun the whole run: nanoverify fuzz --machine {name} {rerun}")
    sys.stdout.flush()
