"""A damaged or hostile checkpoint folder is refused with one ValueError naming the file, the field or the tensor,
quickly and before anything large is allocated; a folder that is refused by nothing serves (spec/checkpoints.md).

Every case damages a private copy of the tiny Qwen3 checkpoint (tests/engine_fixtures.py) to which a tiny
byte-level tokenizer.json is added, then builds an ``LLM`` on it under an alarm, so that a hang or a giant
allocation fails the test instead of stalling the suite. The hypothesis tests damage the same folder at random:
bytes flipped or cut, values of config.json, of the safetensors header or of tokenizer.json replaced.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from optimized import LLM
from optimized.models import CausalLM, load_config
from optimized.models import loader as loader_module
from optimized.models.loader import load_model
from tests.engine_fixtures import FAMILIES, checkpoint

K_PROJ = "model.layers.1.self_attn.k_proj.weight"
SECONDS = 20  # far above any case's time (milliseconds), far below the old code's 170 s of growing memory


pytestmark = pytest.mark.usefixtures("engine_env")


def write_tokenizer(path: Path) -> None:
    """A byte-level tokenizer over the checkpoint's 256 ids (one id per byte, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The valid folder every case starts from: the tiny Qwen3 checkpoint plus tokenizer.json."""
    folder = tmp_path_factory.mktemp("source") / "qwen3"
    shutil.copytree(checkpoint("qwen3"), folder)
    write_tokenizer(folder / "tokenizer.json")
    return folder


def fresh(source: Path, parent: Path) -> Path:
    folder = parent / "ckpt"
    shutil.copytree(source, folder)
    return folder


@contextmanager
def within(seconds: int) -> Iterator[None]:
    """Raise TimeoutError in the block after ``seconds`` (a hang or a giant allocation fails, not stalls)."""

    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def build(folder: Path, dtype: str = "float64") -> LLM:
    with within(SECONDS):
        return LLM(str(folder), dtype=dtype, device="cpu", kvcache_block_size=4, num_kvcache_blocks=32)


def refused(folder: Path, *fragments: str) -> None:
    """Building on ``folder`` is a ValueError whose message holds every fragment."""
    with pytest.raises(ValueError) as info:
        build(folder)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def edit_tensor(folder: Path, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(path), metadata={"format": "pt"})


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.clause("CKPT-7")
def test_the_source_folder_serves_text(source: Path, tmp_path: Path) -> None:
    """CKPT-7: the undamaged folder loads, tokenizer included, so every refusal below comes from its damage."""
    llm = build(fresh(source, tmp_path))
    assert llm.tokenizer.decode(llm.tokenizer.encode("héllo")) == "héllo"


@pytest.mark.clause("CKPT-6")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.int64, torch.uint8])
def test_non_floating_weights_are_refused_by_name(dtype: torch.dtype, source: Path, tmp_path: Path) -> None:
    """CKPT-6: an integer or bool weight is refused, naming the tensor and its file (not cast into zeros)."""
    folder = fresh(source, tmp_path)
    edit_tensor(folder, K_PROJ, lambda t: t.to(dtype))
    refused(folder, K_PROJ, str(folder / "model.safetensors"), "floating point")


@pytest.mark.clause("CKPT-6")
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_by_name(value: float, source: Path, tmp_path: Path) -> None:
    """CKPT-6: one NaN or infinite element anywhere in a weight is refused, naming the tensor."""
    folder = fresh(source, tmp_path)

    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[3, 5] = value
        return t

    edit_tensor(folder, K_PROJ, poison)
    refused(folder, K_PROJ, "non-finite")


@pytest.mark.clause("CKPT-6")
@pytest.mark.parametrize("index", [0, -1])
def test_the_finiteness_check_covers_every_chunk(
    index: int, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CKPT-6: the check runs over bounded chunks of each tensor; with chunks of 7 elements (not dividing the
    tensor's), a NaN in its first or its last element is still found, and the clean folder still loads."""
    monkeypatch.setattr(loader_module, "_FINITE_CHUNK", 7)
    folder = fresh(source, tmp_path)
    build(folder)

    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[index] = float("nan")
        return t

    edit_tensor(folder, K_PROJ, poison)
    refused(folder, K_PROJ, "non-finite")


@pytest.mark.clause("CKPT-6")
def test_a_weight_that_overflows_the_engine_dtype_is_refused(source: Path, tmp_path: Path) -> None:
    """CKPT-6: finiteness is checked in the engine's dtype: a float32 weight of 1e6 loads in float64 but would be
    infinite in float16, so there it is refused by name."""
    folder = fresh(source, tmp_path)
    edit_tensor(folder, K_PROJ, lambda t: t * 0 + 1e6)
    load_model(folder, torch.float64, torch.device("cpu"))
    with pytest.raises(ValueError, match=re.escape(K_PROJ) + ".*non-finite.*float16"):
        load_model(folder, torch.float16, torch.device("cpu"))


# case -> (file, eos_token_id)
BAD_EOS: dict[str, tuple[str, Any]] = {
    "the vocabulary size": ("config.json", 256),
    "far outside": ("config.json", 10**9),
    "negative": ("config.json", -1),
    "one of a list": ("config.json", [0, 256]),
    "in generation_config.json": ("generation_config.json", [300]),
}


@pytest.mark.clause("CKPT-4")
@pytest.mark.parametrize("case", sorted(BAD_EOS))
def test_eos_outside_the_vocabulary_is_refused(case: str, source: Path, tmp_path: Path) -> None:
    """CKPT-4: an eos id the model can never emit (>= vocab_size, or negative; alone or in a list; in config.json
    or generation_config.json) is refused, naming the field, the file and the vocabulary size."""
    file, eos = BAD_EOS[case]
    folder = fresh(source, tmp_path)
    edit_json(folder / file, eos_token_id=eos)
    refused(folder, file, "eos_token_id", "vocab_size=256")


@pytest.mark.clause("CKPT-4")
def test_eos_at_the_vocabulary_edge_is_served(source: Path, tmp_path: Path) -> None:
    """CKPT-4: the last id of the vocabulary, and id 0, are valid eos ids."""
    folder = fresh(source, tmp_path)
    edit_json(folder / "config.json", eos_token_id=[0, 255])
    assert build(folder).engine.runner.model.config.eos_token_ids == (0, 255)


@pytest.mark.clause("CKPT-5", "CKPT-3")
def test_more_layers_than_the_checkpoint_holds_is_refused_at_once(source: Path, tmp_path: Path) -> None:
    """CKPT-5, CKPT-3: num_hidden_layers beyond the checkpoint is refused from the headers, before the model is
    built: 10**6 (beyond the bound) and 3 (on 2 layers) alike, each in well under a second."""
    folder = fresh(source, tmp_path)
    for layers, fragment in ((10**6, "at most 1024"), (3, "holds 2 layers"), (1000, "holds 2 layers")):
        edit_json(folder / "config.json", num_hidden_layers=layers, layer_types=None)  # saved: one per layer
        start = time.monotonic()
        refused(folder, "num_hidden_layers", fragment)
        assert time.monotonic() - start < 2


HUGE_FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
]


@pytest.mark.clause("CKPT-3")
@pytest.mark.parametrize("field", HUGE_FIELDS)
def test_huge_sizes_are_refused_by_name_before_allocating(field: str, source: Path, tmp_path: Path) -> None:
    """CKPT-3: each size field is bounded, so no single field can ask for terabytes (the rotary table is sized by
    max_position_embeddings, the embedding by vocab_size x hidden_size)."""
    folder = fresh(source, tmp_path)
    edit_json(folder / "config.json", **{field: 2**40})
    refused(folder, field, "at most")


@pytest.mark.clause("CKPT-5")
def test_a_config_larger_than_the_machine_is_refused_by_name(source: Path, tmp_path: Path) -> None:
    """CKPT-5: sizes each within their bounds whose model needs more than the machine's physical memory are
    refused, naming the fields, before anything is allocated."""
    folder = fresh(source, tmp_path)
    big = {"hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1000, "vocab_size": 1 << 22}
    edit_json(folder / "config.json", **big, layer_types=None)
    refused(folder, "hidden_size=65536", "num_hidden_layers=1000", "more than this machine's")


@pytest.mark.clause("CKPT-5")
def test_the_memory_check_counts_the_weights(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CKPT-5: the tiny model's float64 weights (about 0.8 MB) fit in 2 MB and not in 0.5 MB: the estimate is
    the weights' real size, not a bound that refuses nothing."""
    folder = fresh(source, tmp_path)
    model = load_model(folder, torch.float64, torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 500_000 < weights < 1_000_000
    monkeypatch.setattr(loader_module, "_device_memory", lambda device: 2_000_000)
    build(folder)
    monkeypatch.setattr(loader_module, "_device_memory", lambda device: 500_000)
    refused(folder, "vocab_size=256", "more than this machine's 500000")


@pytest.mark.clause("CKPT-5")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True])
def test_required_tensors_are_the_models_parameters(family: str, tied: bool, tmp_path: Path) -> None:
    """CKPT-5: the tensors the header check requires (names and shapes, from the config alone) are exactly the
    model's parameters as the checkpoint names them, so the check refuses no servable checkpoint."""
    folder = tmp_path / family
    shutil.copytree(checkpoint(family), folder)
    edit_json(folder / "config.json", tie_word_embeddings=tied)
    config = load_config(folder)
    with torch.device("meta"):
        model = CausalLM(config)
    pieces = loader_module._expected_pieces(model)
    params = dict(model.named_parameters())
    shapes: dict[str, tuple[int, ...]] = {}
    for (pname, rows), name in pieces.items():
        shape = tuple(params[pname].shape)
        shapes[name] = shape if rows is None else (rows[1] - rows[0], *shape[1:])
    assert loader_module.required_tensors(config) == shapes


def _write(name: str, data: bytes) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).write_bytes(data)

    return damage


def _config_text(text: str) -> Callable[[Path], None]:
    return _write("config.json", text.encode())


def _config_field(key: str, raw: str) -> Callable[[Path], None]:
    """config.json with ``key`` set to the raw JSON text ``raw`` (which json.dumps could not write)."""

    def damage(folder: Path) -> None:
        text = json.dumps({**json.loads((folder / "config.json").read_text()), key: "@"})
        (folder / "config.json").write_text(text.replace('"@"', raw))

    return damage


def _directory(name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        path = folder / name
        if path.exists():
            path.unlink()
        path.mkdir()

    return damage


def _fifo(name: str) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / name).unlink()
        os.mkfifo(folder / name)

    return damage


def _truncated(name: str, size: int) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        with (folder / name).open("r+b") as f:
            f.truncate(size if size >= 0 else f.seek(0, 2) // 2)

    return damage


def _header(edit: Callable[[dict[str, Any]], Any], length: int | None = None) -> Callable[[Path], None]:
    """model.safetensors with its JSON header edited (and its length field set to ``length`` when given)."""

    def damage(folder: Path) -> None:
        data = (folder / "model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.dumps(edit(json.loads(data[8 : 8 + n]))).encode()
        prefix = struct.pack("<Q", len(header) if length is None else length)
        (folder / "model.safetensors").write_bytes(prefix + header + data[8 + n :])

    return damage


def _entry(field: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(header: dict[str, Any]) -> dict[str, Any]:
        header[K_PROJ][field] = value
        return header

    return edit


def _without_tokenizer_json(then: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        (folder / "tokenizer.json").unlink()
        then(folder)

    return damage


# case -> (damage, the file (and field) the message must name)
DAMAGED: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "config: invalid JSON": (_config_text('{"model_type": "qwen3",'), ("config.json", "not valid JSON")),
    "config: an array": (_config_text("[1, 2]"), ("config.json", "object")),
    "config: null": (_config_text("null"), ("config.json", "object")),
    "config: not UTF-8": (_write("config.json", b'{"model_type": "qwen3\xff"}'), ("config.json",)),
    "config: nested 100000 deep": (_config_text("[" * 100_000), ("config.json",)),
    "config: NaN": (_config_field("rms_norm_eps", "NaN"), ("config.json",)),
    "config: Infinity": (_config_field("rope_theta", "Infinity"), ("config.json",)),
    "config: 1e400 (infinite)": (_config_field("rms_norm_eps", "1e400"), ("config.json", "rms_norm_eps")),
    "config: 5000 digits": (_config_field("vocab_size", "9" * 5000), ("config.json",)),
    "config: a string size": (_config_field("hidden_size", '"64"'), ("config.json", "hidden_size")),
    "config: a float size": (_config_field("hidden_size", "64.0"), ("config.json", "hidden_size")),
    "config: a list size": (_config_field("num_attention_heads", "[4]"), ("config.json", "num_attention_heads")),
    "config: a string flag": (_config_field("tie_word_embeddings", '"no"'), ("config.json", "tie_word_embeddings")),
    "config: a list rope": (_config_field("rope_parameters", "[1]"), ("config.json", "rope_parameters")),
    "config: a directory": (_directory("config.json"), ("config.json",)),
    "config: a FIFO": (_fifo("config.json"), ("config.json",)),
    "config: 17 MiB": (_write("config.json", b" " * (17 << 20)), ("config.json", "larger than")),
    "generation_config: invalid JSON": (_write("generation_config.json", b"{"), ("generation_config.json",)),
    "generation_config: a directory": (_directory("generation_config.json"), ("generation_config.json",)),
    "tokenizer.json: garbage": (_write("tokenizer.json", b"\x00\x01garbage"), ("tokenizer.json",)),
    "tokenizer.json: an empty object": (_write("tokenizer.json", b"{}"), ("tokenizer.json",)),
    "tokenizer.json: truncated": (_truncated("tokenizer.json", -1), ("tokenizer.json",)),
    "tokenizer.json: a directory": (_directory("tokenizer.json"), ("tokenizer.json",)),
    "tokenizer_config.json: garbage": (
        _without_tokenizer_json(_write("tokenizer_config.json", b"{not json")),
        ("tokenizer_config.json",),
    ),
    "tokenizer_config.json: names no tokenizer": (
        _without_tokenizer_json(_write("tokenizer_config.json", b'{"tokenizer_class": "NoSuchTokenizer"}')),
        ("tokenizer_config.json",),
    ),
    "safetensors: 3 bytes": (_truncated("model.safetensors", 3), ("model.safetensors",)),
    "safetensors: half": (_truncated("model.safetensors", -1), ("model.safetensors",)),
    "safetensors: header length 2^63": (_header(lambda h: h, 1 << 63), ("model.safetensors", "header length")),
    "safetensors: header longer than the file": (_header(lambda h: h, 1 << 20), ("model.safetensors",)),
    "safetensors: header not JSON": (_header(lambda h: "@", None), ("model.safetensors",)),
    "safetensors: header an array": (_header(lambda h: [h], None), ("model.safetensors", "object")),
    "safetensors: unknown dtype": (_header(_entry("dtype", "F128")), ("model.safetensors", K_PROJ)),
    "safetensors: negative shape": (_header(_entry("shape", [-1, 64])), ("model.safetensors", K_PROJ)),
    "safetensors: huge shape": (_header(_entry("shape", [1 << 40, 1 << 40])), ("model.safetensors", K_PROJ)),
    "safetensors: offsets past the end": (
        _header(_entry("data_offsets", [0, 1 << 40])),
        ("model.safetensors", K_PROJ),
    ),
    "safetensors: a directory": (_directory("model.safetensors"), ("model.safetensors",)),
    "safetensors: a FIFO": (_fifo("model.safetensors"), ("model.safetensors",)),
}


@pytest.mark.clause("CKPT-3")
@pytest.mark.parametrize(("field", "raw"), [("hidden_size", "9" * 4000), ("model_type", '"' + "x" * 10**6 + '"')])
def test_a_huge_value_makes_a_short_refusal(field: str, raw: str, source: Path, tmp_path: Path) -> None:
    """CKPT-3: a refusal quotes a huge value shortened (a 4000-digit size, a megabyte string), not in full."""
    folder = fresh(source, tmp_path)
    _config_field(field, raw)(folder)
    with pytest.raises(ValueError, match=field) as info:
        build(folder)
    assert len(str(info.value)) < 300


@pytest.mark.clause("CKPT-1", "CKPT-3", "CKPT-2")
@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_file_is_one_value_error_naming_it(case: str, source: Path, tmp_path: Path) -> None:
    """CKPT-1, CKPT-3, CKPT-2: a damaged config.json, generation_config.json, tokenizer file or safetensors file
    (invalid, not an object, wrong types, huge or non-finite numbers, truncated, a garbage or huge header, a
    directory or a FIFO in its place) is one ValueError naming the file, never a library error, an OSError, a
    hang or a giant allocation."""
    damage, fragments = DAMAGED[case]
    folder = fresh(source, tmp_path)
    damage(folder)
    refused(folder, *fragments)


# --- hypothesis: random damage -----------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 1, 255, 256, 2**31, 2**63, 10**12])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=6,
)
FILES = ["config.json", "generation_config.json", "tokenizer.json", "model.safetensors"]


def loads_or_is_refused(folder: Path) -> None:
    """Build on ``folder`` (and use its tokenizer): anything raised but a ValueError, or a build slower than
    SECONDS, fails the test. Hypothesis' statistics count the two outcomes."""
    try:
        llm = build(folder)
    except ValueError:
        event("refused")
        return
    llm.tokenizer.decode(llm.tokenizer.encode("héllo wörld"))
    event("loaded")


@contextmanager
def damaged_copy(source: Path) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as parent:
        yield fresh(source, Path(parent))


def _set_path(value: Any, path: list[Any], new: Any) -> None:
    """``value`` with the element at ``path`` (keys/indices into nested objects and arrays) replaced by ``new``."""
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place inside a JSON value, depth first."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _json_file(folder: Path, name: str) -> tuple[Path, bytes, Any, int]:
    """(path, prefix bytes, the JSON, bytes after it): safetensors' header, or a whole JSON file."""
    path = folder / name
    data = path.read_bytes()
    if name != "model.safetensors":
        return path, b"", json.loads(data), len(data)
    (n,) = struct.unpack("<Q", data[:8])
    return path, data[:8], json.loads(data[8 : 8 + n]), 8 + n


@pytest.mark.clause("CKPT-7")
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(file=st.sampled_from(FILES), data=st.data())
def test_replaced_json_values_load_or_are_refused(file: str, data: st.DataObject, source: Path) -> None:
    """CKPT-7: any value anywhere in config.json, generation_config.json, tokenizer.json or the safetensors header
    replaced by any JSON value (huge, negative, NaN, a string, a list...): the folder loads or is a ValueError."""
    with damaged_copy(source) as folder:
        path, prefix, value, end = _json_file(folder, file)
        places = list(_paths(value))
        place = data.draw(st.sampled_from(places), label="place")
        _set_path(value, list(place), data.draw(JSON_VALUES, label="new value"))
        text = json.dumps(value).encode()
        if prefix:  # keep the safetensors length field true, so the damage reaches the entries
            prefix = struct.pack("<Q", len(text))
        path.write_bytes(prefix + text + path.read_bytes()[end:])
        loads_or_is_refused(folder)


@pytest.mark.clause("CKPT-7")
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(file=st.sampled_from(FILES), data=st.data())
def test_flipped_or_cut_bytes_load_or_are_refused(file: str, data: st.DataObject, source: Path) -> None:
    """CKPT-7: bytes overwritten (in the safetensors file mostly in its length field and header) or the file cut
    anywhere: the folder loads or is a ValueError."""
    with damaged_copy(source) as folder:
        path = folder / file
        raw = bytearray(path.read_bytes())
        head = 8 + struct.unpack("<Q", raw[:8])[0] if file == "model.safetensors" else len(raw)
        where = st.integers(0, head - 1) | st.integers(0, len(raw) - 1)
        for at, byte in data.draw(st.lists(st.tuples(where, st.integers(0, 255)), max_size=6), label="writes"):
            raw[at] = byte
        cut = data.draw(st.none() | st.integers(0, len(raw)), label="cut at")
        path.write_bytes(bytes(raw[:cut]))
        loads_or_is_refused(folder)


@pytest.mark.clause("CKPT-7")
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(length=st.integers(0, 2**64 - 1) | st.integers(0, 5000))
def test_any_safetensors_length_field_loads_or_is_refused(length: int, source: Path) -> None:
    """CKPT-7: whatever the 8-byte header length says (0, beyond the file, 2^64 - 1), a ValueError or a load."""
    with damaged_copy(source) as folder:
        path = folder / "model.safetensors"
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", length) + raw[8:])
        loads_or_is_refused(folder)
