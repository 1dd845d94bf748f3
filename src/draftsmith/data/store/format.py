"""The store's on-disk format: names, errors, the manifest reader and the fp8 row quantisation.

Everything here is shared by the writer and the reader, so both agree on one definition of each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

from draftsmith.core.errors import DraftsmithError

FORMAT_NAME = "draftsmith-feature-store"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".writer.lock"
SHARD_PREFIX = "shard-"
SHARD_SUFFIX = ".safetensors"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
DEFAULT_SHARD_MAX_BYTES = 256 * 1024 * 1024

StoreDtype = Literal["bf16", "fp8"]
_DTYPES: tuple[str, ...] = ("bf16", "fp8")
_MISSING = object()


class StoreError(DraftsmithError):
    """Base class for feature-store errors."""


class StoreMismatch(StoreError):
    """The store was produced under different settings (meta, dtype) than the caller expects."""


class StoreCorrupt(StoreError):
    """A shard or the manifest does not match what was recorded (checksum, size, missing file)."""


class StoreLocked(StoreError):
    """Another writer holds the store; rerunning while it runs cannot help."""


class StoreWriteError(StoreError):
    """Writing a shard or the manifest failed (disk full, unwritable); the old manifest is intact."""


def estimate_bytes_per_token(hidden_size: int, num_aux: int = 3, dtype: StoreDtype = "bf16") -> int:
    """Payload bytes per token (excluding safetensors headers), to size a capture run before it starts."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    rows = num_aux + 1  # aux rows + the final hidden state
    per_row = hidden_size * 2 if dtype == "bf16" else hidden_size + 2  # fp8 payload + bf16 scale
    return 4 + 1 + rows * per_row


def _normalise_json(value: Any) -> Any:
    """JSON round trip, so tuples vs lists and key order never cause spurious mismatches."""
    try:
        return json.loads(json.dumps(value, sort_keys=True, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise TypeError(f"store meta must be JSON-serialisable: {e}") from e


def _read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise StoreCorrupt(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreCorrupt(f"{path} is not valid JSON: {e}") from e
    except RecursionError as e:
        raise StoreCorrupt(f"{path} is not a {FORMAT_NAME} manifest (nested too deeply to parse)") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StoreCorrupt(f"{path} is not a {FORMAT_NAME} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise StoreMismatch(
            f"{path} has format version {manifest.get('version')!r}; this draftsmith reads {FORMAT_VERSION}"
        )
    _check_manifest(manifest, path)
    return manifest


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_manifest(manifest: dict[str, Any], path: Path) -> None:
    """The structure every reader relies on, so an edited manifest is one StoreCorrupt naming the field.

    Shard files are plain ``shard-N.safetensors`` names inside the store (a manifest never points outside
    it), and a sample id appears once in the whole store (a second copy would be trained on twice).
    """
    def bad(where: str, what: str) -> StoreCorrupt:
        return StoreCorrupt(f"{path}: {where} {what}; the manifest was edited or damaged")

    if not isinstance(manifest.get("meta"), dict):
        raise bad("meta", "is not an object")
    for key in ("num_samples", "total_tokens", "total_loss_tokens"):
        if not _count(manifest.get(key)):
            raise bad(key, f"is {manifest.get(key)!r}, not a count")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise bad("shards", f"is a {type(shards).__name__}, not a list")
    seen: dict[str, str] = {}
    files: set[str] = set()
    for si, shard in enumerate(shards):
        where = f"shards[{si}]"
        if not isinstance(shard, dict):
            raise bad(where, "is not an object")
        name = shard.get("file")
        if not isinstance(name, str) or _shard_index(name) is None or "/" in name or "\\" in name:
            raise bad(f"{where}.file", f"is {str(name)[:80]!r}, not a {SHARD_PREFIX}N{SHARD_SUFFIX} name inside "
                      "the store")
        if name in files:
            raise bad(f"{where}.file", f"{name!r} is listed twice")
        files.add(name)
        if not isinstance(shard.get("sha256"), str) or not _count(shard.get("bytes")):
            raise bad(where, "has no sha256 string or no byte count")
        samples = shard.get("samples")
        if not isinstance(samples, list):
            raise bad(f"{where}.samples", f"is a {type(samples).__name__}, not a list")
        for j, rec in enumerate(samples):
            at = f"{where}.samples[{j}]"
            if not isinstance(rec, dict) or not isinstance(rec.get("sample_id"), str):
                raise bad(at, "has no sample_id string")
            for key in ("length", "loss_tokens"):
                if not _count(rec.get(key)):
                    raise bad(f"{at}.{key}", f"is {rec.get(key)!r}, not a count")
            sid = rec["sample_id"]
            if sid in seen:
                raise bad(at, f"repeats sample_id {sid[:80]!r} ({seen[sid]} has it too)")
            seen[sid] = at


def _shard_index(name: str) -> int | None:
    if not (name.startswith(SHARD_PREFIX) and name.endswith(SHARD_SUFFIX)):
        return None
    digits = name[len(SHARD_PREFIX) : -len(SHARD_SUFFIX)]
    return int(digits) if digits.isdigit() else None


# --------------------------------------------------------------------------------------------------
# fp8 quantisation


def _quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) scaled float8_e4m3fn; the scale is ~amax/448 so each row uses the full range.

    The scale is kept in bf16 (float32's range, 2 bytes): nudged up by one bf16 rounding step before
    rounding so that amax / scale never exceeds 448. Stores written with float32 scales read the same way.
    """
    x32 = x.float()
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX * (1 + 2**-7)).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
    q = (x32 / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.squeeze(-1).contiguous()


def _dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(out_dtype)
