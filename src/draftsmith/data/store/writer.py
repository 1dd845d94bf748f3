"""Append samples to a feature store, crash-safely and exactly once (see the package docstring)."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as _st_save

from draftsmith.core.io import ExclusiveLock, LockHeld, atomic_write
from draftsmith.data.store.format import (
    _DTYPES,
    _MISSING,
    DEFAULT_SHARD_MAX_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    LOCK_NAME,
    MANIFEST_NAME,
    SHARD_PREFIX,
    SHARD_SUFFIX,
    StoreDtype,
    StoreLocked,
    StoreMismatch,
    StoreWriteError,
    _normalise_json,
    _quantize_fp8,
    _read_manifest,
    _shard_index,
)


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
            raise StoreLocked(f"another FeatureStoreWriter holds {self.root} ({self.root / LOCK_NAME} is locked); "
                              "wait for it to finish or choose another --out") from e

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
