"""The default key scheme: page hash plus a rank suffix, as SGLang's ``HiCacheFile`` names pages.

Under tensor parallelism each TP rank of an MHA model holds a different slice of the heads, so
each rank stores its own object per page and the suffix carries ``{tp_rank}_{tp_size}``. An MLA
model replicates the latent KV on every TP rank, so all ranks share one object per page: the
TP part is dropped and only rank 0 writes. Pipeline and context parallelism split the KV
further and always add their own suffix parts when in use. The suffix is SGLang 0.5's, byte
for byte (an empty model name leaves an empty part: ``<hash>__0_1``), so one store can be shared
with SGLang deployments.

With an ``object_format`` (the :attr:`~hicache_storage.keys.format.ObjectFormat.tag` of the
pages' dtype, geometry and layout) the suffix ends in ``_f<tag>``: writers whose bytes mean
different things never share a key. Without it the keys are SGLang's, and only the model name
and the ranks tell writers apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from hicache_storage.errors import ConfigError, InvalidKeyError
from hicache_storage.keys.format import is_format_tag
from hicache_storage.keys.validation import MAX_KEY_LENGTH, validate_key

__all__ = ["RankSuffixScheme", "sanitize_model_name"]

_HASH_LENGTH = 64
_HASH = re.compile(r"[0-9a-f]{64}")
_EXAMPLE_HASH = "0" * _HASH_LENGTH


def sanitize_model_name(model_name: str) -> str:
    """Return the model name as it appears in keys: ``/`` replaced by ``-``, as SGLang does.

    ``"Qwen/Qwen3-8B"`` becomes ``"Qwen-Qwen3-8B"``. No other character is changed: a lossy
    mapping would make two models share keys (wrong hits) and would not match SGLang's names.
    """
    return model_name.replace("/", "-")


@dataclass(frozen=True, slots=True)
class RankSuffixScheme:
    """Maps page hashes to the keys of one parallel rank.

    Parameters
    ----------
    model_name
        Model identifier, with ``/`` replaced by ``-`` (:func:`sanitize_model_name`).
    tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size
        Tensor-, pipeline- and context-parallel rank and world size of this worker.
    is_mla
        Whether the model uses MLA, whose KV is identical on every TP rank.
    object_format
        The :class:`~hicache_storage.keys.format.ObjectFormat` tag of the pages, or ``""``
        for SGLang's exact names (which do not say what the bytes mean).

    Raises
    ------
    ConfigError
        If a size is below 1, a rank is outside ``[0, size)``, ``object_format`` is not a
        format tag, or the model name would make
        keys that break the key rule (characters other than letters, digits, ``_``, ``-``,
        ``.`` and ``/``, a ``..``, or keys longer than
        :data:`~hicache_storage.keys.validation.MAX_KEY_LENGTH`).
    """

    model_name: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    is_mla: bool = False
    object_format: str = ""
    _suffix: str = field(init=False, repr=False, compare=False)
    _base: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str):
            raise ConfigError(f"model_name must be str, got {type(self.model_name).__name__}")
        if not isinstance(self.is_mla, bool):
            raise ConfigError(f"is_mla must be bool, got {type(self.is_mla).__name__}")
        for kind in ("tp", "pp", "cp"):
            rank, size = getattr(self, f"{kind}_rank"), getattr(self, f"{kind}_size")
            for name, value in ((f"{kind}_rank", rank), (f"{kind}_size", size)):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"{name} must be int, got {value!r}")
            if size < 1:
                raise ConfigError(f"{kind}_size must be >= 1, got {size}")
            if not 0 <= rank < size:
                raise ConfigError(f"{kind}_rank must be in [0, {kind}_size={size}), got {rank}")

        if not isinstance(self.object_format, str) or (
            self.object_format and not is_format_tag(self.object_format)
        ):
            raise ConfigError(
                f"object_format must be an ObjectFormat tag (16 hex digits) or empty, got "
                f"{self.object_format!r}"
            )
        parts = [sanitize_model_name(self.model_name)]
        if not self.is_mla:
            parts += [str(self.tp_rank), str(self.tp_size)]
        if self.pp_size > 1:
            parts += [str(self.pp_size), str(self.pp_rank)]
        if self.cp_size > 1:
            parts += [f"cp{self.cp_rank}", str(self.cp_size)]
        base = "".join(f"_{part}" for part in parts)
        suffix = f"{base}_f{self.object_format}" if self.object_format else base
        if _HASH_LENGTH + len(suffix) > MAX_KEY_LENGTH:
            raise ConfigError(
                f"model_name is too long: keys would be {_HASH_LENGTH + len(suffix)} characters,"
                f" the limit is {MAX_KEY_LENGTH}"
            )
        try:
            validate_key(_EXAMPLE_HASH + suffix)
        except InvalidKeyError as exc:
            raise ConfigError(
                f"model_name {self.model_name!r} cannot be part of a key: {exc}. SGLang keeps "
                "the name verbatim (only '/' becomes '-'), so no other spelling would share "
                "its keys; name the model with letters, digits, '_', '-', '.' and '/'"
            ) from None
        object.__setattr__(self, "_suffix", suffix)
        object.__setattr__(self, "_base", base)

    @property
    def suffix(self) -> str:
        """The text appended to every page hash, e.g. ``"_Qwen-Qwen3-8B_1_4"`` or ``"__0_1"``."""
        return self._suffix

    @property
    def keys_per_page(self) -> int:
        """One object per page and rank."""
        return 1

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes pages: always for MHA, only TP rank 0 for MLA.

        MLA ranks hold identical bytes under identical keys, so a single writer avoids
        redundant writes of the same object; the other ranks only read.
        """
        return not self.is_mla or self.tp_rank == 0

    def key(self, page_hash: str) -> str:
        """Return the key of ``page_hash`` for this rank."""
        return page_hash + self._suffix

    def keys(self, page_hashes: Iterable[str]) -> list[str]:
        """Return the keys of ``page_hashes`` for this rank, in order."""
        suffix = self._suffix
        return [h + suffix for h in page_hashes]

    def owns(self, key: str) -> bool:
        """Whether ``key`` is a page hash followed by this rank's suffix, of any object format.

        Backends use it so that a rank only evicts or clears its own objects: those it wrote
        with SGLang's names and those of every format tag (a rank that changed its host layout
        still owns what it wrote before).
        """
        if _HASH.fullmatch(key, 0, _HASH_LENGTH) is None:
            return False
        rest = key[_HASH_LENGTH:]
        if rest == self._base:
            return True
        base = len(self._base)
        return (
            rest.startswith(self._base)
            and rest[base : base + 2] == "_f"
            and is_format_tag(rest[base + 2 :])
        )
