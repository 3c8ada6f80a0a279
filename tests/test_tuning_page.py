"""spec/tuning.md names real things: every flag it tells a reader to turn is one `nanoverify serve` takes, and
every metric it tells them to watch is one the server's /metrics exposes (the page adds no clause; it must not
drift from the code it points to)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from optimized.cli.command import build_parser
from optimized.serve.metrics import PREFIX, Metrics

TUNING = (Path(__file__).resolve().parent.parent / "spec" / "tuning.md").read_text(encoding="utf-8")


def _serve_flags() -> set[str]:
    """The options of `nanoverify serve`, as its --help lists them."""
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", shown.getvalue()))


def _exposed_metrics() -> set[str]:
    text = generate_latest(Metrics().registry).decode()
    return {m[len(PREFIX):] for m in re.findall(r"^# TYPE (\S+)", text, flags=re.M)} | {
        m[len(PREFIX):] for m in re.findall(rf"^({re.escape(PREFIX)}\w+)", text, flags=re.M)}


def test_every_flag_the_tuning_page_names_is_a_serve_flag() -> None:
    """A renamed or removed flag fails here."""
    named = set(re.findall(r"`(--[a-z][a-z0-9-]*)", TUNING))
    assert len(named) >= 6
    assert named <= _serve_flags(), sorted(named - _serve_flags())


def test_every_metric_the_tuning_page_names_is_exposed() -> None:
    """A renamed or removed metric fails here."""
    named = set(re.findall(r"`([a-z_]+_(?:total|seconds|perc|waiting|running))`", TUNING))
    assert len(named) >= 8
    exposed = _exposed_metrics()
    assert named <= exposed, sorted(named - exposed)
