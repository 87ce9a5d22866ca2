"""The README and docs/: every relative link points at a file that exists."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue   # (web addresses, anchors)
            checked += 1
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert checked >= 10 and not broken, broken
