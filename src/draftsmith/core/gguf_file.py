"""A GGUF file opened as untrusted input: its counts bounded by its size before gguf's reader walks them.

gguf's ``GGUFReader`` trusts the header: a file cut short, a tensor count of 2^40 or a string array claiming 2^40
entries end in ``IndexError`` (after seconds of walking, for the count), and a file cut inside its tensor data in a
``ValueError`` about a reshape. Every reader of a GGUF (export, doctor, bench) opens it here instead, and gets one
``GgufFileError`` line naming the file and what is wrong with it.
"""

from __future__ import annotations

import struct
from pathlib import Path

from draftsmith.core.errors import UsageError, one_line

MAGIC = b"GGUF"
VERSIONS = (2, 3)
HEADER_BYTES = 24  # magic, version (u32), tensor count (u64), key/value count (u64)
# The fewest bytes one entry can take: a key/value pair is a u64 key length, a u32 type and a value of at least
# one byte; a tensor's info a u64 name length, a u32 dimension count, a u32 type and a u64 offset.
MIN_KV_BYTES = 13
MIN_TENSOR_INFO_BYTES = 24
# What gguf's reader raises on a damaged key/value table or tensor list (it indexes a memory map without checks).
_READER_ERRORS = (IndexError, KeyError, TypeError, OverflowError, MemoryError, struct.error)


class GgufFileError(UsageError):
    """A file given as a GGUF that is not one, or is damaged or cut short."""


def check_gguf_header(path: Path) -> tuple[int, int]:
    """(tensor count, key/value count) from the header, refused when a file of this size cannot hold them."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise GgufFileError(f"{path}: cannot be read ({one_line(e)})") from e
    if len(head) < HEADER_BYTES or head[:4] != MAGIC:
        raise GgufFileError(f"{path}: not a GGUF file (no GGUF header)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
    if version not in VERSIONS:
        raise GgufFileError(f"{path}: GGUF version {version}, not one of {', '.join(map(str, VERSIONS))} (damaged, "
                            "or a byte order this reader does not take)")
    room = size - HEADER_BYTES
    if n_kv * MIN_KV_BYTES > room or n_tensors * MIN_TENSOR_INFO_BYTES > room:
        raise GgufFileError(f"{path}: its header claims {n_tensors} tensors and {n_kv} keys, more than its {size} "
                            "bytes can hold (cut short, or a damaged header)")
    return n_tensors, n_kv


def open_gguf(path: str | Path):
    """A ``GGUFReader`` over ``path`` whose keys and tensors all lie inside the file; else ``GgufFileError``."""
    from gguf import GGUFReader

    path = Path(path)
    check_gguf_header(path)
    try:
        reader = GGUFReader(path)
    except OSError as e:
        raise GgufFileError(f"{path}: cannot be read ({one_line(e)})") from e
    except ValueError as e:
        if "reshape" not in str(e):  # gguf's words for a tensor whose data the file does not hold
            raise GgufFileError(f"{path}: not a readable GGUF ({one_line(e)})") from e
        raise GgufFileError(f"{path}: cut short: a tensor's data runs past the end of the file") from e
    except _READER_ERRORS as e:
        raise GgufFileError(f"{path}: a damaged GGUF: its key/value table or tensor list runs past the data it "
                            f"holds (cut short, or a count or length that is wrong: {one_line(e)})") from e
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise GgufFileError(f"{path}: cut short: its tensors need {end} bytes, the file has {size}")
    return reader
