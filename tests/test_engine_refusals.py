"""Bad input is refused at the boundary with a ValueError naming the field or limit, and changes nothing."""

from __future__ import annotations

import math
import re
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from invariants import snapshot
from optimized import LLM, SamplingParams
from optimized.engine.validation import RequestRefused
from optimized.models.tokenizer import load_tokenizer
from tests.engine_fixtures import VOCAB, checkpoint, hf_greedy, make_llm

pytestmark = pytest.mark.usefixtures("engine_env")


GOOD = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


make = partial(make_llm, num_kvcache_blocks=10, max_model_len=48)


def _nan_temperature() -> SamplingParams:
    """A params object corrupted after validation: add time must still refuse it."""
    sp = SamplingParams(temperature=0.5)
    object.__setattr__(sp, "temperature", math.nan)
    return sp


LONG = "context_length_exceeded"
# (prompt, params, what the message must name, the refusal's field and code)
REFUSED: dict[str, tuple[list[int], SamplingParams, str, str, str | None]] = {
    "empty prompt": ([], GREEDY, "prompt", "prompt", None),
    "token above vocab": ([1, VOCAB], GREEDY, "vocab_size", "prompt", None),
    "negative token": ([-1, 2], GREEDY, "vocab_size", "prompt", None),
    "over max_model_len": ([1] * 38, SamplingParams(temperature=0.0, max_tokens=11), "max_model_len", "max_tokens",
                           LONG),
    "prompt alone over max_model_len": ([1] * 48, GREEDY, "prompt is too long.*max_model_len", "prompt", LONG),
    "never fits the KV cache": ([1] * 35, SamplingParams(temperature=0.0, max_tokens=7), "num_kvcache_blocks",
                                "max_tokens", LONG),
    "prompt alone never fits the KV cache": ([1] * 41, SamplingParams(temperature=0.0, max_tokens=1),
                                             "prompt is too long.*num_kvcache_blocks", "prompt", LONG),
    "non-finite temperature": (GOOD, _nan_temperature(), "temperature", "temperature", None),
    # An id the model can never draw would silently never stop the request.
    "stop token at vocab": (
        GOOD,
        SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(3, VOCAB)),
        rf"stop_token_ids.*vocab_size={VOCAB}",
        "stop_token_ids",
        None,
    ),
}


def state(llm: LLM) -> tuple[Any, ...]:
    engine, shadow = llm.engine, llm.shadow
    assert shadow is not None
    return snapshot(engine.scheduler), snapshot(shadow.ref), sorted(engine.live)


@pytest.mark.clause("ENG-10", "ENG-13", "ARCH-6")
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_request_changes_nothing(case: str) -> None:
    """ENG-10, ENG-13: the whole call is refused before any request is added; a request already pending and later
    ones complete exactly as they would have. ARCH-6: the refusal carries the field at fault and, past a
    context limit, OpenAI's code (the prompt's field when the prompt with one token cannot fit)."""
    prompt, params, words, field, code = REFUSED[case]
    llm = make()
    pending = llm.engine.add([9, 8, 7], GREEDY, seed=0)
    llm.engine.step()  # the pending request holds blocks now
    before = state(llm)
    with pytest.raises(RequestRefused, match="prompt 1: .*" + words) as refused:
        llm.generate([GOOD, prompt], [GREEDY, params], use_tqdm=False)
    assert (refused.value.field, refused.value.code) == (field, code)
    with pytest.raises(RequestRefused, match=words) as refused:
        llm.add_request(prompt, params)
    assert (refused.value.field, refused.value.code) == (field, code)
    assert state(llm) == before
    out = llm.generate([GOOD], GREEDY, use_tqdm=False)[0]
    while llm.engine.has_unfinished():
        llm.engine.step()
    folder = checkpoint("qwen3")
    assert out.token_ids == hf_greedy(folder, [GOOD], [8])[0]
    assert pending.seq.completion_token_ids == hf_greedy(folder, [[9, 8, 7]], [8])[0]
    assert llm.engine.stats.compared_steps == llm.engine.stats.steps


@pytest.mark.clause("ENG-13")
def test_admission_rule_is_exact() -> None:
    """ENG-13: a request fits when ceil((len(prompt) + max_tokens - 1) / block_size) <= num_blocks."""
    llm = make(num_kvcache_blocks=4)  # 16 slots
    ok = llm.generate([[1] * 9], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert len(ok.token_ids) == 8
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        llm.generate([[1] * 10], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)


@pytest.mark.clause("ENG-10")
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"seed": 1.0}, "seed"),
        ({"stop_token_ids": (4, -1)}, "stop_token_ids"),
        ({"stop_token_ids": (4, 2.0)}, "stop_token_ids"),
        ({"stop_token_ids": (True,)}, "stop_token_ids"),
        ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_bad_sampling_params_are_refused_where_made(kwargs: dict[str, Any], field: str) -> None:
    """ENG-10, ARCH-6: SamplingParams refuses bad values when made, with a RequestRefused naming the field (in its
    message and as ``field``), so no bad request reaches add()."""
    with pytest.raises(RequestRefused, match=field) as refused:
        SamplingParams(**kwargs)
    assert refused.value.field == field and refused.value.code is None


@pytest.mark.clause("ENG-10", "ARCH-6")
def test_the_bounds_themselves_are_taken_and_top_k_zero_is_off() -> None:
    """ENG-10: temperature 0 and 2, top_p 1 and at most 4 stop strings are taken; top_k 0 means off, stored as -1,
    and draws what top_k -1 draws."""
    for temperature in (0.0, 2.0):
        assert SamplingParams(temperature=temperature).temperature == temperature
    assert SamplingParams(stop=("a", "b", "c", "d")).stop == ("a", "b", "c", "d")
    assert SamplingParams(top_k=0).top_k == -1 and SamplingParams(top_k=0) == SamplingParams(top_k=-1)
    llm = make()
    drawn = [llm.generate([GOOD], SamplingParams(temperature=1.0, max_tokens=6, seed=3, top_k=k),
                          use_tqdm=False)[0].token_ids for k in (0, -1)]
    assert drawn[0] == drawn[1]


@pytest.mark.clause("ENG-10", "ENG-15")
def test_last_vocabulary_id_is_a_valid_stop() -> None:
    """ENG-10, ENG-15: the bound on stop_token_ids is the vocabulary itself: the last id is accepted, and a stop
    set made of it and of an id greedy decoding draws ends the request there."""
    llm = make()
    plain = llm.generate([GOOD], GREEDY, use_tqdm=False)[0].token_ids
    stop = plain[2]
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(VOCAB - 1, stop))
    out = llm.generate([GOOD], params, use_tqdm=False)[0]
    first = min(i for i, t in enumerate(plain) if t in params.stop_token_ids)
    assert out.token_ids == plain[: first + 1] and out.finish_reason == "stop"


@pytest.mark.clause("ENG-14")
def test_text_prompt_without_tokenizer_and_bad_params_type() -> None:
    """ENG-14: a checkpoint without tokenizer files serves token-id prompts; a text prompt is refused clearly."""
    llm = make()
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([GOOD, GOOD], [GREEDY], use_tqdm=False)
    assert llm.generate([GOOD], GREEDY, use_tqdm=False)[0].finish_reason == "length"


@pytest.mark.clause("ENG-17")
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"kvcache_block_size": 1}, "kvcache_block_size"),
        ({"num_kvcache_blocks": 0}, "num_kvcache_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_model_len": 10_000}, "max_model_len"),
        ({"attention_backend": "nope"}, "attention_backend"),
        ({"check": "yes"}, "check"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_bad_engine_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    """ENG-17: a bad LLM argument is a ValueError naming it."""
    with pytest.raises(ValueError, match=field):
        make(**kwargs)


@pytest.mark.clause("ENG-17")
def test_bad_model_folder() -> None:
    """ENG-17: a model that is not a checkpoint folder is a ValueError naming it."""
    with pytest.raises(ValueError, match="model"):
        LLM("/nonexistent/checkpoint")


@pytest.mark.clause("ENG-10")
@pytest.mark.parametrize(("bad", "shown"), [(1.0, "1.0 (float)"), (True, "True (bool)"), ([3], "[3] (list)"),
                                           (np.float64(2.0), "np.float64(2.0) (float64)"), ("7", "'7' (str)")])
@pytest.mark.parametrize("api", ["generate", "add_request"])
def test_a_token_id_of_the_wrong_type_says_it_must_be_an_int(bad: object, shown: str, api: str) -> None:
    """ENG-10: a prompt token id that is no integer is refused as such (not as out of range), naming the value and
    its type, and the call changes nothing."""
    llm = make()
    before = state(llm)
    prompt = [5, bad, 7]
    with pytest.raises(ValueError, match="prompt token ids must be ints, got " + re.escape(shown)):
        if api == "generate":
            llm.generate([GOOD, prompt], GREEDY, use_tqdm=False)  # type: ignore[arg-type]
        else:
            llm.add_request(prompt, GREEDY)  # type: ignore[arg-type]
    assert state(llm) == before and llm.engine._arrivals == 0


@pytest.mark.clause("ENG-10")
def test_numpy_integer_token_ids_are_accepted_as_plain_ints() -> None:
    """ENG-10: numpy integer scalars (prompt ids and stop ids) are accepted, stored as plain ints, and generate
    exactly what the same ints do."""
    llm = make()
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(np.int64(VOCAB - 1),))  # type: ignore[arg-type]
    assert params.stop_token_ids == (VOCAB - 1,) and type(params.stop_token_ids[0]) is int
    out = llm.generate([[np.int64(t) for t in GOOD]], params, use_tqdm=False)[0]  # type: ignore[arg-type]
    assert all(type(t) is int for t in out.prompt_token_ids) and out.prompt_token_ids == GOOD
    assert out.token_ids == hf_greedy(checkpoint("qwen3"), [GOOD], [8])[0]
    rid = llm.add_request([np.uint8(t) for t in GOOD], GREEDY)  # type: ignore[misc]
    assert all(type(t) is int for t in llm.engine.by_arrival[rid].seq.token_ids)


@pytest.mark.clause("ENG-10")
@pytest.mark.parametrize(("params", "shown"), [([None], "NoneType"), ([{}], "dict"), ([GREEDY, None], "NoneType")])
def test_sampling_params_list_elements_must_be_sampling_params(params: list[Any], shown: str) -> None:
    """ENG-10: in a list of sampling params each element must be a SamplingParams (None only as the whole
    argument); the error names the index, and nothing is added."""
    llm = make()
    before = state(llm)
    index = len(params) - 1
    with pytest.raises(RequestRefused, match=rf"sampling_params\[{index}\] must be a SamplingParams, got {shown}") as e:
        llm.generate([GOOD] * len(params), params, use_tqdm=False)
    assert e.value.field == "sampling_params" and e.value.code is None
    assert state(llm) == before and llm.engine._arrivals == 0


@pytest.mark.clause("ENG-10", "ARCH-6")
def test_generate_and_add_request_refuse_a_wrong_sampling_params_alike() -> None:
    """ENG-10, ARCH-6: a sampling_params that is no SamplingParams is a RequestRefused naming ``sampling_params``
    from generate (the whole argument, an element, a count that does not match) as from add_request."""
    llm = make()
    for bad in ({"max_tokens": 4}, [GREEDY, GREEDY]):
        with pytest.raises(RequestRefused, match="sampling_params") as refused:
            llm.generate([GOOD], bad, use_tqdm=False)  # type: ignore[arg-type]
        assert refused.value.field == "sampling_params"
    with pytest.raises(RequestRefused, match="sampling_params") as refused:
        llm.add_request(GOOD, {"max_tokens": 4})  # type: ignore[arg-type]
    assert refused.value.field == "sampling_params"
    assert not llm.has_unfinished_requests()


@pytest.mark.clause("ENG-10")
def test_numpy_numbers_are_taken_as_the_plain_ones() -> None:
    """ENG-10: numpy integers are taken wherever an integer is (max_tokens, top_k, seed, as token ids were) and numpy
    floats wherever a number is (temperature, top_p), stored as plain ints and floats; a numpy bool is no number,
    and a non-integral float is no integer."""
    params = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(8), top_k=np.int32(3),  # type: ignore[arg-type]
                            top_p=np.float64(0.75), seed=np.uint16(7))  # type: ignore[arg-type]
    assert params == SamplingParams(temperature=0.5, max_tokens=8, top_k=3, top_p=0.75, seed=7)
    assert [type(v) for v in (params.temperature, params.max_tokens, params.top_k, params.top_p, params.seed)] == [
        float, int, int, float, int]
    out = make().generate([GOOD], SamplingParams(temperature=np.float32(0), max_tokens=np.int64(4)),  # type: ignore[arg-type]
                          use_tqdm=False)[0]
    assert len(out.token_ids) == 4
    for field, value in (("max_tokens", np.True_), ("top_k", np.float64(2.0)), ("seed", np.float32(1)),
                         ("temperature", np.True_), ("max_tokens", np.int64(0))):
        kwargs: dict[str, Any] = {field: value}
        with pytest.raises(RequestRefused, match=field) as refused:
            SamplingParams(**kwargs)
        assert refused.value.field == field


def word_level_tokenizer(folder: Path) -> Path:
    """A folder holding a whitespace word-level tokenizer.json over a few words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.clause("ENG-10")
def test_a_prompt_with_a_lone_surrogate_is_a_value_error_naming_the_prompt(tmp_path: Path) -> None:
    """ENG-10: a text prompt that is not valid Unicode is a ValueError naming the prompt's index (not a TypeError
    from inside the tokenizer), and nothing is added."""
    llm = make()
    llm.tokenizer = load_tokenizer(word_level_tokenizer(tmp_path))
    assert len(llm.generate(["a b"], GREEDY, use_tqdm=False)[0].prompt_token_ids) == 2
    before = state(llm)
    with pytest.raises(ValueError, match=r"prompt 1: prompt text is not valid Unicode.*index 2"):
        llm.generate(["a b", "a \ud800 b"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.add_request("\udfff", GREEDY)
    assert state(llm) == before


@pytest.mark.clause("ENG-10")
def test_an_empty_model_path_is_refused() -> None:
    """ENG-10: model='' is refused naming `model`, not read as the current directory."""
    with pytest.raises(ValueError, match=r"model must be .* got an empty string"):
        LLM("")
