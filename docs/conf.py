"""Sphinx configuration: the hicache-storage documentation site (furo + MyST + autodoc).

Build strictly (``scripts/docs.sh`` runs this, adding ``-E -q``; CI runs ``scripts/docs.sh``)::

    sphinx-build -W --keep-going -n -b html docs docs/_build/html

Choices worth knowing:

* The API reference is generated from the numpy-style docstrings (autodoc + napoleon), one
  hand-written page per module under ``api/``. The package is imported from the environment (the
  editable install), because ``backends/``, ``conformance/`` and ``kernels/`` only become
  ``hicache_storage.*`` once installed.
* The build is nitpicky (``-n``) without intersphinx, so it never needs the network. References to
  types of other projects (the standard library, numpy, torch, msgspec, pluggy, ...) have no
  target and are ignored by module prefix in ``nitpick_ignore_regex``, as are private
  ``hicache_storage`` names; every other reference into ``hicache_storage`` must resolve.
* ``hicache_storage`` re-exports names from its submodules (``hicache_storage.create_backend`` is
  ``hicache_storage.factory.create_backend``). Each object is documented once, where its page
  puts it; :func:`_resolve_alias` resolves a reference through any other importable name of the
  same object, and resolves the bare names that ``TYPE_CHECKING``-only imports leave in
  annotations when exactly one documented object carries that name.
* Markdown links from the docs and the included READMEs to files outside ``docs/`` (the README,
  the examples) are rewritten to pages of the site by :func:`_rewrite_links`.
* Small fixes to what autodoc and napoleon produce, each in its own function below: combined
  ``Attributes`` entries (``tp_rank, tp_size``) and prose property docstrings
  (:func:`_patch_napoleon`), ``<factory>`` defaults (:func:`_factory_defaults`), constants
  without their type's docstring (:func:`_drop_type_docstring`), private base classes shown as
  their public bases (:func:`_public_bases`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from docutils import nodes
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

project = "hicache-storage"
author = "hicache-storage authors"
copyright = "the hicache-storage authors"

try:
    from importlib.metadata import version as _version

    release = _version("hicache-storage")
except Exception:  # noqa: BLE001 (not installed: the build fails later, at the first autodoc)
    release = "0.0.0"
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
suppress_warnings: list[str] = []

# -- MyST ----------------------------------------------------------------------------------------

myst_enable_extensions = ["colon_fence", "deflist"]
# Slugs for every heading level, so ``contract.md#keys`` style links resolve.
myst_heading_anchors = 6

# -- autodoc / napoleon --------------------------------------------------------------------------

autodoc_default_options = {
    "members": True,
    "show-inheritance": True,
    "member-order": "bysource",
}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
# Class "Attributes" sections become attribute entries, targets for :attr: references (the fields
# themselves carry no docstrings, so autodoc does not document them a second time).
napoleon_use_ivar = False
python_use_unqualified_type_names = True
python_maximum_signature_line_length = 100

# -- nitpicky ------------------------------------------------------------------------------------

nitpicky = True
# No intersphinx (the build must not need the network): names from these projects have nowhere
# to link to. Only whole foreign modules are listed; a broken reference into hicache_storage is
# still an error.
_FOREIGN_MODULES = (
    "abc",
    "argparse",
    "asyncio",
    "collections",
    "concurrent",
    "contextlib",
    "dataclasses",
    "enum",
    "http",
    "importlib",
    "io",
    "logging",
    "mmap",
    "multiprocessing",
    "os",
    "pathlib",
    "queue",
    "socket",
    "subprocess",
    "threading",
    "types",
    "typing",
    "typing_extensions",
    "weakref",
    "click",
    "msgspec",
    "numpy",
    "pluggy",
    "prometheus_client",
    "pytest",
    "_pytest",
    "rich",
    "torch",
    "triton",
)
_FOREIGN = "|".join(re.escape(m) for m in _FOREIGN_MODULES)
nitpick_ignore_regex = [
    (r"py:.*", rf"(?:{_FOREIGN})(?:\..+)?"),
    # Private helpers (a private base class shown by show-inheritance, a private Protocol in an
    # annotation) are not documented, by design.
    (r"py:class", r"hicache_storage(?:\.\w+)*\._\w+"),
]

# -- HTML ----------------------------------------------------------------------------------------

html_theme = "furo"
html_title = f"hicache-storage {release}"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": True,
}

# -- Markdown links to files outside docs/ -------------------------------------------------------

# Repository paths (relative to the repository root) that the site shows as one of its pages.
_PAGE_FOR_PATH = {
    "README.md": "/index.md",
    "examples/quickstart.py": "/examples.md#quickstart",
    "examples/mixed_tp_fleet.py": "/examples.md#mixed-tp-fleet",
    "examples/thirdparty": "/examples.md#a-third-party-backend-package",
    "examples/thirdparty/README.md": "/examples.md#a-third-party-backend-package",
}
_LINK = re.compile(r"\]\((?P<target>[^)\s#]*)(?P<anchor>#[^)\s]*)?\)")


def _rewrite_links(text: str, base: Path) -> str:
    """Point relative Markdown links of a file in ``base`` at pages of the site.

    A link to a page under ``docs/`` becomes source-directory-absolute (``/contract.md``), so it
    resolves wherever the text is included; a link to a file listed in ``_PAGE_FOR_PATH`` goes to
    its page. Other links are left as they are.
    """

    def replace(match: re.Match[str]) -> str:
        target, anchor = match["target"], match["anchor"] or ""
        if not target or "://" in target or target.startswith(("/", "mailto:")):
            return match[0]
        path = Path(os.path.normpath(base / target))
        try:
            rel = path.relative_to(ROOT).as_posix()
        except ValueError:
            return match[0]
        if rel in _PAGE_FOR_PATH:
            return f"]({_PAGE_FOR_PATH[rel]})"
        if rel.startswith("docs/") and rel.endswith(".md"):
            return f"](/{rel.removeprefix('docs/')}{anchor})"
        return match[0]

    return _LINK.sub(replace, text)


def _on_source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    base = (DOCS / docname).parent
    source[0] = _rewrite_links(source[0], base)


def _on_include_read(
    app: Sphinx, relative_path: Path, parent_docname: str, content: list[str]
) -> None:
    path = Path(os.path.normpath(DOCS / relative_path))
    if path.suffix == ".md":
        content[0] = _rewrite_links(content[0], path.parent)


# -- napoleon: the project's docstring conventions ------------------------------------------------


def _patch_napoleon() -> None:
    """Teach napoleon two conventions of this project's numpy-style docstrings.

    * An ``Attributes`` entry may name several attributes at once (``tp_rank, tp_size``), as numpy
      allows for parameters: each gets its own target, sharing the description.
    * The docstring of a property or attribute is prose, never napoleon's inline
      ``type: description`` form (types come from annotations): a colon in its first line is text.
    """
    from sphinx.ext.napoleon.docstring import GoogleDocstring

    parse_attributes = GoogleDocstring._parse_attributes_section

    def _parse_attributes_section(self: GoogleDocstring, section: str) -> list[str]:
        lines: list[str] = []
        for line in parse_attributes(self, section):
            head, sep, names = line.partition(".. attribute:: ")
            if not head and sep and "," in names:
                first, *rest = (name.strip() for name in names.split(","))
                lines.append(f".. attribute:: {first}")
                lines.extend(f"              {name}" for name in rest)
            else:
                lines.append(line)
        return lines

    def _parse_attribute_docstring(self: GoogleDocstring) -> list[str]:
        text = self._dedent(self._consume_to_end())
        return self._format_field("", "", self.__class__(text, self._config).lines())

    GoogleDocstring._parse_attributes_section = _parse_attributes_section  # type: ignore[method-assign]
    GoogleDocstring._parse_attribute_docstring = _parse_attribute_docstring  # type: ignore[method-assign]


_patch_napoleon()


# -- Dataclass signatures ------------------------------------------------------------------------


def _default_factories(cls: Any) -> list[tuple[str, Any]]:
    """Return ``(field name, default factory)`` of a dataclass or msgspec Struct's fields."""
    if dataclasses.is_dataclass(cls):
        return [
            (f.name, f.default_factory)
            for f in dataclasses.fields(cls)
            if f.default_factory is not dataclasses.MISSING
        ]
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return [
            (f.name, f.default_factory)
            for f in msgspec.structs.fields(cls)
            if f.default_factory is not msgspec.NODEFAULT
        ]
    return []


def _factory_defaults(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str | None, str | None] | None:
    """Show a field's default factory as a call (``dict()``), not the unparsable ``<factory>``.

    ``<factory>`` (dataclasses' and msgspec's repr) is not Python, so the signature parser would
    give up on the whole signature and cut its annotations at every comma.
    """
    if not signature or "<factory>" not in signature:
        return None
    for field, factory in _default_factories(obj):
        qualname = getattr(factory, "__qualname__", "")
        call = f"{qualname}()" if qualname.isidentifier() else "..."
        signature = re.sub(
            rf"((?<![\w.]){re.escape(field)}(?::[^=]*?)?=\s*)<factory>", rf"\g<1>{call}", signature
        )
    return signature, return_annotation


def _public_bases(app: Sphinx, name: str, obj: Any, options: Any, bases: list[type]) -> None:
    """Show a private base class (``_Config``) as the public classes it derives from."""
    public: list[type] = []
    pending = list(bases)
    while pending:
        base = pending.pop(0)
        if base.__name__.startswith("_") and base.__module__.startswith("hicache_storage"):
            pending[:0] = [b for b in base.__bases__ if b is not object]
        elif base not in public:
            public.append(base)
    bases[:] = public


def _drop_type_docstring(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Give a constant no docstring rather than its type's (``dict``'s, a pluggy marker's)."""
    if what in ("data", "attribute") and lines and not isinstance(obj, type):
        type_doc = inspect.getdoc(type(obj))
        if type_doc and "\n".join(lines).strip() == type_doc.strip():
            lines[:] = []


# -- References through re-exports and TYPE_CHECKING imports -------------------------------------


def _import_target(target: str) -> Any:
    """Return the object a dotted name imports to, or ``_MISSING``."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return _MISSING
        return obj
    return _MISSING


_MISSING = object()

# Final name component -> (documented full name, the object it imports to).
_DOCUMENTED: dict[str, list[tuple[str, Any]]] = {}


def _index_documented(app: Sphinx, env: BuildEnvironment) -> list[str]:
    """Import every documented Python object once every page has been read."""
    _DOCUMENTED.clear()
    for name, *_ in env.get_domain("py").get_objects():
        _DOCUMENTED.setdefault(name.rsplit(".", 1)[-1], []).append((name, _import_target(name)))
    return []


def _qualified(obj: Any) -> str | None:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None


def _resolve_alias(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> nodes.Element | None:
    """Resolve a Python reference that names a documented object some other way.

    ``target`` may be a re-export (``hicache_storage.create_backend``), a name relative to the
    module of the docstring (``StorageBackend.get`` in ``hicache_storage.layers.base``), or a bare
    name that a ``TYPE_CHECKING``-only import left in an annotation. The reference resolves when
    exactly one documented object is that same object (or, when it cannot be imported, carries
    that dotted name as the tail of its own).
    """
    if node.get("refdomain") != "py":
        return None
    target: str = node["reftarget"].lstrip(".~")
    last = target.rsplit(".", 1)[-1]
    scopes = [target]
    module = node.get("py:module")
    if module and not target.startswith("hicache_storage."):
        if node.get("py:class"):
            scopes.insert(0, f"{module}.{node['py:class']}.{target}")
        scopes.append(f"{module}.{target}")
    obj = _MISSING
    for scope in scopes:
        obj = _import_target(scope)
        if obj is not _MISSING:
            break
    documented = _DOCUMENTED.get(last, [])
    if obj is not _MISSING:
        if isinstance(obj, TypeVar):
            return contnode  # a type variable has no page; show its name unlinked
        qualified = _qualified(obj)
        candidates = {
            name
            for name, other in documented
            if other is obj or (qualified is not None and _qualified(other) == qualified)
        }
    else:
        candidates = {name for name, _ in documented if name.endswith(f".{target}")}
    if len(candidates) != 1:
        return None
    (name,) = candidates
    node = node.deepcopy()
    node["reftarget"] = name
    node["refspecific"] = False
    return env.get_domain("py").resolve_xref(
        env, node["refdoc"], app.builder, "obj", name, node, contnode
    )


def setup(app: Sphinx) -> dict[str, Any]:
    """Connect the link rewriter and the alias resolver."""
    app.connect("source-read", _on_source_read)
    app.connect("include-read", _on_include_read)
    app.connect("autodoc-process-signature", _factory_defaults)
    app.connect("autodoc-process-docstring", _drop_type_docstring, priority=100)
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("env-updated", _index_documented)
    app.connect("missing-reference", _resolve_alias)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
