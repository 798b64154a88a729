from collections.abc import Sequence

from typing_extensions import Buffer

def crc32c(data: Buffer, value: int = 0, /) -> int: ...
def read_checked(
    fd: int, buffers: Sequence[Buffer], offset: int, chunk: int, checked: int, /
) -> tuple[int, int]: ...
def write_checked(
    fd: int, buffers: Sequence[Buffer], offset: int, chunk: int, /
) -> tuple[int, int]: ...
def read_files(
    paths: Sequence[bytes],
    pages: Sequence[Sequence[Buffer]],
    checked: Sequence[int],
    flags: int,
    chunk: int,
    threads: int,
    /,
) -> list[tuple[int, int, int, int]]: ...
def write_files(
    paths: Sequence[bytes],
    temps: Sequence[bytes],
    pages: Sequence[Sequence[Buffer]],
    digests: Sequence[int] | None,
    fsync: bool,
    chunk: int,
    threads: int,
    /,
) -> list[tuple[int, int]]: ...
def read_runs(
    runs: Sequence[Sequence[tuple[int, int, Sequence[Buffer]]]],
    checked: Sequence[int],
    chunk: int,
    threads: int,
    /,
) -> list[tuple[int, int, int]]: ...
def write_runs(
    runs: Sequence[Sequence[tuple[int, int, Sequence[Buffer]]]],
    chunk: int,
    threads: int,
    /,
) -> list[tuple[int, int, int]]: ...
