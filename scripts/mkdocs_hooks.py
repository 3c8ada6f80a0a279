"""MkDocs hooks for the spec site (mkdocs.yml): spec/ is the docs folder, and its chapters link into the
repository (``../reference/scheduler.py``) and the root README links into spec/.

Invariant: every link the site keeps resolves inside the site. A link from a chapter to a file of the repository
outside spec/ is served from ``_source/`` (the file copied as is); one to a folder becomes the folder's name in
code, not a link; one to a path that does not exist is a warning, so ``mkdocs build --strict`` fails on it. The
root README is the page ``project.md``, its links rewritten the same way.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
log = logging.getLogger("mkdocs.plugins.nanoverify")


def _outside(target: str) -> str | None:
    """The repository path a chapter's ``../X`` link names, or None for any other link."""
    if not target.startswith("../"):
        return None
    return target[3:].split("#", 1)[0]


def _rewrite(markdown: str, page: str, to_repo: Any) -> str:
    """Each link that ``to_repo`` maps to a repository path: served from _source/, a folder as code, a missing path
    warned about."""

    def one(match: re.Match[str]) -> str:
        bang, text, target = match.groups()
        path = to_repo(target)
        if path is None:
            return match.group(0)
        if path == "" or not (ROOT / path).exists():
            log.warning("%s: a link to %r names no file or folder of the repository", page, target)
            return match.group(0)
        if path == "README.md":
            return f"{bang}[{text}](project.md)"
        if (ROOT / path).is_dir():
            return f"`{text.strip('`')}`" if not bang else match.group(0)
        anchor = target.split("#", 1)[1] if "#" in target else ""
        return f"{bang}[{text}](_source/{path}{'#' + anchor if anchor else ''})"

    return LINK.sub(one, markdown)


def _readme() -> str:
    """The root README with its links made site links: into spec/ a page link, anything else as a chapter's."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")

    def spec_link(match: re.Match[str]) -> str:
        bang, text_, target = match.groups()
        if target.startswith("spec/"):
            return f"{bang}[{text_}]({target[len('spec/'):] or 'README.md'})"
        if "://" in target or target.startswith("#"):
            return match.group(0)
        return f"{bang}[{text_}](../{target})"

    return _rewrite(LINK.sub(spec_link, text), "README.md (project.md)", _outside)


def on_files(files: Files, config: Any) -> Files:
    """Add project.md and every repository file a chapter or the README links to."""
    files.append(File.generated(config, "project.md", content=_readme()))
    wanted: set[str] = set()
    texts = [(Path(config["docs_dir"]) / f.src_uri).read_text(encoding="utf-8") for f in files
             if f.src_uri.endswith(".md") and f.src_uri != "project.md"]
    texts.append(_readme())
    for text in texts:
        for _, _, target in LINK.findall(text):
            path = _outside(target) if not target.startswith("_source/") else target[len("_source/"):].split("#")[0]
            if path and path != "README.md" and (ROOT / path).is_file():
                wanted.add(path)
    for path in sorted(wanted):
        files.append(File.generated(config, f"_source/{path}", abs_src_path=str(ROOT / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if page.file.src_uri == "project.md":
        return markdown
    return _rewrite(markdown, page.file.src_uri, _outside)
