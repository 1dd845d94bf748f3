"""The target's weight files: present and whole, truncated, metadata-only, pickle-only, or absent.

The rule (issues 40 and 44):
- a present shard that is truncated or has an unreadable header is an error (the load fails after minutes);
- a safetensors index whose shards are all absent is a metadata-only copy (``hf download --include "*.json"``):
  everything else is checked and a note says the weights were not; a local folder missing only some shards is an
  error (an engine loads what is there), a hub snapshot missing some is a note (the engine downloads the rest);
- no safetensors and no index: a local folder is an error (nothing can load it; a metadata copy keeps the index),
  a hub id is checked against the hub's headers (online) or the cached repo listing, else a note;
- pickle-only weights (``pytorch_model*.bin``): vLLM and SGLang load them, draftsmith never unpickles, so the
  severity follows the engine checked.
"""

from __future__ import annotations

import json
import os
from fnmatch import fnmatch
from pathlib import Path

from draftsmith.core.tensorfile import read_safetensors_header
from draftsmith.stages.doctor.hub import HubModel
from draftsmith.stages.doctor.report import Findings

INDEX = "model.safetensors.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")


def check_weight_files(out: Findings, which: str, path: Path, engine: str, hub: HubModel | None = None) -> None:
    """Classify the weight files of a model folder (a hub snapshot when ``hub``) and report what a load would meet."""
    index = path / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            out.add(f"{which}.weights", "error", f"the {which}'s {INDEX} cannot be read: {e}", str(index),
                    "copy the index again from the model's release")
            return
        outside = [s for s in shards if not isinstance(s, str) or not _inside(path, s)]
        if outside:
            out.add(f"{which}.weights", "error", f"the {which}'s {INDEX} names shard files outside its folder: "
                    f"{', '.join(map(repr, outside[:3]))}; engines load shards from the folder only",
                    f"{index}: weight_map", "copy the index again from the model's release")
            return
        _check_shards(out, which, path, shards, hub)
        return
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if files:
        _check_shards(out, which, path, files, hub)
        return
    pickles = sorted(p.name for p in path.iterdir() if any(fnmatch(p.name, pat) for pat in PICKLE_PATTERNS))
    if pickles:
        _pickle_only(out, which, engine, pickles, "here")
    elif hub is not None:
        _hub_without_local_weights(out, which, engine, hub)
    else:
        out.add(f"{which}.weights", "error", f"the {which} folder holds no weights: no model.safetensors, no "
                f"{INDEX}, no *.safetensors: no engine can load it (a metadata-only copy keeps {INDEX}, then "
                "doctor checks everything but the weights)", f"{path}: config.json without weights or index",
                "copy the weights, or download the metadata with the index (hf download ORG/NAME --include "
                '"*.json" "tokenizer*"), or pass the hub id ORG/NAME instead of the folder')


def _inside(folder: Path, name: str) -> bool:
    """``name`` stays in ``folder`` (lexically: a hub snapshot's files are symlinks into the cache's blobs)."""
    base = os.path.normpath(folder)
    return os.path.normpath(os.path.join(base, name)).startswith(base + os.sep)


def _check_shards(out: Findings, which: str, path: Path, shards: list[str], hub: HubModel | None) -> None:
    present = [s for s in shards if (path / s).is_file()]
    absent = [s for s in shards if s not in present]
    bad = []
    for name in present:
        f = path / name
        try:
            end = max((t.end for t in read_safetensors_header(f).values()), default=0)
        except (OSError, ValueError) as e:
            bad.append(f"{name}: unreadable header ({e})")
            continue
        if end > f.stat().st_size:
            bad.append(f"{name}: truncated ({f.stat().st_size} bytes, its header needs {end})")
    if bad:
        out.add(f"{which}.weights", "error", f"the {which}'s weights cannot be loaded: {'; '.join(bad[:3])}",
                str(path), "copy the file again (a download or copy was cut short)")
    if not absent:
        return
    listed = f"{len(absent)} of the {len(shards)} shard(s) {INDEX} names ({', '.join(absent[:2])}" + (
        ", ...)" if len(absent) > 2 else ")")
    if hub is None and present:
        out.add(f"{which}.weights", "error", f"{listed} are missing: an interrupted copy or download; the load "
                "fails on the first missing one", f"{path}: {INDEX}", "copy the missing shards")
        return
    where = "the hub snapshot" if hub is not None else "this folder"
    headers = _remote_summary(hub)
    out.note(f"{which} weights not checked: {listed} are not in {where} (a metadata-only download); config, "
             f"tokenizer and index were checked{headers}" + (
                 "" if hub is not None else "; an engine loading this folder needs the shards"))


def _remote_summary(hub: HubModel | None) -> str:
    if hub is None or not hub.remote_headers:
        return ""
    n = sum(len(h) for h in hub.remote_headers.values())
    return f"; the hub's safetensors headers were read ({len(hub.remote_headers)} file(s), {n} tensors)"


def _pickle_only(out: Findings, which: str, engine: str, files: list[str], where: str) -> None:
    """vLLM/SGLang unpickle .bin checkpoints; draftsmith's own capture, training and decode never do."""
    sev = "error" if engine == "draftsmith" else "warning"
    loads = ("draftsmith never unpickles: its capture, online training and decode refuse this target" if
             engine == "draftsmith" else f"{engine} loads them (unpickling: only from a source you trust), but "
             "draftsmith's own capture, online training and decode never unpickle and refuse this target")
    out.add(f"{which}.pickle-weights", sev, f"the {which}'s weights are pickle only ({', '.join(files[:3])} "
            f"{where}, no safetensors): {loads}", f"{', '.join(files[:3])}",
            "convert them to safetensors once, where you trust the file (save_pretrained(..., "
            "safe_serialization=True)), or use the model's safetensors release")


def _hub_without_local_weights(out: Findings, which: str, engine: str, hub: HubModel) -> None:
    """A hub snapshot with neither weights nor index here: ask the hub's headers, else the cached repo listing."""
    if hub.remote_headers:
        n = sum(len(h) for h in hub.remote_headers.values())
        out.note(f"{which} weights not downloaded: the hub's safetensors headers were read "
                 f"({', '.join(sorted(hub.remote_headers)[:2])}: {n} tensors); the tensor data was not checked")
        return
    files = hub.repo_files
    if files is None:
        why = ("the hub has no model.safetensors or index for it" if hub.remote_headers == {} else
               f"the cache holds no weights or {INDEX} for it and no listing of the repository, so doctor cannot "
               "tell offline which weights it has (rerun without HF_HUB_OFFLINE to read the hub's headers)")
        out.note(f"{which} weights not checked: {why}")
        return
    safetensors = [f for f in files if f.endswith(".safetensors")]
    pickles = [f for f in files if any(fnmatch(f, pat) for pat in PICKLE_PATTERNS)]
    if safetensors:
        out.note(f"{which} weights not checked: the repository has {', '.join(safetensors[:2])}"
                 f"{' ...' if len(safetensors) > 2 else ''}, not downloaded here")
    elif pickles:
        _pickle_only(out, which, engine, pickles, "in the repository")
    else:
        out.add(f"{which}.weights", "error", f"the repository {hub.ref} holds no weights (no *.safetensors, "
                "no pytorch_model*.bin): no engine can load it", f"repository listing: {len(files)} files",
                "check the model id (a base model or a GGUF-only repository?)")


__all__ = ["INDEX", "check_weight_files"]
