"""bench/gpu_check.sh: its bundle steps (pieces carried over two calls, reassembled, checksummed), and its CPU dry
run, the same steps as on the GPU box with a tiny budget."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _bundle(tmp_path: Path) -> tuple[Path, Path, bytes]:
    """A bundle as gpu_bundle.sh lays it out: one file cut in two pieces, part1 and part2, each with SHA256SUMS."""
    blob = os.urandom(5000)
    digest = hashlib.sha256(blob).hexdigest()
    first, second = tmp_path / "first" / "part1", tmp_path / "second" / "part2"
    for part, piece in ((first, blob[:3000]), (second, blob[3000:])):
        part.mkdir(parents=True)
        (part / "SHA256SUMS").write_text(f"{digest}  target.whl\n")
        (part / f"target.whl.part-0{0 if part is first else 1}").write_bytes(piece)
    return first.parent, second.parent, blob


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_a_damaged_or_missing_piece_stops_the_check_before_anything_runs(tmp_path):
    first, second, _ = _bundle(tmp_path)
    stash = tmp_path / "stash"
    # the second call without the first call's piece stashed: the reassembled file fails its checksum
    done = _run("--dry-run", BUNDLE=str(second), STASH=str(stash), OUT=str(tmp_path / "out"),
                WORK=str(tmp_path / "work"))
    assert done.returncode == 2 and "fails its checksums" in done.stderr
    assert _run("--stash", BUNDLE=str(first), STASH=str(stash)).returncode == 0
    piece = second / "part2" / "target.whl.part-01"
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    done = _run("--dry-run", BUNDLE=str(second), STASH=str(stash), OUT=str(tmp_path / "out"),
                WORK=str(tmp_path / "work"))
    assert done.returncode == 2 and "fails its checksums" in done.stderr
    assert not (tmp_path / "out" / "gpu_check.json").exists()
    assert _run("--bogus").returncode == 2


@pytest.mark.slow
def test_the_gpu_check_dry_run_runs_end_to_end_on_cpu(tmp_path):
    """Stash the first part (the first call on the box), then the check with the second: the pieces are
    reassembled byte for byte, and generate, online training, bench and the JSON all run."""
    first, second, blob = _bundle(tmp_path)
    stash, out, work = tmp_path / "stash", tmp_path / "out", tmp_path / "work"
    assert _run("--stash", BUNDLE=str(first), STASH=str(stash)).returncode == 0
    done = _run("--dry-run", BUNDLE=str(second), STASH=str(stash), OUT=str(out), WORK=str(work))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (work / "bundle" / "target.whl").read_bytes() == blob
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["mode"] == "dry-run"
    assert [s["stage"] for s in result["stages"]] == ["bundle", "install", "generate", "train", "bench", "done"]
    assert result["train"]["steps"] > 0 and result["train"]["tokens_per_s"] > 0
    assert result["bench"]  # the bench's own JSON, plain decoding and the drafter's shapes
