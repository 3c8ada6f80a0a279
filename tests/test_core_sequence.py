"""The sequence and its core record: refusals at the boundary, one record written by the core (OPT-10, OPT-25)."""


from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import optimized
import reference
from invariants import snapshot
from optimized.core.scheduler import Scheduler, SchedulerConfig, Sequence
from optimized.engine.sampling_params import SamplingParams


@pytest.mark.clause("OPT-10")
def test_bad_requests_are_refused_at_the_boundary_and_change_nothing() -> None:
    """OPT-10: ValueError naming the field; the scheduler's state is untouched."""
    opt = Scheduler(SchedulerConfig(num_blocks=4, block_size=4))
    before = snapshot(opt)
    with pytest.raises(ValueError, match="block_size"):
        opt.add(Sequence([1, 2], SamplingParams(), 8))
    with pytest.raises(ValueError, match="optimized Sequence"):
        opt.add(reference.Sequence([1, 2], reference.SamplingParams(), 4))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        opt.add(Sequence([1, 2], reference.SamplingParams(max_tokens=0), 4))
    with pytest.raises(ValueError, match="token_ids"):
        Sequence([1, "x"], SamplingParams(), 4)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="block_size"):
        Sequence([1], SamplingParams(), 1)
    assert snapshot(opt) == before
    seq = Sequence([1, 2], SamplingParams(max_tokens=3), 4)
    opt.add(seq)
    with pytest.raises(ValueError, match="already added"):
        opt.add(seq)
    with pytest.raises(ValueError, match="stop_token_ids"):
        opt.add(Sequence([1, 2], SamplingParams(max_tokens=3), 4), stop_token_ids=[3, True])
    assert len(opt.waiting) == 1 and seq.max_tokens == 3


@pytest.mark.clause("OPT-10")
def test_an_int64_prompt_is_taken_without_a_second_check_of_each_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """OPT-10: the engine validates a prompt once at its boundary and hands it over as int64; the sequence does not
    check each token again (a list still is checked, and refused with the field named)."""
    import optimized.core.sequence as seq_module

    def forbidden(value: object) -> bool:
        raise AssertionError("a token checked twice")

    monkeypatch.setattr(seq_module, "is_strict_int", forbidden)
    prompt = np.array([5, 6, 7], dtype=np.int64)
    seq = Sequence(prompt, SamplingParams(max_tokens=2), 4)
    prompt[0] = 9  # the sequence holds its own copy
    assert seq.token_ids == [5, 6, 7]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="token_ids"):
        Sequence([5, True], SamplingParams(), 4)


@pytest.mark.clause("OPT-25")
def test_no_core_class_writes_another_objects_private_fields_and_sequence_does_not_import_the_group() -> None:
    """OPT-25: the core writes a sequence's state through its ``core`` record only; no ``x._field = ...`` on
    anything but ``self``, and sequence.py imports neither the decode group nor the scheduler."""
    import ast

    core = Path(optimized.__file__).parent / "core"
    writes = []
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr.startswith("_") and not (
                        isinstance(target.value, ast.Name) and target.value.id == "self"):
                    writes.append(f"{path.name}:{target.lineno} {ast.unparse(target)}")
    assert writes == []
    imported = {node.module for node in ast.walk(ast.parse((core / "sequence.py").read_text()))
                if isinstance(node, ast.ImportFrom)}
    assert not imported & {"optimized.core.decode_group", "optimized.core.scheduler"}
