"""Compact, crash-safe, verifiable store for captured EAGLE-3 training features.

Why this layout rather than SpecForge's (one ``torch.save`` file per sample holding ``input_ids``,
``loss_mask``, ``hidden_state`` and the concatenated ``aux_hidden_state`` in bf16):

* **No pickle.** ``torch.load`` of a pickle executes code; a feature store is often copied between
  machines and users. Shards here are ``safetensors`` files and the index is plain JSON.
* **Checksums.** Every shard's sha256 and size sit in ``manifest.json``; ``FeatureStore.verify()``
  and the first open of each shard while streaming catch bit rot and truncated copies, naming the shard.
* **Fewer files.** Samples are packed into shards of up to ``shard_max_bytes`` (256 MiB by default)
  instead of one file per sample, which is kinder to file systems, object stores and ``rsync``; a
  reader uses ``safetensors.safe_open`` so only the requested sample's tensors are read.
* **fp8 option.** ``dtype="fp8"`` stores the four ``[T, H]`` feature rows per token as
  ``float8_e4m3fn`` with one float32 scale per row (``amax / 448``), halving the dominant cost again.
* **Crash safety and resume.** A shard is written under a temporary name, fsynced and renamed, and
  only then added to the manifest, which is itself replaced atomically. A ``kill -9`` at any moment
  leaves a store whose manifest lists only complete shards; reopening the writer deletes leftovers and
  ``has()`` lets a rerun skip committed samples, so each sample is written exactly once.

Bytes per token, for ``n`` aux layers (3 for EAGLE-3) and hidden size ``H``
(``input_ids`` are stored as int32, ``loss_mask`` as uint8)::

    bf16: 5 + (n + 1) * H * 2          H=4096, n=3 -> 32,773 B  (~32 KiB)
    fp8:  5 + (n + 1) * (H + 2)        H=4096, n=3 -> 16,397 B  (~16 KiB)

plus the safetensors header (a few hundred bytes per sample). See ``estimate_bytes_per_token``.
One writer per store at a time (enforced with an advisory lock where ``fcntl`` exists).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save as _st_save

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import ExclusiveLock, LockHeld, atomic_write, sha256_file

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FeatureStore",
    "FeatureStoreWriter",
    "StoreCorrupt",
    "StoreError",
    "StoreMismatch",
    "StoreLocked",
    "StoreWriteError",
    "estimate_bytes_per_token",
]

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
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise StoreCorrupt(f"{path} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise StoreCorrupt(f"{path} is not a {FORMAT_NAME} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise StoreMismatch(
            f"{path} has format version {manifest.get('version')!r}; this draftsmith reads {FORMAT_VERSION}"
        )
    return manifest


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


# --------------------------------------------------------------------------------------------------
# Writer


def _own_cpu(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Detached contiguous CPU copy: never alias the caller's (possibly reused) capture buffers."""
    out = x.detach().to(device="cpu", dtype=dtype or x.dtype).contiguous()
    if out.data_ptr() == x.data_ptr() or out.untyped_storage().nbytes() != out.nbytes:
        out = out.clone()
    return out


class FeatureStoreWriter:
    """Append samples to a feature store; reopen on the same root to resume after a crash.

    Samples are buffered in memory and written as one shard when the buffer reaches
    ``shard_max_bytes`` or ``flush_every`` samples (whichever first), and on ``close()``. Peak memory is
    about twice ``shard_max_bytes`` (the buffered tensors plus the serialised shard).

    Counters (this writer's session only): ``written`` samples committed to the manifest,
    ``rejected_nonfinite`` samples refused for NaN/Inf, ``skipped_existing`` ids already present.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        meta: dict[str, Any],
        dtype: StoreDtype = "bf16",
        shard_max_bytes: int = DEFAULT_SHARD_MAX_BYTES,
        flush_every: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        if shard_max_bytes <= 0:
            raise ValueError("shard_max_bytes must be positive")
        if flush_every is not None and flush_every <= 0:
            raise ValueError("flush_every must be positive or None")
        self.root = Path(root)
        self.dtype: StoreDtype = dtype
        self.shard_max_bytes = shard_max_bytes
        self.flush_every = flush_every
        self.meta: dict[str, Any] = _normalise_json(dict(meta))

        self.written = 0
        self.rejected_nonfinite = 0
        self.skipped_existing = 0

        self._pending: list[tuple[str, dict[str, torch.Tensor], int, int]] = []
        self._pending_ids: set[str] = set()
        self._pending_bytes = 0
        self._closed = False
        self._lock: ExclusiveLock | None = None

        self.root.mkdir(parents=True, exist_ok=True)
        self._acquire_lock()
        try:
            self._open_store()
        except BaseException:
            self._release_lock()
            raise

    # -- setup ------------------------------------------------------------------------------------

    def _acquire_lock(self) -> None:
        """Two writers on one root would delete each other's in-flight shards during cleanup."""
        try:
            self._lock = ExclusiveLock(self.root / LOCK_NAME, "this feature store's writer lock")
        except LockHeld as e:
            raise StoreLocked(f"another FeatureStoreWriter holds {self.root}: {e.__cause__}") from e

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _open_store(self) -> None:
        manifest = _read_manifest(self.root)
        fresh = manifest is None
        if manifest is None:
            manifest = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "dtype": self.dtype,
                "meta": self.meta,
                "aux_layer_ids": self.meta.get("aux_layer_ids"),
                "hidden_size": self.meta.get("hidden_size"),
                "num_aux": (
                    len(self.meta["aux_layer_ids"]) if isinstance(self.meta.get("aux_layer_ids"), list) else None
                ),
                "num_samples": 0,
                "total_tokens": 0,
                "total_loss_tokens": 0,
                "shards": [],
            }
        else:
            if manifest.get("meta") != self.meta:
                raise StoreMismatch(self._meta_diff_message(manifest.get("meta") or {}))
            if manifest.get("dtype") != self.dtype:
                raise StoreMismatch(
                    f"store at {self.root} holds dtype {manifest.get('dtype')!r}, writer asked for {self.dtype!r}"
                )
        self._manifest = manifest
        self._committed: set[str] = {s["sample_id"] for sh in manifest["shards"] for s in sh["samples"]}
        listed = {sh["file"] for sh in manifest["shards"]}
        self._cleanup(listed)
        indices = [i for i in (_shard_index(f) for f in listed) if i is not None]
        self._next_shard = max(indices, default=-1) + 1
        if fresh:  # record meta now, so even a crash before the first flush leaves a valid, typed store
            try:
                self._write_manifest(manifest)
            except OSError as e:
                raise StoreWriteError(f"cannot write {self.root / MANIFEST_NAME}: {e}") from e

    def _meta_diff_message(self, stored: dict[str, Any]) -> str:
        keys = sorted(set(stored) | set(self.meta))
        diffs = [
            f"{k!r}: store has {stored.get(k, '<missing>')!r}, writer has {self.meta.get(k, '<missing>')!r}"
            for k in keys
            if stored.get(k, _MISSING) != self.meta.get(k, _MISSING)
        ]
        return (
            f"store at {self.root} was written with different meta; refusing to mix features "
            f"(use a new root): " + "; ".join(diffs)
        )

    def _cleanup(self, listed: set[str]) -> None:
        """Remove what a crash can leave behind: temp files and shards the manifest never recorded."""
        for p in self.root.iterdir():
            name = p.name
            stray_tmp = (
                name.startswith(".")
                and name.endswith(".tmp")
                and (name.startswith(f".{SHARD_PREFIX}") or name == f".{MANIFEST_NAME}.tmp")
            )
            unlisted = _shard_index(name) is not None and name not in listed
            if (stray_tmp or unlisted) and p.is_file():
                p.unlink(missing_ok=True)

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        data = json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode("utf-8")
        atomic_write(self.root / MANIFEST_NAME, data)

    # -- public API -------------------------------------------------------------------------------

    def __enter__(self) -> FeatureStoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        # The body failed: keep complete buffered samples if we can, but never mask the real error.
        try:
            if not isinstance(exc, StoreWriteError):
                self.flush()
        except Exception as flush_exc:
            warnings.warn(f"could not flush feature store while handling {exc!r}: {flush_exc}", stacklevel=2)
        finally:
            self._closed = True
            self._release_lock()

    @property
    def num_committed(self) -> int:
        return len(self._committed)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def has(self, sample_id: str) -> bool:
        """True if `sample_id` is committed (or buffered by this writer): the resume check for reruns."""
        return sample_id in self._committed or sample_id in self._pending_ids

    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux_hidden_states: Sequence[torch.Tensor] | torch.Tensor,
        hidden_state: torch.Tensor,
    ) -> bool:
        """Buffer one sample; True if accepted, False if its id exists or any feature is NaN/Inf.

        ``aux_hidden_states`` is a sequence of ``[T, H]`` tensors, a ``[T, n, H]`` tensor, or the
        concatenated ``[T, n*H]`` layout SpecForge uses; a leading batch dim of 1 is dropped.
        Non-finite samples are never stored: one NaN in a teacher target poisons a training run.
        """
        if self._closed:
            raise RuntimeError("FeatureStoreWriter is closed")
        if not isinstance(sample_id, str) or not sample_id:
            raise ValueError(f"sample_id must be a non-empty str, got {sample_id!r}")
        if self.has(sample_id):
            self.skipped_existing += 1
            return False

        ids, mask, aux, hidden = self._normalise_shapes(input_ids, loss_mask, aux_hidden_states, hidden_state)
        t = ids.shape[0]

        if self.dtype == "bf16":
            aux_s = _own_cpu(aux, torch.bfloat16)
            hidden_s = _own_cpu(hidden, torch.bfloat16)
            # Checked after the cast so values that overflow bf16 are caught too.
            finite = bool(torch.isfinite(aux_s).all()) and bool(torch.isfinite(hidden_s).all())
            tensors = {"aux": aux_s, "hidden": hidden_s}
        else:
            finite = bool(torch.isfinite(aux).all()) and bool(torch.isfinite(hidden).all())
            tensors = {}
            if finite:
                # Quantise where the features live (GPU during capture), then move half the bytes.
                aux_q, aux_scale = _quantize_fp8(aux.detach())
                hid_q, hid_scale = _quantize_fp8(hidden.detach())
                parts = {"aux": aux_q, "aux_scale": aux_scale, "hidden": hid_q, "hidden_scale": hid_scale}
                tensors = {k: v.cpu() for k, v in parts.items()}  # freshly allocated: no aliasing
        if not finite:
            self.rejected_nonfinite += 1
            return False

        tensors["input_ids"] = _own_cpu(ids, torch.int32)
        tensors["loss_mask"] = _own_cpu(mask != 0, torch.uint8)
        loss_tokens = int(tensors["loss_mask"].sum())

        self._pending.append((sample_id, tensors, t, loss_tokens))
        self._pending_ids.add(sample_id)
        self._pending_bytes += sum(x.nbytes for x in tensors.values())
        if self._pending_bytes >= self.shard_max_bytes or (
            self.flush_every is not None and len(self._pending) >= self.flush_every
        ):
            self.flush()
        return True

    def _normalise_shapes(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux_hidden_states: Sequence[torch.Tensor] | torch.Tensor,
        hidden_state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept the common capture layouts; fail loudly on anything inconsistent."""
        ids = input_ids.squeeze(0) if input_ids.dim() == 2 and input_ids.shape[0] == 1 else input_ids
        mask = loss_mask.squeeze(0) if loss_mask.dim() == 2 and loss_mask.shape[0] == 1 else loss_mask
        hidden = hidden_state
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            hidden = hidden.squeeze(0)
        if ids.dim() != 1 or mask.shape != ids.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} must both be [T]")
        t = ids.shape[0]
        if t == 0:
            raise ValueError("empty sample (T=0)")
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor, got {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) > torch.iinfo(torch.int32).max:
            raise ValueError("input_ids must be non-negative and fit in int32 (they are stored as int32)")
        if hidden.dim() != 2 or hidden.shape[0] != t:
            raise ValueError(f"hidden_state must be [T={t}, H], got {tuple(hidden_state.shape)}")
        h = hidden.shape[1]

        if isinstance(aux_hidden_states, torch.Tensor):
            aux = aux_hidden_states
            if aux.dim() == 4 and aux.shape[0] == 1:
                aux = aux.squeeze(0)
            if aux.dim() == 2 and aux.shape[1] % h == 0:  # concatenated [T, n*H]
                aux = aux.reshape(aux.shape[0], aux.shape[1] // h, h)
        else:
            parts = [a.squeeze(0) if a.dim() == 3 and a.shape[0] == 1 else a for a in aux_hidden_states]
            if not parts or any(p.shape != (t, h) for p in parts):
                raise ValueError(f"each aux hidden state must be [T={t}, H={h}], got {[tuple(p.shape) for p in parts]}")
            aux = torch.stack(parts, dim=1)
        if aux.dim() != 3 or aux.shape[0] != t or aux.shape[2] != h:
            raise ValueError(f"aux_hidden_states must be [T={t}, n, H={h}], got {tuple(aux.shape)}")

        n = aux.shape[1]
        m = self._manifest
        if m.get("hidden_size") is None:
            m["hidden_size"] = h
        if m.get("num_aux") is None:
            m["num_aux"] = n
        if h != m["hidden_size"]:
            raise ValueError(f"hidden size {h} differs from the store's {m['hidden_size']}")
        if n != m["num_aux"]:
            raise ValueError(f"{n} aux hidden states, but the store holds {m['num_aux']} per token")
        return ids, mask, aux, hidden

    def flush(self) -> None:
        """Write buffered samples as one new shard, then commit it to the manifest.

        On OSError the manifest on disk is untouched, the buffer is kept (so ``flush()`` can be retried
        after freeing space) and ``StoreWriteError`` is raised.
        """
        if not self._pending:
            return
        name = f"{SHARD_PREFIX}{self._next_shard:05d}{SHARD_SUFFIX}"
        tensors: dict[str, torch.Tensor] = {}
        records: list[dict[str, Any]] = []
        for j, (sid, parts, t, loss_tokens) in enumerate(self._pending):
            for key, x in parts.items():
                tensors[f"{j}.{key}"] = x
            records.append({"sample_id": sid, "length": t, "loss_tokens": loss_tokens})
        header = {
            "format": FORMAT_NAME,
            "version": str(FORMAT_VERSION),
            "dtype": self.dtype,
            "sample_ids": json.dumps([r["sample_id"] for r in records]),
        }
        data = _st_save(tensors, metadata=header)
        entry = {
            "file": name,
            "sha256": hashlib.sha256(data).hexdigest(),
            "bytes": len(data),
            "num_samples": len(records),
            "num_tokens": sum(r["length"] for r in records),
            "samples": records,
        }
        old = self._manifest
        new = {
            **old,
            "shards": [*old["shards"], entry],
            "num_samples": old["num_samples"] + len(records),
            "total_tokens": old["total_tokens"] + entry["num_tokens"],
            "total_loss_tokens": old["total_loss_tokens"] + sum(r["loss_tokens"] for r in records),
        }
        try:
            atomic_write(self.root / name, data)  # the shard is durable before anything points at it
            self._write_manifest(new)
        except OSError as e:
            raise StoreWriteError(
                f"could not write {name} to {self.root} ({e}); the manifest still lists "
                f"{len(old['shards'])} shards / {old['num_samples']} samples, and the {len(records)} "
                f"buffered samples are kept so flush() can be retried"
            ) from e
        self._manifest = new
        self._committed.update(r["sample_id"] for r in records)
        self.written += len(records)
        self._next_shard += 1
        self._pending.clear()
        self._pending_ids.clear()
        self._pending_bytes = 0

    def close(self) -> None:
        """Flush the remainder and release the writer lock; idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._release_lock()


# --------------------------------------------------------------------------------------------------
# Reader


class FeatureStore:
    """Read-only view of a committed store: random access, verification, bounded-memory shuffling.

    Samples come back as dicts: ``input_ids`` int64 ``[T]``, ``loss_mask`` bool ``[T]``,
    ``aux_hidden_states`` ``[T, n, H]`` and ``hidden_state`` ``[T, H]`` in ``out_dtype`` (fp8 stores are
    dequantised), plus ``sample_id`` (str).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        out_dtype: torch.dtype = torch.bfloat16,
        verify_on_open: bool = True,
    ) -> None:
        self.root = Path(root)
        manifest = _read_manifest(self.root)
        if manifest is None:
            raise FileNotFoundError(
                f"no {MANIFEST_NAME} in {self.root}: not a feature store (or nothing was ever written)"
            )
        if manifest.get("dtype") not in _DTYPES:
            raise StoreCorrupt(f"{self.root / MANIFEST_NAME}: unknown dtype {manifest.get('dtype')!r}")
        self.manifest = manifest
        self.out_dtype = out_dtype
        self.verify_on_open = verify_on_open
        self._verified: set[str] = set()
        self._locs: list[tuple[int, int]] = []
        self._sample_ids: list[str] = []
        self._lengths: list[int] = []
        for si, shard in enumerate(manifest["shards"]):
            for j, rec in enumerate(shard["samples"]):
                self._locs.append((si, j))
                self._sample_ids.append(rec["sample_id"])
                self._lengths.append(int(rec["length"]))
        self._index = {sid: i for i, sid in enumerate(self._sample_ids)}

    # -- metadata ---------------------------------------------------------------------------------

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

    @property
    def dtype(self) -> StoreDtype:
        return self.manifest["dtype"]

    @property
    def shards(self) -> list[dict[str, Any]]:
        return self.manifest["shards"]

    @property
    def sample_ids(self) -> list[str]:
        return list(self._sample_ids)

    @property
    def lengths(self) -> list[int]:
        """Per-sample T, in index order (for length-bucketed batching without touching shards)."""
        return list(self._lengths)

    @property
    def total_tokens(self) -> int:
        return int(self.manifest["total_tokens"])

    @property
    def total_loss_tokens(self) -> int:
        return int(self.manifest["total_loss_tokens"])

    @property
    def hidden_size(self) -> int | None:
        return self.manifest.get("hidden_size")

    @property
    def num_aux(self) -> int | None:
        return self.manifest.get("num_aux")

    @property
    def bytes_on_disk(self) -> int:
        return sum(int(s["bytes"]) for s in self.shards)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_on_disk / self.total_tokens if self.total_tokens else 0.0

    def __len__(self) -> int:
        return len(self._sample_ids)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._index

    def index_of(self, sample_id: str) -> int:
        return self._index[sample_id]

    def check_meta(self, expected: dict[str, Any], keys: Sequence[str], force: bool = False) -> list[str]:
        """Refuse to train on features captured under another target/tokenizer/layer choice.

        Raises ``StoreMismatch`` naming the first differing key and both values; with ``force`` it warns
        instead. Returns the differing keys.
        """
        stored = self.meta
        diffs: list[str] = []
        for key in keys:
            have = stored.get(key, _MISSING)
            want = _normalise_json(expected[key]) if key in expected else _MISSING
            if have == want:
                continue
            diffs.append(key)
            show = lambda v: "<missing>" if v is _MISSING else repr(v)
            msg = f"store meta {key!r} is {show(have)} but expected {show(want)} ({self.root})"
            if not force:
                raise StoreMismatch(msg)
            warnings.warn(f"{msg}; continuing because force=True", stacklevel=2)
        return diffs

    # -- integrity --------------------------------------------------------------------------------

    def _verify_shard(self, si: int) -> None:
        shard = self.shards[si]
        path = self.root / shard["file"]
        if not path.is_file():
            raise StoreCorrupt(f"shard {shard['file']} is missing from {self.root}")
        size = path.stat().st_size
        if size != shard["bytes"]:
            raise StoreCorrupt(f"shard {shard['file']} has {size} bytes, manifest says {shard['bytes']}")
        digest = sha256_file(path)
        if digest != shard["sha256"]:
            raise StoreCorrupt(f"shard {shard['file']} sha256 mismatch: file {digest}, manifest {shard['sha256']}")
        self._verified.add(shard["file"])

    def verify(self) -> None:
        """sha256 every shard against the manifest; raises StoreCorrupt naming the first bad shard."""
        for si in range(len(self.shards)):
            self._verify_shard(si)

    def _ensure_verified(self, si: int, verify: bool) -> None:
        if verify and self.shards[si]["file"] not in self._verified:
            self._verify_shard(si)

    # -- access -----------------------------------------------------------------------------------

    def _read(self, handle: Any, j: int, sample_id: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sample_id": sample_id,
            "input_ids": handle.get_tensor(f"{j}.input_ids").to(torch.int64),
            "loss_mask": handle.get_tensor(f"{j}.loss_mask").to(torch.bool),
        }
        if self.dtype == "fp8":
            out["aux_hidden_states"] = _dequantize_fp8(
                handle.get_tensor(f"{j}.aux"), handle.get_tensor(f"{j}.aux_scale"), self.out_dtype
            )
            out["hidden_state"] = _dequantize_fp8(
                handle.get_tensor(f"{j}.hidden"), handle.get_tensor(f"{j}.hidden_scale"), self.out_dtype
            )
        else:
            out["aux_hidden_states"] = handle.get_tensor(f"{j}.aux").to(self.out_dtype)
            out["hidden_state"] = handle.get_tensor(f"{j}.hidden").to(self.out_dtype)
        return out

    def get(self, i: int) -> dict[str, Any]:
        """Sample `i` (in manifest order); the shard is verified on first touch if verify_on_open."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range for store of {n}")
        si, j = self._locs[i]
        self._ensure_verified(si, self.verify_on_open)
        with safe_open(str(self.root / self.shards[si]["file"]), framework="pt") as handle:
            return self._read(handle, j, self._sample_ids[i])

    __getitem__ = get

    def get_by_id(self, sample_id: str) -> dict[str, Any]:
        return self.get(self._index[sample_id])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Sequential pass in manifest order, one shard open at a time."""
        for si, shard in enumerate(self.shards):
            self._ensure_verified(si, self.verify_on_open)
            with safe_open(str(self.root / shard["file"]), framework="pt") as handle:
                for j, rec in enumerate(shard["samples"]):
                    yield self._read(handle, j, rec["sample_id"])

    def iter_shuffled(
        self, seed: int, buffer_shards: int = 2, *, verify: bool | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every sample exactly once, in a seed-determined random order, with bounded memory.

        Shards are visited in shuffled order with at most ``buffer_shards`` open at once; each draw picks
        an open shard with probability proportional to its remaining samples (so the interleave is
        uniform), then a random remaining sample in it. Only that sample's tensors are read. This is a
        local shuffle: a larger ``buffer_shards`` mixes more widely. Shards are sha256-verified the
        first time this reader opens them unless ``verify=False`` (default: ``verify_on_open``).
        """
        if buffer_shards < 1:
            raise ValueError("buffer_shards must be >= 1")
        do_verify = self.verify_on_open if verify is None else verify
        rng = random.Random(seed)
        order = list(range(len(self.shards)))
        rng.shuffle(order)
        pending_shards = iter(order)
        # Each open slot: (stack owning the handle, handle, shard index, remaining sample positions).
        open_slots: list[tuple[contextlib.ExitStack, Any, int, list[int]]] = []

        def open_next() -> bool:
            for si in pending_shards:
                samples = self.shards[si]["samples"]
                if not samples:
                    continue
                self._ensure_verified(si, do_verify)
                stack = contextlib.ExitStack()
                path = str(self.root / self.shards[si]["file"])
                handle = stack.enter_context(safe_open(path, framework="pt"))
                remaining = list(range(len(samples)))
                rng.shuffle(remaining)
                open_slots.append((stack, handle, si, remaining))
                return True
            return False

        try:
            while len(open_slots) < buffer_shards and open_next():
                pass
            while open_slots:
                weights = [len(slot[3]) for slot in open_slots]
                k = rng.choices(range(len(open_slots)), weights=weights)[0]
                stack, handle, si, remaining = open_slots[k]
                j = remaining.pop()
                yield self._read(handle, j, self.shards[si]["samples"][j]["sample_id"])
                if not remaining:
                    open_slots.pop(k)
                    stack.close()
                    open_next()
        finally:
            for stack, *_ in open_slots:
                stack.close()

    def shard_of(self, i: int) -> str:
        """File name of the shard holding sample `i` (diagnostics)."""
        return self.shards[self._locs[i][0]]["file"]
