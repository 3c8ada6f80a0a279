"""spec/primer.md's worked example (LEARN-1) and the spec's pointers into the lesson's code (LEARN-2): what the
primer states is what reference/scheduler.py does, and every pointer names code that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import reference
from optimized.trace.figures import FIGURES
from reference.sequence import SamplingParams, Sequence

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "spec"


def walkthrough_rows() -> list[str]:
    """The worked example run step by step through the reference itself (no recorder, no replay): per step, the
    kind, each batch member's block table (with the tokens a prefill computed), the victims, and the free queue
    right after ``schedule()``."""
    figure = FIGURES["worked-example"]
    config = reference.SchedulerConfig(**{k: v for k, v in figure.config.items() if k != "eos"}, eos=0)
    scheduler = reference.Scheduler(config)
    request_of: dict[int, int] = {}
    rows: list[str] = []
    step = 0
    while True:
        for rid, (prompt, max_tokens, arrive) in enumerate(figure.requests):
            if arrive == step:
                seq = Sequence(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), config.block_size)
                request_of[seq.seq_id] = rid
                scheduler.add(seq)
        if scheduler.is_finished():
            return rows
        held_before = {request_of[s.seq_id] for s in scheduler.running}
        batch, prefill = scheduler.schedule()
        tables = "; ".join(
            f"{request_of[s.seq_id]}: {' '.join(map(str, s.block_table))}"
            + (f" ({s.num_scheduled_tokens})" if prefill else "") for s in batch)
        victims = sorted(held_before - {request_of[s.seq_id] for s in (*batch, *scheduler.running)})
        kind = ("prefill" if prefill else "decode") + "".join(f", preempts {v}" for v in victims)
        free = " ".join(map(str, scheduler.block_manager.free_block_ids)) or "-"
        rows.append(f"| {step} | {kind} | {tables} | {free} |")
        scheduler.postprocess(batch, [100 + step] * len(batch), prefill)
        step += 1


def stated_rows() -> list[str]:
    """The first four columns of the primer's walkthrough table, as written."""
    text = (SPEC / "primer.md").read_text(encoding="utf-8")
    table = text.split("<!-- walkthrough -->")[1]
    rows = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    return ["| " + " | ".join(cell.strip() for cell in row.split("|")[1:5]) + " |" for row in rows]


@pytest.mark.clause("LEARN-1")
def test_the_worked_example_is_what_the_reference_does() -> None:
    """LEARN-1: every step of the primer's table (kind, victims, block tables, tokens computed, free queue) is what
    the reference hands out for the figure's workload, run statement by statement."""
    expected = walkthrough_rows()
    assert stated_rows() == expected
    # The story the prose tells: a hit on two used blocks, a preemption, the recompute that revives block 4.
    assert "| 1 | prefill | 1: 0 1 3 (3) |" in expected[1] and "preempts 2" in expected[5]
    assert expected[9].startswith("| 9 | prefill | 2: 4 7 2 (6) |")


@pytest.mark.clause("LEARN-1")
def test_a_changed_id_in_the_table_is_caught() -> None:
    """LEARN-1: the comparison reads every id: one block id changed in the stated table makes it differ."""
    rows = stated_rows()
    corrupted = [rows[0].replace("0 1 2", "0 1 3"), *rows[1:]]
    assert corrupted != walkthrough_rows()


LESSON_POINTER = re.compile(r"`Scheduler\.(\w+)`|`BlockManager\.(\w+)`")


@pytest.mark.clause("LEARN-2")
def test_lesson_pointers_name_code_that_exists() -> None:
    """LEARN-2: spec/ points into the reference by function names, never by line numbers (which drift); every
    `Scheduler.x` and `BlockManager.x` it names is defined in reference/."""
    code = {"Scheduler": (ROOT / "reference" / "scheduler.py").read_text(encoding="utf-8"),
            "BlockManager": (ROOT / "reference" / "block_manager.py").read_text(encoding="utf-8")}
    named = 0
    for chapter in sorted(SPEC.glob("*.md")):
        text = chapter.read_text(encoding="utf-8")
        assert not re.search(r"scheduler\.py L\d", text), chapter.name
        for scheduler_name, manager_name in LESSON_POINTER.findall(text):
            cls, name = ("Scheduler", scheduler_name) if scheduler_name else ("BlockManager", manager_name)
            assert re.search(rf"def {name}\(", code[cls]), (chapter.name, cls, name)
            named += 1
    assert named >= 6
