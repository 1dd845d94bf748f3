"""The ingest side of engine capture: per-request spool files in, store samples out, exactly once.

The engine (``integrations/vllm_capture_worker.py``) writes one safetensors file per prefill, named by a hash of
its token ids (``spool_key``), atomically (temp file, fsync, rename). Ingest reads a file, checks it against the
sample it should hold (the very token ids, ``[T, n, H]`` aux, ``[T, H]`` final state, finite), hands it to the
store's writer, and deletes it only once the shard holding that sample is committed. A ``kill -9`` anywhere
leaves: committed samples (skipped on rerun by ``has()``), spool files not yet committed (re-ingested without
running the engine again), and temp files (removed). So every sample lands in the store exactly once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from draftsmith.core.errors import DraftsmithError
from draftsmith.data.store import FeatureStoreWriter
from draftsmith.integrations.vllm import spool_key

SPOOL_SUFFIX = ".safetensors"

__all__ = ["SPOOL_SUFFIX", "Spool", "SpoolCorrupt", "spool_key"]


class SpoolCorrupt(DraftsmithError):
    """A spool file that does not hold what its name promises (moved aside to ``*.corrupt``; rerun to recompute)."""


class Spool:
    """One spool directory tied to one store writer: which files exist, reading them, releasing them."""

    def __init__(self, root: str | Path, writer: FeatureStoreWriter) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.writer = writer
        self.unreleased: list[Path] = []  # files whose samples are added but maybe not yet committed
        self.released = 0
        for tmp in self.root.glob("*.tmp"):  # an engine killed mid-write; the store lock says no engine runs now
            tmp.unlink(missing_ok=True)

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SPOOL_SUFFIX}"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def read(self, key: str, ids: list[int], num_aux: int, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(aux [T, n, H], hidden [T, H])`` of the prefill of ``ids``; SpoolCorrupt if the file disagrees."""
        from safetensors import SafetensorError, safe_open

        path = self.path(key)
        try:
            with safe_open(str(path), framework="pt") as f:
                got = {k: f.get_tensor(k) for k in ("input_ids", "aux", "hidden")}
        except (SafetensorError, OSError, KeyError, ValueError) as e:
            self._refuse(path, f"unreadable ({type(e).__name__}: {e})")
        t = len(ids)
        if got["input_ids"].tolist() != list(ids):
            self._refuse(path, f"holds other token ids than the {t} of its sample")
        if tuple(got["aux"].shape) != (t, num_aux, hidden_size) or tuple(got["hidden"].shape) != (t, hidden_size):
            self._refuse(path, f"aux {tuple(got['aux'].shape)} / hidden {tuple(got['hidden'].shape)}, expected "
                               f"({t}, {num_aux}, {hidden_size}) / ({t}, {hidden_size})")
        return got["aux"], got["hidden"]

    def _refuse(self, path: Path, why: str):
        corrupt = path.with_suffix(".corrupt")
        path.replace(corrupt)
        raise SpoolCorrupt(f"spool file {path.name}: {why}; moved to {corrupt}, rerun to recompute it")

    def added(self, key: str) -> None:
        """Every sample of ``key`` is in the writer: release its file once the writer's buffer is committed."""
        self.unreleased.append(self.path(key))
        if self.writer.num_pending == 0:  # the add just flushed a shard: everything added so far is committed
            self.release()

    def release(self) -> None:
        """Delete the files of committed samples (call only when the writer has nothing pending)."""
        for p in self.unreleased:
            p.unlink(missing_ok=True)
            self.released += 1
        self.unreleased.clear()

    def clear(self) -> None:
        """After the writer's last commit: every spool file is committed or belongs to a skipped sample."""
        self.release()
        for p in self.root.glob(f"*{SPOOL_SUFFIX}"):
            p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # *.corrupt files, or a foreign file: leave them for the user
            self.root.rmdir()
