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

from draftsmith.data.store.format import (
    DEFAULT_SHARD_MAX_BYTES,
    FORMAT_NAME,
    FORMAT_VERSION,
    LOCK_NAME,
    MANIFEST_NAME,
    SHARD_PREFIX,
    SHARD_SUFFIX,
    StoreCorrupt,
    StoreDtype,
    StoreError,
    StoreLocked,
    StoreMismatch,
    StoreWriteError,
    estimate_bytes_per_token,
)
from draftsmith.data.store.identity import MATCH_KEYS, check_store_identity, check_store_matches_target
from draftsmith.data.store.reader import FeatureStore
from draftsmith.data.store.writer import FeatureStoreWriter

__all__ = [
    "DEFAULT_SHARD_MAX_BYTES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "MATCH_KEYS",
    "SHARD_PREFIX",
    "SHARD_SUFFIX",
    "FeatureStore",
    "FeatureStoreWriter",
    "StoreCorrupt",
    "StoreDtype",
    "StoreError",
    "StoreLocked",
    "StoreMismatch",
    "StoreWriteError",
    "check_store_identity",
    "check_store_matches_target",
    "estimate_bytes_per_token",
]
