from collections.abc import Sequence

from typing_extensions import Buffer

def crc32c(data: Buffer, value: int = 0, /) -> int: ...
def read_checked(
    fd: int, buffers: Sequence[Buffer], offset: int, chunk: int, checked: int, /
) -> tuple[int, int]: ...
def write_checked(
    fd: int, buffers: Sequence[Buffer], offset: int, chunk: int, /
) -> tuple[int, int]: ...
