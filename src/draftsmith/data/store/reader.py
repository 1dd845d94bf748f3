"""Read a committed feature store: random access, verification and bounded-memory shuffling."""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from draftsmith.core.io import sha256_file
from draftsmith.data.store.format import (
    _DTYPES,
    _MISSING,
    MANIFEST_NAME,
    StoreCorrupt,
    StoreDtype,
    StoreMismatch,
    _dequantize_fp8,
    _normalise_json,
    _read_manifest,
)


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

    def verify_all(self) -> None:
        """sha256 every shard this reader has not verified yet, before any is read (readers call it up front).

        The StoreCorrupt names the store, the bad shard and how to recapture just that shard's samples.
        """
        for si, shard in enumerate(self.shards):
            if shard["file"] in self._verified:
                continue
            try:
                self._verify_shard(si)
            except StoreCorrupt as e:
                raise StoreCorrupt(f"{self.root}: {e}; {recapture_advice(shard)}") from e

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


def recapture_advice(shard: dict[str, Any]) -> str:
    """How to recapture only one bad shard: capture resumes, capturing every sample no listed shard holds."""
    return (f"to recapture just its {len(shard['samples'])} samples, delete {shard['file']}, remove its entry from "
            f"{MANIFEST_NAME}'s \"shards\" list (subtracting its num_samples, num_tokens and the loss_tokens of its "
            f"samples from num_samples, total_tokens and total_loss_tokens), then rerun the same `draftsmith capture` "
            f"command, which resumes; or capture again into a new --out")
