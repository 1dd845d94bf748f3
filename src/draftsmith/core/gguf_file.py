"""A GGUF file opened as untrusted input: its counts bounded by its size before gguf's reader walks them.

gguf's ``GGUFReader`` trusts the header: a file cut short, a tensor count of 2^40 or a string array claiming 2^40
entries end in ``IndexError`` (after seconds of walking, for the count), and a file cut inside its tensor data in a
``ValueError`` about a reshape. Every reader of a GGUF (export, doctor, bench) opens it here instead, and gets one
``GgufFileError`` line naming the file and what is wrong with it.

It also reads faster. gguf's reader slices its ``np.memmap`` once per value it reads, and every slice of a memmap
runs numpy's Python-level ``__getitem__`` and ``__array_finalize__``: a tokenizer of 49k tokens and 48k merges is
a quarter of a million of them, seconds per file. ``_PlainArrayReader`` reads the same pages through a plain
ndarray view of that memory map (tests/test_gguf_file.py checks every field and tensor against gguf's own reader).
"""

from __future__ import annotations

import functools
import inspect
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


@functools.cache
def reader_class() -> type:
    """gguf's ``GGUFReader``, made to index a plain array where its private ``_get`` has the signature this was
    written against (every gguf release since the reader appeared); gguf's own class otherwise."""
    import numpy as np
    from gguf import GGUFReader

    if list(inspect.signature(GGUFReader._get).parameters) != ["self", "offset", "dtype", "count", "override_order"]:
        return GGUFReader

    class _PlainArrayReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = getattr(self, "_plain", None)
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            dt = np.dtype(dtype)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return _PlainArrayReader


def open_gguf(path: str | Path):
    """A ``GGUFReader`` over ``path`` whose keys and tensors all lie inside the file; else ``GgufFileError``."""
    path = Path(path)
    check_gguf_header(path)
    try:
        reader = reader_class()(path)
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
