"""What the README and docs/ point a user at exists in a clone of the repository: every link
and every path into the repository's own folders."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("benchmarks/", "docs/", "recipes/", "llmaccel/", "tests/", ".ci/")
LINK = re.compile(r"\]\(([^)#\s]+)")
PATH = re.compile(r"(?<![\w./-])((?:%s)[\w./*<>{}-]*[\w*])" % "|".join(map(re.escape, TOP)))


def _targets(doc: Path) -> set[str]:
    text = doc.read_text(encoding="utf-8")
    links = {t for t in LINK.findall(text) if "://" not in t and not t.startswith("mailto:")}
    return links | set(PATH.findall(text))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists_in_a_clone(doc):
    missing = []
    for target in sorted(_targets(doc)):
        if any(c in target for c in "<>{}"):  # a pattern (runs/<recipe>/...), not a file
            continue
        base = doc.parent if target.startswith(("./", "../")) else REPO
        if "*" in target:
            if not list(base.glob(target)):
                missing.append(target)
        elif not (base / target).exists():
            missing.append(target)
    assert not missing, f"{doc.name} names files a clone does not have: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_do_not_send_users_outside_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    assert "BENCHMARKS.md" not in text and "](../shared" not in text
