"""The documentation: the README stays a front door (at most 300 lines, a table of contents, links that resolve), and
the docs site under docs/ builds with ``mkdocs build --strict`` (a broken link, a missing page or an anchor that no
heading makes fails it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    contents = text[text.index("## Contents") :].split("\n## ", 1)[0]
    headings = re.findall(r"^## (.+)$", text, re.M)
    listed = re.findall(r"^- \[(.+?)\]\(#([^)]+)\)$", contents, re.M)
    assert [title for title, _ in listed] == [h for h in headings if h != "Contents"]
    for title, anchor in listed:  # GitHub's anchors: lower case, spaces to '-', punctuation dropped
        assert anchor == re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-"), (title, anchor)
    for make in ("make train", "make test ", "make test-fast"):
        assert make in text, make


def test_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), target


@pytest.mark.e2e  # mkdocs in a fresh interpreter (tests/README.md: a new interpreter is not the fast stage)
def test_docs_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "your-model" / "index.html").is_file()
