"""spec/ as a site (ARCH-8): `mkdocs build --strict` passes on the book as committed and fails on a broken link,
a missing figure or a page left out of the navigation; one page renders in headless Chromium with its figures
drawn. Also: the pages a newcomer's questions lead to, and the statements of one chapter that another states."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from optimized.trace.schema import VERSION

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "spec"
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def build(site: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` as a user runs it, from the venv's interpreter."""
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: install the docs extra (pip install -e '.[docs]'; scripts/setup.sh does)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.clause("ARCH-8")
def test_the_site_builds_strict(tmp_path: Path) -> None:
    """ARCH-8: the committed book builds with --strict; pages, figures and linked repository files are in it."""
    done = build(tmp_path / "site")
    assert done.returncode == 0, done.stderr
    site = tmp_path / "site"
    for page in ("index.html", "primer.html", "questions.html", "project.html", "figures/worked-example.png",
                 "figures/schedule-flowchart.png", "_source/reference/scheduler.py"):
        assert (site / page).is_file(), page
    assert 'href="_source/reference/scheduler.py"' in (site / "scheduler.html").read_text(encoding="utf-8")


@pytest.mark.clause("ARCH-8")
def test_a_broken_book_fails_the_build(tmp_path: Path) -> None:
    """ARCH-8: a copy of spec/ with a link to a missing page, a missing anchor, a missing figure, a link to a
    repository file that does not exist and a page left out of the navigation: the strict build fails, naming
    each."""
    book = tmp_path / "spec"
    shutil.copytree(SPEC, book)
    primer = book / "primer.md"
    primer.write_text(primer.read_text(encoding="utf-8") + "\n[gone](no-such-page.md) [gone too](scheduler.md#no-such"
                      "-heading) [code](../reference/no_such.py)\n", encoding="utf-8")
    (book / "figures" / "preemption.png").unlink()
    (book / "orphan.md").write_text("# An orphan\n", encoding="utf-8")
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    config = config.replace("docs_dir: spec", f"docs_dir: {book}").replace(
        "  - scripts/mkdocs_hooks.py", f"  - {ROOT / 'scripts' / 'mkdocs_hooks.py'}")
    (tmp_path / "mkdocs.yml").write_text(config, encoding="utf-8")
    done = build(tmp_path / "site", tmp_path / "mkdocs.yml")
    assert done.returncode != 0
    for named in ("no-such-page.md", "no-such-heading", "figures/preemption.png", "reference/no_such.py",
                  "orphan.md"):
        assert named in done.stderr, named


def _orange_pixels(path: Path) -> int:
    """Pixels of the timeline's prefill colour (#e06c00), which only a drawn figure holds on the page."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        rgb = np.asarray(image.convert("RGB"), dtype=np.int32)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return int(((abs(r - 0xE0) < 12) & (abs(g - 0x6C) < 12) & (b < 20)).sum())


@pytest.mark.clause("ARCH-8")
def test_a_page_renders_with_its_figures_in_chromium(tmp_path: Path) -> None:
    """ARCH-8: scripts/docs_screenshot.sh renders the primer in headless Chromium; the screenshot holds the
    timeline's prefill cells, so the figures were drawn (an image that failed to load leaves none)."""
    if not any(shutil.which(b) for b in ("chromium-headless-shell", "chromium", "chromium-browser")):
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium-headless-shell)")
    shot = tmp_path / "primer.png"
    env = {**ENV, "PYTHON": sys.executable}  # the suite's interpreter builds the site, wherever its virtualenv is
    done = subprocess.run(["bash", "scripts/docs_screenshot.sh", "primer.html", str(shot)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _orange_pixels(shot) > 500
    glossary = tmp_path / "glossary.png"  # a page without figures: the colour is the figures', not the theme's
    subprocess.run(["bash", "scripts/docs_screenshot.sh", "glossary.html", str(glossary)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=300)
    assert _orange_pixels(glossary) == 0


QUESTIONS = {
    "Why is only the first sequence of a batch chunked?": "scheduler.md",
    "What happens to a preempted sequence's blocks?": "questions.md",
    "When is a prefix-cache hit refused?": "questions.md",
    "What does check mode compare at each step?": "questions.md",
    "How do I serve a checkpoint to the `openai` client?": "",
}


@pytest.mark.clause("ASK-1")
def test_the_newcomers_questions_are_one_hop_from_the_readme() -> None:
    """ASK-1: spec/README.md's questions table sends each of the five questions to one page (or answers it in
    place) whose heading the link names."""
    readme = (SPEC / "README.md").read_text(encoding="utf-8")
    for question, page in QUESTIONS.items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| {question} |"))
        target = re.search(r"\]\(([^)]+)\)", row.split("|")[2])
        assert target is not None, question
        linked_page, _, anchor = target.group(1).partition("#")
        assert linked_page == page or (page == "" and not linked_page.endswith(".md")), question
        text = (SPEC / (linked_page or "README.md")).read_text(encoding="utf-8")
        slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                 for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
        assert anchor in slugs, (question, anchor)


@pytest.mark.clause("TRACE-1")
def test_conformance_states_the_trace_version_the_recorder_writes() -> None:
    """TRACE-1: conformance.md's trace header names the version the recorder writes (it said 1 after TRACE-1
    moved to 2)."""
    text = (SPEC / "conformance.md").read_text(encoding="utf-8")
    assert f'{{"version": {VERSION}, "config": {{...}}}}' in text
    assert re.findall(r'"version": (\d+)', text) == [str(VERSION)]


def _blocks(language: str) -> list[str]:
    """The fenced code blocks of spec/README.md in ``language``, in order."""
    text = (SPEC / "README.md").read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)


@pytest.mark.clause("ASK-2")
def test_the_readme_quickstarts_run_as_written(tmp_path: Path) -> None:
    """ASK-2: the Python API quickstart runs; `nanoverify serve --model ./FOLDER` started as written (on a free
    port, the folder a copy of the default checkpoint under the quickstart's name) answers the openai client
    quickstart, chat and streamed completion, with the folder's name as the model."""
    from optimized.models.default_model import default_model_dir

    api, client = _blocks("python")[:2]
    done = subprocess.run([sys.executable, "-c", api], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    printed = done.stdout.splitlines()
    assert len(printed) == 2 and all(line.startswith(("length ", "stop ")) for line in printed)

    command = next(line for block in _blocks("sh") for line in block.splitlines() if "nanoverify serve" in line)
    args = command.split("#", 1)[0].split()
    folder = args[args.index("--model") + 1]
    shutil.copytree(default_model_dir(), tmp_path / folder)
    args[args.index("--port") + 1] = "0"
    nanoverify = str(Path(sys.executable).parent / "nanoverify")
    server = subprocess.Popen([nanoverify, *args[1:]], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    deadline = threading.Timer(240, server.kill)  # a server that never says where it listens fails, not hangs
    deadline.start()
    try:
        assert server.stdout is not None
        said: list[str] = []
        while not said or "listening on" not in said[-1]:
            said.append(server.stdout.readline())
            assert said[-1], "nanoverify serve ended (or was killed at 240 s) before listening:\n" + "".join(said)
        port = said[-1].strip().rsplit(":", 1)[1]
        ran = subprocess.run([sys.executable, "-c", client.replace(":8000/", f":{port}/")], cwd=tmp_path, env=ENV,
                             capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
        assert Path(folder).name in client and ran.stdout.strip()
    finally:
        deadline.cancel()
        server.terminate()
        server.wait(timeout=60)
