"""No page of the docs names a commit: a commit hash names a past state, and its history belongs with git. It asks git
itself (a `git cat-file` process). The rest of the docs' checks: tests/unit/test_docs.py."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.unit.test_docs import ROOT, pages


def test_no_commit_hashes():
    """A commit hash names a past state; the history it belongs with is git's. Only hex words that git
    resolves to a commit count, so a hex-looking number is not a false alarm."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    words = {
        (page.relative_to(ROOT).as_posix(), word) for page in pages() for word in re.findall(r"\b[0-9a-fA-F]{7,40}\b", page.read_text())
    }
    if not words:
        return
    ordered = sorted(words)
    # One process for all of them: cat-file prints "missing" (or "ambiguous") for a word that is no commit.
    out = subprocess.run(
        ["git", "cat-file", "--batch-check=%(objecttype)"],
        input="".join(f"{word}^{{commit}}\n" for _, word in ordered),
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.splitlines()
    assert len(out) == len(ordered)
    hashes = [f"{page}: {word}" for (page, word), kind in zip(ordered, out, strict=True) if kind == "commit"]
    assert not hashes, f"commit hashes in the docs (history belongs in git): {hashes}"
