"""The README and the docs link only to files in the repository, so a clone alone (or its
web view) has every page they point to."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_markdown_links_stay_in_the_repository():
    pages = [ROOT / "README.md", *(p for d in ("docs", "jserve", "sharding", "protos", "tests")
                                   for p in (ROOT / d).rglob("*.md"))]
    assert ROOT / "docs" / "architecture.md" in pages
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:|#", target):  # a web address or an anchor on the page
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not (path.is_relative_to(ROOT) and path.exists()):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_pages_describe_the_software_not_the_work_log():
    """A user reads what jserve is, not which issue or session changed it: no issue or session
    numbers and no "this wave" in the README and the docs (dates of measurements are fine)."""
    history = re.compile(r"\b(issues? \d+|sessions? \d+|this wave)\b", re.IGNORECASE)
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), ROOT / "sharding" / "README.md"]
    found = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)}" for p in pages
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if (m := history.search(line))]
    assert not found, found
