"""safetensors files read by their header: tensor names, dtypes, shapes and byte offsets, without loading weights.

``draftsmith doctor`` checks a drafter from its headers alone; ``read_small_tensor`` then reads just the
``d2t``/``t2d`` tensors by their offsets.
"""

from __future__ import annotations

import json
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core.errors import DraftsmithError, one_line

_SMALL_TENSOR_BYTES = 64 << 20  # d2t/t2d of any real vocabulary fit far below this


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors dtype: F32, BF16, I64, BOOL, ...
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offsets in the file
    end: int


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Tensor names, dtypes, shapes and offsets from a safetensors file's JSON header (nothing else is read)."""
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    base = 8 + n
    return {name: TensorInfo(v["dtype"], tuple(v["shape"]), path, base + v["data_offsets"][0],
                             base + v["data_offsets"][1])
            for name, v in header.items() if name != "__metadata__"}


def read_small_tensor(info: TensorInfo):
    """One small tensor (d2t, t2d) read by its offsets, without touching the rest of the file."""
    import torch

    dtypes = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    if info.dtype not in dtypes:
        raise ValueError(f"unsupported dtype {info.dtype}")
    if info.end - info.start > _SMALL_TENSOR_BYTES:
        raise ValueError(f"tensor of {info.end - info.start} bytes is not small")
    with open(info.file, "rb") as f:
        f.seek(info.start)
        data = f.read(info.end - info.start)
    if len(data) != info.end - info.start:
        raise ValueError(f"{info.file}: truncated (tensor data ends past the end of the file)")
    t = torch.frombuffer(bytearray(data), dtype=dtypes[info.dtype]) if data else torch.empty(0, dtype=dtypes[
        info.dtype])
    return t.reshape(info.shape)


def read_checkpoint_headers(path: Path) -> tuple[dict[str, TensorInfo], str]:
    """All tensors of a checkpoint directory (single file or sharded index) and the file they came from."""
    single = path / "model.safetensors"
    if single.is_file():
        return read_safetensors_header(single), single.name
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        out: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            out.update(read_safetensors_header(path / shard))
        return out, index.name
    shards = sorted(path.glob("*.safetensors"))
    if len(shards) == 1:
        return read_safetensors_header(shards[0]), shards[0].name
    raise FileNotFoundError("no model.safetensors or model.safetensors.index.json")


def damaged_files(path: Path) -> list[str]:
    """The checkpoint's safetensors files that a loader would fail on: an unreadable header, or tensor data
    that ends past the end of the file (a truncated copy). Reads headers and file sizes only."""
    index = path / "model.safetensors.index.json"
    try:
        files = ([path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
                 if index.is_file() else sorted(path.glob("*.safetensors")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{index.name}: unreadable ({e})"]
    bad = []
    for f in files:
        try:
            end = max((t.end for t in read_safetensors_header(f).values()), default=0)
        except (OSError, ValueError) as e:
            bad.append(f"{f.name}: unreadable header ({e})")
            continue
        if end > f.stat().st_size:
            bad.append(f"{f.name}: truncated ({f.stat().st_size} bytes, its header needs {end})")
    return bad


__all__ = ["TensorInfo", "damaged_files", "read_checkpoint_headers", "read_safetensors_header", "read_small_tensor"]


class CorruptWeightsError(DraftsmithError, ValueError):
    """A weights file that cannot be read (truncated or corrupt safetensors); names the file."""


def _safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []


@contextmanager
def corrupt_weights_named(where: str | Path):
    """Turn safetensors' own error (which names no file) into one that names the file that fails.

    ``where`` is a safetensors file, or a directory whose safetensors files are checked by header to find
    the culprit (a loader such as Hugging Face's ``from_pretrained`` does not say which shard it read).
    """
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as e:
        where = Path(where)
        culprit = where
        if where.is_dir():
            culprit = next((f for f in _safetensors_files(where) if not _header_ok(f)), where)
        raise CorruptWeightsError(f"{culprit}: not a valid safetensors file (truncated or corrupt): "
                                  f"{one_line(e)}") from e


def _header_ok(path: Path) -> bool:
    """Whether a safetensors file's header parses and its tensors end within the file."""
    try:
        infos = read_safetensors_header(path)
    except (OSError, ValueError):
        return False
    size = path.stat().st_size
    return all(i.end <= size for i in infos.values())
