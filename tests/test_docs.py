"""Cheap checks of the documentation site's structure (the build itself is scripts/docs.sh).

Sphinx would only warn about a page missing from every toctree once the whole site is built; these
checks read the Markdown sources directly, so a new page that nobody linked fails in the unit tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BUILD = DOCS / "_build"

# A MyST toctree: ```{toctree} ... ``` (any fence of three or more backticks or colons).
TOCTREE = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{toctree\}[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
# The modules the API reference must document (automodule directives under docs/api/).
REQUIRED_MODULES = {
    "hicache_storage",
    "hicache_storage.backend",
    "hicache_storage.errors",
    "hicache_storage.capabilities",
    "hicache_storage.config",
    "hicache_storage.factory",
    "hicache_storage.registry",
    "hicache_storage.hookspecs",
    "hicache_storage.keys",
    "hicache_storage.hostpool",
    "hicache_storage.layers",
    "hicache_storage.conformance",
    "hicache_storage.conformance.suite",
    "hicache_storage.conformance.factory",
    "hicache_storage.conformance.report",
    "hicache_storage.conformance.provision",
    "hicache_storage.kit",
    "hicache_storage.kit.deadline",
    "hicache_storage.kit.integrity",
    "hicache_storage.kit.options",
    "hicache_storage.bench",
    "hicache_storage.bench.report",
    "hicache_storage.engine.build",
}


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if BUILD not in p.parents)


def docname(path: Path) -> str:
    return path.relative_to(DOCS).with_suffix("").as_posix()


def toctree_entries(page: Path) -> list[str]:
    """Return the docnames a page's toctrees list, resolved against the page's folder."""
    entries = []
    for match in TOCTREE.finditer(page.read_text(encoding="utf-8")):
        for line in match["body"].splitlines():
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            explicit = re.fullmatch(r".*<(?P<target>[^<>]+)>", line)
            target = explicit["target"] if explicit else line
            if "://" in target or target == "self":
                continue
            target = target.removesuffix(".md")
            if target.startswith("/"):
                entries.append(target.lstrip("/"))
            else:
                base = page.parent.relative_to(DOCS).as_posix()
                entries.append(str(Path(base, target).as_posix()).removeprefix("./"))
    return entries


def test_docs_exist() -> None:
    assert (DOCS / "conf.py").is_file()
    assert (DOCS / "index.md").is_file()


# A Markdown link, [text](target) or [text](target#anchor); images and bare URLs are not links here.
MD_LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s#]*)(?:#(?P<anchor>[^)\s]*))?\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.+?)[ \t]*#*$", re.MULTILINE)
FENCE = re.compile(r"^(`{3,}|:{3,}).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)


def slug(title: str) -> str:
    """Return the anchor MyST gives a heading (``myst_heading_anchors``: GitHub's slugs)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m["title"]) for m in HEADING.finditer(text)}


def home_links() -> list[tuple[str, str | None]]:
    text = FENCE.sub("", (DOCS / "index.md").read_text(encoding="utf-8"))
    return [(m["target"], m["anchor"]) for m in MD_LINK.finditer(text)]


def test_home_page_is_its_own_page_not_the_readme() -> None:
    text = (DOCS / "index.md").read_text(encoding="utf-8")
    assert "README" not in text, "docs/index.md is the users' home page; it must not include README"
    assert text.startswith("# "), "docs/index.md starts with its own title"


def test_home_page_links_resolve() -> None:
    broken = []
    for target, anchor in home_links():
        if "://" in target or target.startswith("mailto:"):
            continue
        path = DOCS / target if target else DOCS / "index.md"
        if not path.is_file():
            broken.append(f"{target}: no such page")
        elif anchor and anchor not in anchors(path):
            broken.append(f"{target}#{anchor}: no such heading")
    assert home_links(), "docs/index.md links no page"
    assert not broken, f"broken links on the home page: {broken}"


def test_home_page_links_every_page() -> None:
    linked = {target for target, _ in home_links()}
    unlinked = [
        page.relative_to(DOCS).as_posix()
        for page in pages()
        if docname(page) != "index"
        and (not docname(page).startswith("api/") or docname(page) == "api/index")
        and page.relative_to(DOCS).as_posix() not in linked
    ]
    assert not unlinked, (
        f"pages the home page does not link (add them to 'Where to find'): {unlinked}"
    )


@pytest.mark.parametrize(
    "page",
    ["authors.md", "conformance.md", "configuration.md", "layers.md", "sglang.md", "vllm.md"],
)
def test_home_page_paths_link(page: str) -> None:
    """The three paths (backend author, operator, serving with an engine) link their pages."""
    assert page in {target for target, _ in home_links()}


def test_every_toctree_entry_is_a_page() -> None:
    known = {docname(p) for p in pages()}
    missing = {
        f"{docname(page)} -> {entry}"
        for page in pages()
        for entry in toctree_entries(page)
        if entry not in known
    }
    assert not missing, f"toctree entries without a page: {sorted(missing)}"


def test_every_page_is_in_a_toctree() -> None:
    listed = {entry for page in pages() for entry in toctree_entries(page)}
    orphans = [
        docname(page)
        for page in pages()
        if docname(page) != "index"
        and docname(page) not in listed
        and not page.read_text(encoding="utf-8").startswith("---\norphan: true")
    ]
    assert not orphans, (
        f"pages in no toctree (add them to docs/index.md or a section's toctree): {orphans}"
    )


@pytest.mark.parametrize("module", sorted(REQUIRED_MODULES))
def test_api_reference_documents(module: str) -> None:
    directive = re.compile(rf"^\.\. automodule:: {re.escape(module)}\s*$", re.MULTILINE)
    api_pages = sorted((DOCS / "api").glob("*.md"))
    assert any(directive.search(p.read_text(encoding="utf-8")) for p in api_pages), (
        f"no docs/api page has '.. automodule:: {module}'"
    )
