"""How the suite builds the backend under test: a picklable recipe, so child processes can too."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from hicache_storage.backend import StorageBackend
from hicache_storage.config import Deployment, LayerConfig, read_source
from hicache_storage.factory import create_backend
from hicache_storage.registry import get_spec, origin_of

__all__ = ["BackendFactory"]


@dataclasses.dataclass(frozen=True)
class BackendFactory:
    """A registered backend name plus its options; calling it builds a fresh instance.

    Every call opens a new instance over the *same* store, which is how the suite checks
    persistence (close, then reopen) and sharing (another process opens its own instance).
    Instances come wrapped in the default layers as users get them, except the verify layer:
    the contract's checks mix value and page calls (a value ``set`` is read back as a page),
    and only pages written through the verify layer carry the record it checks, so
    ``TestEndToEnd`` turns it on where it checks it.

    Attributes
    ----------
    name
        Registered backend name.
    options
        The backend's options (anything :func:`~hicache_storage.create_backend` accepts, as a
        plain mapping so the recipe pickles).
    layers
        Layer settings; the default stack without verify unless a check needs another.
    """

    name: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    layers: LayerConfig = dataclasses.field(default_factory=lambda: LayerConfig(verify=False))

    @classmethod
    def from_source(cls, name: str, source: Any = None) -> BackendFactory:
        """Build a recipe from a name and a config source (mapping, JSON or ``@path``)."""
        return cls(name, read_source(source))

    def __call__(self, layers: LayerConfig | None = None) -> StorageBackend:
        """Open a new instance over the store."""
        return create_backend(
            self.name, self.options, deployment=Deployment(), layers=layers or self.layers
        )

    @property
    def capabilities(self) -> Any:
        """The capabilities an instance declares (opened once to ask)."""
        with self() as backend:
            return backend.capabilities

    def version(self) -> str:
        """Return the version of what provides the backend: its distribution, else its package.

        An entry point names its distribution; a plugin loaded at run time (``HICACHE_PLUGINS``,
        ``register_plugin``) that names none in its spec has the ``__version__`` of its
        factory's top-level package, else ``"unknown"``: never the SDK's own version.
        """
        from importlib.metadata import PackageNotFoundError, version

        origin = origin_of(self.name)
        if origin is not None:
            return origin.version
        spec = get_spec(self.name)
        if spec.distribution.replace("_", "-").lower() != "hicache-storage":
            try:
                return version(spec.distribution)
            except PackageNotFoundError:
                return "unknown"
        try:
            package = importlib.import_module(spec.factory.partition(":")[0].partition(".")[0])
        except ImportError:
            return "unknown"
        found = getattr(package, "__version__", None)
        return str(found) if found is not None else "unknown"
