"""The README and docs/ stay navigable: every relative link and image resolves, anchors exist,
every figure is shown or linked from some page, and the README stays short.

Why: the details live on many pages under docs/ now, so a moved file or a renamed heading
would otherwise break the map silently.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Markdown files under docs/figures are raw benchmark outputs, linked to but not pages themselves.
PAGES = [p for p in PAGES if "figures" not in p.relative_to(ROOT).parts]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
README_MAX_LINES = 300


def _prose(text: str) -> str:
    """The page without fenced code blocks (brackets there are code, not links)."""
    return FENCE.sub("", text)


def _links(page: Path) -> list[str]:
    return LINK.findall(_prose(page.read_text(encoding="utf-8")))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _local(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)  # http:, https:, mailto:


def test_slug_follows_github():
    assert _slug("LoRA adapters (`--lora RANK`)") == "lora-adapters---lora-rank"
    assert _slug("J4. Hierarchical latents (JoMA Table 1)") == "j4-hierarchical-latents-joma-table-1"


def test_link_pattern_finds_links_and_images_but_not_code():
    text = "see [a](x.md) and ![b](figs/c.png)\n```\n[not](a/link.md)\n```\n[d `e`](y.md#z)"
    assert LINK.findall(_prose(text)) == ["x.md", "figs/c.png", "y.md#z"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(page):
    broken = []
    for target in _links(page):
        if not _local(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_figure_and_result_file_is_linked_from_a_page():
    linked = set()
    for page in PAGES + sorted((ROOT / "docs" / "figures").rglob("*.md")):
        for target in _links(page):
            if _local(target):
                linked.add((page.parent / target.partition("#")[0]).resolve())
    files = [f for f in (ROOT / "docs" / "figures").rglob("*") if f.is_file()]
    assert files
    unlinked = sorted(str(f.relative_to(ROOT)) for f in files if f.resolve() not in linked)
    assert not unlinked, f"not linked from any page: {unlinked}"


def test_readme_is_short_and_links_every_capability_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    targets = set(_links(ROOT / "README.md"))
    for page in ("architecture", "kv", "quant", "rope", "dejavu", "serve", "theory", "analysis", "train"):
        assert f"docs/{page}.md" in targets, page
