"""Check mode in proportion to the step (spec/check.md): what each step compares, what every K steps, and that
nothing is lost by it."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from invariants import seq_view
from invariants.on_demand import TokenCount, live_view
from optimized import LLM, SamplingParams
from optimized.cli import main
from optimized.core.kv_cache_manager import KVCacheManager
from optimized.core.scheduler import Scheduler
from optimized.engine.args import EngineArgs
from optimized.verify import shadow as shadow_module
from optimized.verify.reference_port import ReferenceBlocks
from optimized.verify.shadow import Shadow, ShadowDivergence
from tests.check_driver import config, drive, workload
from tests.engine_fixtures import checkpoint, make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("engine_env")

make = partial(make_llm, kvcache_block_size=2, num_kvcache_blocks=64)


def _cached_free_block(llm: LLM) -> int:
    """A free block that still carries its hash (a finished request's), which no later step takes here."""
    blocks = llm.engine.scheduler.blocks
    return next(b for b in reversed(range(blocks.num_blocks))
                if not blocks.is_used(b) and blocks.block_hash(b) != -1)


def _corrupt_hash(llm: LLM, long_seq: Any) -> int:
    block = _cached_free_block(llm)
    manager = llm.engine.scheduler.blocks
    manager._hashes[block] ^= 1  # the port's internals: the block's hash, kept while it is free
    return block


def _corrupt_tokens(llm: LLM, long_seq: Any) -> int:
    block = _cached_free_block(llm)
    contents = llm.engine.scheduler.blocks._contents  # the port's internals: the block's tokens, kept while free
    contents[block] = (int.from_bytes(contents[block][:8], "little", signed=True) + 1).to_bytes(
        8, "little", signed=True) + contents[block][8:]
    return block


def _corrupt_ref_count(llm: LLM, long_seq: Any) -> int:
    block: int = long_seq.block_table[0]  # held by the running request; a decode step touches only its last blocks
    llm.engine.scheduler.blocks.pool._extra[block] += 1
    return block


@pytest.mark.clause("CHECK-2", "CHECK-3", "CHECK-4")
@pytest.mark.parametrize("corrupt", [_corrupt_hash, _corrupt_tokens, _corrupt_ref_count],
                         ids=["cached-free-hash", "cached-free-tokens", "ref-count"])
def test_an_untouched_block_corrupted_is_caught_at_the_next_full_comparison(corrupt: Any) -> None:
    """CHECK-2, CHECK-3, CHECK-4: a block the steps do not touch, corrupted in the engine's cache, passes every
    per-step comparison and is caught by the next full one, within check_full_every steps, naming the block."""
    every = 6
    llm = make(check_full_every=every)
    shadow = llm.shadow
    assert shadow is not None
    long = llm.engine.add([1, 2, 3, 4, 5, 6, 7, 8], GREEDY, seed=0)
    llm.engine.add([9, 10, 11, 12, 13], SHORT, seed=0)
    while shadow.step % every != 1 or len(llm.engine.live) != 1:  # the short one finished; a full comparison passed
        llm.engine.step()
    block = corrupt(llm, long.seq)
    for _ in range(every - 2):  # the steps before the next full comparison: not caught
        llm.engine.step()
    assert shadow.step % every == every - 1  # the next step's end compares the whole states
    with pytest.raises(ShadowDivergence, match=rf"(?s)check mode, step {shadow.step}: (.*full check.*block {block}\b"
                                               rf"|block {block}\b.*full check).*--- engine scheduler ---.*"
                                               "--- reference scheduler"):
        llm.engine.step()


@pytest.mark.clause("CHECK-1", "CHECK-4")
def test_a_decision_difference_is_caught_at_that_step_naming_it_with_both_states() -> None:
    """CHECK-1, CHECK-4: a scheduler that grants one token fewer, once, is caught at that very step (not at the
    next full comparison): the report names the step and shows both states."""

    class OneFewer(Scheduler):
        armed = False

        def schedule(self) -> Any:
            out = super().schedule()
            if OneFewer.armed and out.is_prefill:
                OneFewer.armed = False
                out.batch[0].core.nsched -= 1  # the grant, as the core keeps it
            return out

    llm = make(check_full_every=1000)
    shadow = llm.shadow
    assert shadow is not None
    llm.engine.add([1, 2, 3, 4, 5, 6], GREEDY, seed=0)
    for _ in range(3):
        llm.engine.step()
    llm.engine.scheduler.__class__ = OneFewer
    OneFewer.armed = True
    llm.engine.add([7, 8, 9, 10, 11], GREEDY, seed=0)
    with pytest.raises(ShadowDivergence, match=r"(?s)check mode, step 3: batch .*engine=\[\(1, 4, 0, 5, .*"
                                               r"reference=\[\(1, 5, 0, 5, .*--- engine scheduler ---.*"
                                               r"--- reference scheduler ---") as err:
        llm.engine.step()
    assert "id=" in str(err.value).split("--- reference scheduler ---")[1]  # the reference's state is shown


@pytest.mark.clause("CHECK-2", "CHECK-4")
@pytest.mark.parametrize(("budget", "at", "index"), [(16, 0, 0), (4, 1, 2)], ids=["one-shot", "middle-chunk"])
def test_a_block_hashed_in_the_middle_of_a_prefill_corrupted_is_caught_at_that_step(budget: int, at: int,
                                                                                     index: int) -> None:
    """CHECK-2, CHECK-4: every block a prefill step fills is hashed, not only the table's last ones: one of the
    first blocks a step hashed (block 0 of a one-shot prefill; the first of a middle chunk's, whose table the
    step did not grow), its hash corrupted in the engine's cache right after that step's postprocess, is caught
    at that very step with a large check_full_every."""
    cfg = config(block_size=2, max_num_batched_tokens=budget)
    port = Scheduler(cfg)
    shadow = Shadow(cfg, full_every=1000)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]  # 6 blocks: one step at budget 16, three at budget 4
    corrupted: list[int] = []

    def corrupt(step: int) -> None:
        if step == at:
            blocks = port.blocks
            block = [*port.running, *port.waiting][0].block_table[index]  # the one request
            blocks.flush()
            assert blocks.block_hash(block) != -1  # the step hashed it
            blocks._hashes[block] ^= 1  # the port's internals: the hash the step just wrote
            corrupted.append(block)

    with pytest.raises(ShadowDivergence, match=rf"check mode, step {at}: block (\d+) \(touched by this step\)") as err:
        drive(port, shadow, [(prompt, 4)], cfg.eos, after_postprocess=corrupt)
    assert str(err.value).startswith(f"check mode, step {at}: block {corrupted[0]} ")


@pytest.mark.clause("CHECK-3")
def test_close_after_an_interrupted_step_compares_nothing_and_hides_nothing() -> None:
    """CHECK-3: an interruption after the model ran and before the step's end (the engine untrusted, the
    reference a part of a step behind) propagates out of ``with llm:`` as it is: close() compares nothing."""

    class Interrupt(BaseException):
        """A Ctrl-C, as the engine sees it (never a model fault)."""

    llm = make(check_full_every=1000)
    shadow = llm.shadow
    assert shadow is not None
    llm.engine.add([1, 2, 3, 4, 5, 6], GREEDY, seed=0)
    runner = llm.engine.runner
    real, calls = runner.take_logprobs, [0]

    def take_logprobs() -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise Interrupt
        return real()

    runner.take_logprobs = take_logprobs  # type: ignore[method-assign]
    before = shadow.full_comparisons
    with pytest.raises(Interrupt) as err, llm:
        for _ in range(5):
            llm.engine.step()
    assert not llm.trusted and shadow.step == 2
    assert err.value.__context__ is None and not getattr(err.value, "__notes__", None)  # nothing was compared
    llm.close()  # again, with nothing propagating: still nothing compared, nothing raised
    assert shadow.full_comparisons == before


@pytest.mark.clause("CHECK-3")
def test_close_never_hides_an_exception_that_propagates() -> None:
    """CHECK-3: with the engine trusted, close() still compares while another exception leaves ``with llm:``,
    and a divergence it finds is noted on that exception instead of replacing it."""
    llm = make(check_full_every=1000)
    long = llm.engine.add([1, 2, 3, 4, 5, 6], GREEDY, seed=0)
    with pytest.raises(LookupError, match="the caller's") as err, llm:
        for _ in range(3):
            llm.engine.step()
        llm.engine.scheduler.blocks.pool._extra[long.seq.block_table[0]] += 1  # untouched by any step since
        raise LookupError("the caller's")
    assert llm.trusted
    assert any("full check at close" in note for note in getattr(err.value, "__notes__", []))


@pytest.mark.clause("CHECK-3")
def test_full_comparisons_come_every_k_steps_and_at_the_end_of_a_run() -> None:
    """CHECK-3: every check_full_every-th step and whenever nothing is left live; the default is EngineArgs'."""
    assert EngineArgs().check_full_every == shadow_module.FULL_EVERY
    llm = make(check_full_every=5)
    shadow = llm.shadow
    assert shadow is not None
    llm.generate([[1, 2, 3, 4, 5, 6], [7, 8, 9]], GREEDY, use_tqdm=False)
    steps = llm.stats.steps
    assert llm.stats.compared_steps == steps and shadow.step == steps
    assert shadow.full_comparisons == steps // 5 + (steps % 5 != 0)
    llm.close()  # nothing changed since the end of the run: no comparison more
    assert shadow.full_comparisons == steps // 5 + (steps % 5 != 0)


@pytest.mark.clause("CHECK-3")
def test_close_compares_when_requests_are_still_live() -> None:
    """CHECK-3: close() compares the whole states when something changed since they were last compared."""
    llm = make(check_full_every=1000)
    shadow = llm.shadow
    assert shadow is not None
    long = llm.engine.add([1, 2, 3, 4, 5, 6], GREEDY, seed=0)
    for _ in range(3):
        llm.engine.step()
    before = shadow.full_comparisons
    llm.engine.scheduler.blocks.pool._extra[long.seq.block_table[0]] += 1  # untouched by any step since
    with pytest.raises(ShadowDivergence, match="full check at close"):
        llm.close()
    assert shadow.full_comparisons == before


@pytest.mark.clause("CHECK-1", "CHECK-2", "CHECK-3")
def test_a_step_reads_only_the_blocks_it_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    """CHECK-1, CHECK-2, CHECK-3: between full comparisons a step, or an abort, reads a number of blocks that
    follows the batch, not num_blocks: on a cache of 100,000 blocks, no step of the per-step check reads more
    than the touched blocks, neither scheduler's free queue nor prefix table is copied, and an abort brings no
    full comparison (only the end of a run does, with nothing live)."""
    cfg = config(num_blocks=100_000, block_size=2)
    port = Scheduler(cfg)
    shadow = Shadow(cfg, full_every=10**9)
    reads: list[int] = []
    real = port.blocks.ref_count

    def counted(block_id: int) -> int:
        reads.append(block_id)
        return real(block_id)

    port.blocks.ref_count = counted  # type: ignore[method-assign]
    copies: list[str] = []
    for side in (KVCacheManager, ReferenceBlocks):
        for name in ("free_block_ids", "hash_to_block_id"):
            getter = getattr(side, name).fget

            def copied(blocks: Any, getter: Any = getter, name: str = name) -> Any:
                copies.append(name)
                return getter(blocks)

            monkeypatch.setattr(side, name, property(copied))
    full_with_live: list[bool] = []
    shadow._compare_full = lambda *a: full_with_live.append(bool(shadow.by_arrival))  # type: ignore[method-assign]
    steps = drive(port, shadow, workload(1, 12), cfg.eos, abort_every=3)
    assert steps > 10 and 0 < len(reads) < 40 * steps
    assert copies == [] and full_with_live and not any(full_with_live)


@pytest.mark.clause("CHECK-4")
@pytest.mark.parametrize("seed", range(6))
def test_full_every_step_and_every_k_agree_on_a_sound_scheduler(seed: int) -> None:
    """CHECK-4: the optimized scheduler passes check mode with the full comparison after every step and every
    K (aborts and prefix hits included): the comparisons raise nothing on a sound pair."""
    for every in (1, 4):
        cfg = config()
        port = Scheduler(cfg)
        shadow = Shadow(cfg, full_every=every)
        steps = drive(port, shadow, workload(seed, 14), cfg.eos, abort_every=3)
        assert port.is_finished() and shadow.step > 0 and steps < 400


@pytest.mark.clause("CHECK-3")
def test_check_full_every_is_refused_below_one() -> None:
    """CHECK-3: check_full_every is an integer of at least 1, refused naming the field."""
    with pytest.raises(ValueError, match="check_full_every"):
        LLM(check=True, check_full_every=0)
    with pytest.raises(ValueError, match="check_full_every"):
        Shadow(config(), full_every=0)


@pytest.mark.clause("CHECK-5")
def test_bench_check_prints_both_sides_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    """CHECK-5: `nanoverify bench check` times both engines alternating on both workloads and prints every run,
    both medians and the ratio against the 1.3x target."""
    code = main(["bench", "check", "--model", str(checkpoint("qwen3")), "--num-requests", "3", "--prompt-len", "5",
                 "--output-len", "3", "--run-requests", "4", "--rounds", "1", "--check-full-every", "2"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    for name in ("bench", "run"):
        runs = [line for line in out.splitlines() if line.startswith(f"  {name} round 1 ")]
        assert [line.split(":")[0].split()[-1] for line in runs] == ["unchecked", "checked", "checked", "unchecked"]
        assert f"  {name}: unchecked median " in out
    assert out.count("the 1.3x target") == 2 and "check_full_every=2" in out


@pytest.mark.clause("CHECK-5")
def test_bench_serve_compare_check_prints_both_sides_and_the_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    """CHECK-5: `nanoverify bench serve --compare-check` starts two real servers (one with --check and the given
    check_full_every), sends both the same workloads alternating, and prints every run's output tok/s and server CPU
    seconds, both medians and the ratio against the 75% target, and the ratio per server CPU second."""
    code = main(["bench", "serve", "--compare-check", "--model", str(checkpoint("qwen3")), "--requests", "3",
                 "--max-input-len", "5", "--max-output-len", "3", "--rounds", "1", "--check-full-every", "2"])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    servers = [line for line in out.splitlines() if " server: nanoverify serve " in line]
    assert len(servers) == 2 and "--check" not in servers[0].split()
    assert {"--check", "--check-full-every"} <= set(servers[1].split()), servers
    runs = [line for line in out.splitlines() if line.startswith("  round 1 ")]
    assert [line.split(":")[0].split()[-1] for line in runs] == ["unchecked", "checked", "checked", "unchecked"]
    assert all(" output tok/s (" in line and "FAILED" not in line for line in runs), runs
    assert "  unchecked median " in out and "checked keeps" in out and "the 75% target" in out
    assert all(" s server CPU)" in line for line in runs), runs  # Linux: every run's server CPU seconds
    assert "  per server CPU second: unchecked median " in out, out


@pytest.mark.clause("CHECK-3", "CHECK-4")
def test_a_reference_invariant_the_comparison_does_not_see_is_caught_at_the_next_full_comparison() -> None:
    """CHECK-3: the invariants that read a sequence's id or status, which the full comparison does not compare, are
    still checked on the reference at every full comparison: a reference sequence's status corrupted (in the step
    whose end compares the whole states; its next schedule() would read it) passes that step's check and is caught
    by the full comparison as the reference's INV-7."""
    cfg, every = config(), 8
    at = every - 1
    port, shadow = Scheduler(cfg), Shadow(cfg, full_every=every)

    def corrupt(step: int) -> None:
        if step == at:
            seq = shadow.ref.running[0]
            seq.status = type(seq.status).WAITING  # the reference's running sequence says it is waiting

    with pytest.raises(ShadowDivergence, match=rf"(?s)check mode, step {every - 1}: reference scheduler breaks "
                                               r"\(full check after the step\) INV-7.*is in running with status "
                                               "WAITING"):
        drive(port, shadow, workload(0, 12), cfg.eos, after_postprocess=corrupt)


@pytest.mark.clause("CHECK-2")
def test_a_step_check_reads_a_sequence_s_count_of_tokens_never_a_copy_of_them() -> None:
    """CHECK-2: the per-step checks read each live sequence as ``live_view``: ``seq_view``'s fields, with the number
    of tokens kept and the tokens themselves never copied; a check that reads them is refused, never shown none."""
    scheduler = Scheduler(config())
    seq = scheduler.new_sequence([1, 2, 3, 4, 5], 4)
    scheduler.add(seq)
    scheduler.schedule()
    live, full = live_view(seq), seq_view(seq)
    assert live.num_tokens == full.num_tokens == 5 and len(live.token_ids) == 5
    assert [getattr(live, f) for f in ("seq_id", "status", "num_prompt_tokens", "num_cached_tokens",
                                       "num_scheduled_tokens", "block_table", "max_tokens", "is_prefill")] == [
        getattr(full, f) for f in ("seq_id", "status", "num_prompt_tokens", "num_cached_tokens",
                                   "num_scheduled_tokens", "block_table", "max_tokens", "is_prefill")]
    for read in (lambda: list(live.token_ids), lambda: live.token_ids[0], lambda: live.token_ids[1:]):
        with pytest.raises(TypeError, match="number of a sequence's tokens"):
            read()
    assert live.token_ids == TokenCount(5) and live.token_ids != TokenCount(4)


@pytest.mark.clause("CHECK-5")
def test_bench_serve_refuses_rounds_without_compare_check(capsys: pytest.CaptureFixture[str]) -> None:
    """CHECK-5: --rounds counts --compare-check's rounds; given without it, it is refused naming the flag, before
    any model loads, never silently ignored."""
    code = main(["bench", "serve", "--rounds", "3"])
    err = capsys.readouterr().err
    assert code != 0 and "--rounds applies only with --compare-check" in err, err
