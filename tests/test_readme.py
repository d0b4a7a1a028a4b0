"""The README is a front page: short, every link resolves, and each fact it states is the one on the page it comes
from (docs/timings.md for the two commands' times, docs/results.md for the verdict, the table and the speeds)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def _flat(text: str) -> str:
    """Markdown prose with its line breaks folded, so a sentence wrapped differently on two pages still matches."""
    return re.sub(r"\s+", " ", text.replace("**", ""))


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def test_the_readme_is_a_front_page():
    lines = README.splitlines()
    assert len(lines) <= 160, f"README.md is {len(lines)} lines; a front page is about 150 (details go to docs/)"
    assert "../shared" not in README and "arxiv.org/abs/2607.17572" in README
    assert "make run" in _section("Two commands") and "make test" in _section("Two commands")


@pytest.mark.parametrize("link", sorted(set(re.findall(r"\]\(([^)\s]+)\)", README))))
def test_every_link_of_the_readme_resolves(link):
    if link.startswith(("http://", "https://")):
        assert link.startswith("https://arxiv.org/") or link.startswith("https://github.com/"), link
        return
    path, _, anchor = link.partition("#")
    target = REPO / path
    assert target.exists(), f"README links to {link}, which does not exist"
    if anchor:  # a markdown heading's GitHub anchor
        heads = re.findall(r"^#+ (.*)$", target.read_text(encoding="utf-8"), re.M)
        slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in heads}
        assert anchor in slugs, f"{link}: no heading with that anchor"


def test_the_two_commands_times_are_the_timings_pages():
    timings = _flat((REPO / "docs/timings.md").read_text(encoding="utf-8"))
    block = _section("Two commands")
    times = re.findall(r"\((\d+–\d+ min on 2 cores with set-up)\)", block)
    assert len(times) == 2, block
    for t in times:
        assert t in timings, f"README says {t!r}; docs/timings.md does not"


def test_the_verdict_the_table_and_the_speeds_are_the_results_pages():
    results = _flat((REPO / "docs/results.md").read_text(encoding="utf-8"))
    block = _section("The result, on the embedded default")
    verdict = re.search(r"\*\*(JAGG is non-inferior.*?)\*\*", block, re.S)
    assert verdict and _flat(verdict.group(1)) in results, "the README's verdict is not docs/results.md's"
    rows = [r for r in block.splitlines() if r.startswith("| ") and not r.startswith("| method")]
    figures = [x for r in rows for x in re.findall(r"\[[+-]\d\.\d{4}, [+-]\d\.\d{4}\]|[+-]\d\.\d{4}|\d\.\d\d×", r)]
    assert len(figures) >= 16, figures
    for x in figures:
        assert x in results, f"the README's table says {x}; docs/results.md does not"
    for x in re.findall(r"(\d\.\d\d)× faster", block):
        assert f"| {x}× |" in results, f"the README's speedup {x}× is not docs/results.md's side-by-side table's"
