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
