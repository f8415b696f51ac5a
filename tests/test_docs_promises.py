"""docs/promises.md names, for each promise of the README and docs, the tests that back it. Every test it names must
exist (a test function of that name in that file), so the table cannot rot when a test is renamed or removed; and
every row must name a test or say that it has not run."""

import os
import re

from helpers import ROOT

PROMISES = os.path.join(ROOT, "docs", "promises.md")
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[[^\]]*\])?`")


def table_rows() -> list[str]:
    with open(PROMISES) as f:
        lines = f.read().splitlines()
    return [x for x in lines if x.startswith("| ") and not x.startswith("| promise |")]


def defined_tests(path: str) -> set[str]:
    with open(os.path.join(ROOT, path)) as f:
        return set(re.findall(r"^(?:async )?def (test\w*)\(", f.read(), re.M))


def test_every_test_the_promises_table_names_exists():
    refs = [m for row in table_rows() for m in REFERENCE.findall(row)]
    assert len(refs) >= 30, "docs/promises.md should name the tests behind its promises"
    missing = []
    for path, name in refs:
        if not os.path.isfile(os.path.join(ROOT, path)) or name not in defined_tests(path):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/promises.md names tests that do not exist: {missing}"


def test_every_promise_names_a_test():
    unbacked = [row.split("|")[1].strip() for row in table_rows() if not REFERENCE.search(row)]
    assert not unbacked, f"promises in docs/promises.md without a test: {unbacked}"


def test_the_readme_links_the_table():
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "docs/promises.md" in f.read()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_readme_and_the_docs_reach_a_file_and_heading():
    pages = ["README.md", "CONTRIBUTING.md"] + [os.path.join("docs", p) for p in sorted(os.listdir(ROOT + "/docs"))]
    broken = []
    for page in (p for p in pages if p.endswith(".md")):
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for target, anchor in re.findall(r"\]\(((?!https?:)[^)#\s]*)(?:#([^)\s]*))?\)", text):
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target)) if target else page
            path = os.path.join(ROOT, path)
            if not os.path.exists(path):
                broken.append(f"{page}: {target}")
            elif anchor and path.endswith(".md"):
                with open(path) as f:
                    headings = {slug(h) for h in re.findall(r"^#+ (.*)$", f.read(), re.M)}
                if anchor not in headings:
                    broken.append(f"{page}: {target}#{anchor}")
    assert not broken, broken
