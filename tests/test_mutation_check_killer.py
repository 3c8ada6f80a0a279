"""CHECK-6: the mutation tool with check mode as the killer (``--killer check --check-full-every K``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutation import targets
from tests.mutation.__main__ import main
from tests.mutation.check_killer import main as killer_main
from tests.mutation.mutants import Mutant, find_mutants
from tests.mutation.runner import check_command, run

ROOT = Path(__file__).resolve().parents[1]


def _mutant(path: str, line: str, description: str) -> Mutant:
    """The one mutant of ``path`` on the line that reads ``line`` whose edit is ``description``."""
    text = (ROOT / path).read_bytes()
    lines = text.decode().splitlines()
    found = [m for m in find_mutants(path, text)
             if lines[m.line - 1].strip() == line and m.describe().endswith(description)]
    assert len(found) == 1, (description, found)
    return found[0]


@pytest.mark.clause("CHECK-6")
def test_the_check_killer_kills_a_divergent_mutant_and_spares_an_unreached_one(tmp_path: Path) -> None:
    """CHECK-6: judged by check mode at K=32, a mutant that gives every block a reference too many is killed by a
    divergence (named as the killer), one that moves the free queue's compaction threshold (never reached by the
    killer's workloads) survives, and the tree is untouched."""
    killed = _mutant("optimized/core/block_pool.py", "self._extra = [0] * num_blocks", "constant: `0` -> `1`")
    spared = _mutant("optimized/core/free_queue.py", "if k > 1024 and 2 * k > len(buf):",
                     "constant: `1024` -> `1025`")
    before = {m.path: (ROOT / m.path).read_bytes() for m in (killed, spared)}
    lines: list[str] = []
    score = run(ROOT, [killed, spared], check_command(32, 0), targets.COPIED, workspace=tmp_path / "mutants",
                report=lines.append, explain=lambda m, lines: "")
    assert [o.status for o in score.outcomes] == ["killed", "survived"], lines
    assert score.outcomes[0].killer.endswith(":divergence"), score.outcomes[0]
    assert {m.path: (ROOT / m.path).read_bytes() for m in (killed, spared)} == before


@pytest.mark.clause("CHECK-6")
def test_the_killer_passes_the_sound_core_and_the_option_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    """CHECK-6: the unmutated core passes every workload at K=1 and K=32; --killer check mutates only
    optimized/core/; --check-full-every needs it and is at least 1."""
    for every in ("1", "32"):
        assert killer_main(["--check-full-every", every]) == 0
        assert f"8 workloads passed check mode (check_full_every={every})" in capsys.readouterr().out
    assert main(["--killer", "check", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed and {line.split(":")[0] for line in listed} == set(targets.CHECK_TARGETS)
    assert all(f.startswith("optimized/core/") for f in targets.CHECK_TARGETS)
    for argv in (["--check-full-every", "4"], ["--killer", "check", "--check-full-every", "0"]):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2 and "--check-full-every" in capsys.readouterr().err
