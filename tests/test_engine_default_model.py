"""The embedded default model and the commands that use it."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from optimized import LLM, SamplingParams
from optimized.cli import main as cli_main
from optimized.models.default_model import default_model_dir
from tests.engine_fixtures import hf_greedy, one_thread


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp, one_thread():
        root = tmp_path_factory.mktemp("nanoverify-cache")
        mp.setenv("NANOVERIFY_CACHE", str(root))
        yield root


@pytest.mark.clause("ENG-23")
def test_default_model_is_made_deterministically_and_loads_like_a_checkpoint(cache_dir: Path) -> None:
    """ENG-23: made on first use into the cache folder, byte-identical when made again, loaded by transformers
    (weights and tokenizer) as any checkpoint; greedy output varies and equals transformers'."""
    from transformers import AutoTokenizer

    folder = default_model_dir()
    assert folder.parent == cache_dir
    first = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()
    assert (default_model_dir() / "model.safetensors").read_bytes() == first
    text = "Hello, wörld"
    llm = LLM(None, dtype="float64", num_kvcache_blocks=64, check=True)
    assert llm.model_dir == folder
    hf_tok = AutoTokenizer.from_pretrained(str(folder))
    assert hf_tok.encode(text) == llm.tokenizer.encode(text)
    prompts = ["Hello", "The quick brown fox", "1 2 3"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    assert [o.token_ids for o in outs] == hf_greedy(folder, ids, [12] * 3)
    assert len({t for o in outs for t in o.token_ids}) > 12
    assert outs[0].text == hf_tok.decode(outs[0].token_ids, skip_special_tokens=True)


@pytest.mark.clause("ENG-24")
def test_run_command_reports_identical_decisions(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ENG-24: ``nanoverify run`` serves its workload in check mode and reports steps, preemptions, prefix-cache
    hits and every step's decisions identical to the reference."""
    args = ["run", "--num-requests", "24", "--max-input-len", "24", "--max-output-len", "8"]
    assert cli_main([*args, "--num-kvcache-blocks", "8", "--block-size", "4"]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.startswith("decisions identical to the reference"))
    done, total = line.split(": ")[1].split(" ")[0].split("/")
    assert done == total and int(total) > 0
    assert "preemptions: 0" not in out and "prefix-cache hit tokens: 0" not in out


@pytest.mark.clause("ENG-24")
def test_generate_command(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ENG-24: ``nanoverify generate`` prints one completion per prompt; bad input exits 2 with the field named."""
    assert cli_main(["generate", "--max-tokens", "5", "--seed", "3", "--temperature", "0.7", "Hi", "there"]) == 0
    assert capsys.readouterr().out.count("(5 tokens, length)") == 2
    assert cli_main(["generate", "--max-tokens", "0", "Hi"]) == 2
    assert "max_tokens" in capsys.readouterr().err


@pytest.mark.clause("ENG-25")
def test_throughput_benchmark_prints_both_sides(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ENG-25: the throughput benchmark runs the engine and transformers on one workload and prints the ratio."""
    from optimized.benchmarks.throughput import run
    from optimized.engine.args import EngineArgs

    args = argparse.Namespace(num_requests=6, max_input_len=12, max_output_len=6)
    assert run(args, EngineArgs(device="cpu")) == 0
    out = capsys.readouterr().out
    assert "nanoverify engine:" in out and "transformers generate:" in out and "ratio (engine / transformers):" in out
