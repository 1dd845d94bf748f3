"""Hub ids (``ORG/NAME`` or ``ORG/NAME@REVISION``) resolved to a local folder of metadata files, never weights.

Why: a 25-minute load of a hub model should be checkable before it starts, from what the Hugging Face cache
already holds or from a few kilobytes of the hub. Resolution order (``resolve_hub``):

1. an existing local path wins (the caller reads it as a directory; this module returns None);
2. the local Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``),
   read through ``huggingface_hub`` with ``local_files_only=True``: no network at all;
3. unless ``HF_HUB_OFFLINE`` is set, the hub: the metadata files (``METADATA_PATTERNS``: configs, tokenizer,
   chat template, the safetensors index) are downloaded into that cache, as ``hf download --include`` would, and
   the safetensors headers are read by HTTP range requests. Weights are never downloaded.

A hub id that cannot be resolved is a ``HubResolutionError`` (one line, exit 2) naming the command that fixes it.
The environment is read at call time (``huggingface_hub`` reads it once, at import).

Every hub call runs under a deadline (``hub_timeout``: ``$DRAFTSMITH_HUB_TIMEOUT`` seconds, default 30):
huggingface_hub's repo listing sends its requests with no timeout, so a proxy or captive portal that accepts the
connection and never answers would hang doctor and serve for good. The call runs in a daemon thread, abandoned
(and ended with the process) when the deadline passes; huggingface_hub downloads into ``.incomplete`` files and
renames, so an abandoned download leaves no half file in the snapshot.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from draftsmith.core.tensorfile import TensorInfo
from draftsmith.stages.doctor.report import DoctorUsageError

# What `hf download ORG/NAME --include ...` needs to bring for doctor: configs (config, generation config,
# tokenizer config, safetensors index), tokenizer files and a chat template. No weights match these.
METADATA_PATTERNS = ("*.json", "tokenizer*", "*.jinja", "*.tiktoken", "tokenizer.model", "tiktoken.model",
                     "spiece.model", "merges.txt", "vocab.txt")
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)(?:@(?P<rev>[A-Za-z0-9_./-]+))?$")
_TRUE = {"1", "on", "yes", "true"}
TIMEOUT_ENV = "DRAFTSMITH_HUB_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0  # the metadata files and headers of a model are a few MB: seconds on any working link


class HubResolutionError(DoctorUsageError):
    """A hub id that is neither in the local cache nor reachable: exit code 2, with the download command."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None  # None: the default branch

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class HubModel:
    """A hub id resolved to a local snapshot folder holding (at least) its metadata files."""

    ref: HubRef
    path: Path  # the snapshot folder: config, tokenizer files, index; weights only if the user downloaded them
    commit: str | None  # the snapshot's commit hash
    source: str  # "cache" (no network) or "hub" (metadata fetched now)
    repo_files: tuple[str, ...] | None  # the repo's file listing at that commit where known (huggingface_hub's tree
    #                                     cache, or the listing fetched now); None: unknown offline
    remote_headers: dict[str, dict[str, TensorInfo]] | None  # safetensors headers read from the hub, per file;
    #                                                           {}: the repo has no safetensors; None: not read

    @property
    def label(self) -> str:
        where = "Hugging Face cache" if self.source == "cache" else "hub metadata"
        return f"{self.ref} ({where}, snapshot {self.commit[:12] if self.commit else '?'})"


def parse_hub_id(text: str | Path) -> HubRef | None:
    """``ORG/NAME`` or ``ORG/NAME@REVISION`` -> HubRef; None for anything else (an absolute or ./ path, a bare name)."""
    m = _HUB_ID.match(str(text))
    if m is None or ".." in m["repo"] or m["repo"].endswith((".", "-")) or len(m["repo"]) > 96:  # the hub's limit
        return None
    return HubRef(m["repo"], m["rev"])


def hub_cache_dir(env: dict[str, str] | None = None) -> Path:
    """The cache huggingface_hub writes: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return (env.get("HF_HUB_OFFLINE") or "").strip().lower() in _TRUE


def hub_timeout(env: dict[str, str] | None = None) -> float:
    """Seconds each hub call may take: ``$DRAFTSMITH_HUB_TIMEOUT``, else 30."""
    env = os.environ if env is None else env
    text = (env.get(TIMEOUT_ENV) or "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise HubResolutionError(f"{TIMEOUT_ENV}={text!r}: not a positive number of seconds")
    return value


class HubTimeout(TimeoutError):
    """A hub call that did not finish within ``hub_timeout``."""


def within(seconds: float, call: Callable, *args, **kwargs):
    """``call(*args, **kwargs)``, or HubTimeout after ``seconds``: the call runs in a daemon thread that is
    abandoned then (a socket read cannot be interrupted from outside; the process ends it)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = call(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            box["error"] = e

    worker = threading.Thread(target=run, name="draftsmith-hub-call", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise HubTimeout(f"no answer within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def download_hint(ref: HubRef) -> str:
    rev = f" --revision {ref.revision}" if ref.revision else ""
    return f'hf download {ref.repo_id}{rev} --include "*.json" "tokenizer*"'


def resolve_hub(arg: str | Path, env: dict[str, str] | None = None) -> HubModel | None:
    """``arg`` as a hub model: None when it is an existing local path or no hub id; else the resolved snapshot.

    Raises HubResolutionError when it is a hub id that the cache lacks and offline mode (or the hub) refuses.
    """
    try:
        if Path(arg).expanduser().exists():
            return None
    except OSError as e:  # a component over the file system's name limit (ENAMETOOLONG): not a path, nor an id
        raise HubResolutionError(f"{str(arg)[:80]}...: not a usable path ({e.strerror or e})") from e
    ref = parse_hub_id(arg)
    if ref is None:
        return None
    cache = hub_cache_dir(env)
    found = _from_cache(ref, cache)
    if found is not None:
        return found
    if hub_offline(env):
        raise HubResolutionError(
            f"{ref}: no such local folder, and not in the Hugging Face cache ({cache}) while HF_HUB_OFFLINE is set; "
            f"run `{download_hint(ref)}` (metadata only, no weights) or unset HF_HUB_OFFLINE")
    parent = Path(ref.repo_id).parent
    if parent.is_dir():  # runs/drafterr: a mistyped local path, not a hub id; asking the hub would only add a wait
        raise HubResolutionError(
            f"{arg}: no such local folder ({parent}/ exists here, so this reads as a mistyped path), and not in "
            f"the Hugging Face cache; for the hub model, run `{download_hint(ref)}` first")
    return _from_hub(ref, cache, hub_timeout(env))


def _from_cache(ref: HubRef, cache: Path) -> HubModel | None:
    """The cached snapshot for ``ref`` (no network); None when the cache has no snapshot with a config.json."""
    from huggingface_hub import snapshot_download

    if not cache.is_dir():
        return None
    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache, local_files_only=True,
                                        allow_patterns=list(METADATA_PATTERNS)))
    except (OSError, ValueError) as e:  # LocalEntryNotFoundError is a FileNotFoundError; its subclass
        snap = getattr(e, "snapshot_path", None)  # IncompleteSnapshotError (huggingface_hub >= 2) names the folder:
        folder = Path(snap) if snap else None  # some metadata file was not downloaded, check what is there
    if folder is None or not (folder / "config.json").is_file():
        return None
    return HubModel(ref, folder, folder.name, "cache", _cached_listing(ref, folder.name, cache), None)


def _cached_listing(ref: HubRef, commit: str, cache: Path) -> tuple[str, ...] | None:
    """The repo's file listing at ``commit`` as huggingface_hub cached it on download (>= 1.x); None if absent."""
    try:
        from huggingface_hub import get_cached_repo_tree
    except ImportError:
        return None
    try:
        return tuple(sorted(f.path for f in get_cached_repo_tree(ref.repo_id, revision=commit, cache_dir=cache)))
    except Exception:  # noqa: BLE001 (no listing cached: the caller says the weights were not checked)
        return None


def _from_hub(ref: HubRef, cache: Path, timeout: float = DEFAULT_TIMEOUT_S) -> HubModel:
    """Download the metadata files into the cache and read the safetensors headers by range requests."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        folder = Path(within(timeout, snapshot_download, ref.repo_id, revision=ref.revision, cache_dir=cache,
                             allow_patterns=list(METADATA_PATTERNS), etag_timeout=timeout))
    except HubTimeout as e:
        endpoint = os.environ.get("HF_ENDPOINT") or "the hub"
        raise HubResolutionError(
            f"{ref}: no such local folder, not in the Hugging Face cache, and {endpoint} did not answer within "
            f"{timeout:g} s (a stalled proxy?); set {TIMEOUT_ENV} to wait longer, or run `{download_hint(ref)}` "
            "where the hub answers") from e
    except GatedRepoError as e:
        raise HubResolutionError(f"{ref}: a gated repository: accept its terms on the hub and log in "
                                 f"(hf auth login), then rerun ({_short(e)})") from e
    except RevisionNotFoundError as e:
        raise HubResolutionError(f"{ref}: the hub has no revision {ref.revision!r}") from e
    except RepositoryNotFoundError as e:
        raise HubResolutionError(f"{ref}: no such local folder, and no such model on the hub (or it is private: "
                                 "hf auth login)") from e
    except Exception as e:  # noqa: BLE001 (no connection, hub down: one line, with the offline route)
        raise HubResolutionError(f"{ref}: no such local folder, not in the Hugging Face cache, and the hub cannot "
                                 "be reached "
                                 f"({_short(e)}); run `{download_hint(ref)}` where there is a network") from e
    if not (folder / "config.json").is_file():
        raise HubResolutionError(f"{ref}: the repository has no config.json at its top (not a transformers model)")
    commit = folder.name
    return HubModel(ref, folder, commit, "hub", _cached_listing(ref, commit, cache),
                    _remote_headers(ref.repo_id, commit, folder, timeout))


def _remote_headers(repo_id: str, commit: str, folder: Path,
                    timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, dict[str, TensorInfo]] | None:
    """Each safetensors file's header, read from the hub by HTTP range requests (no tensor data)."""
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError

    try:
        meta = within(timeout, get_safetensors_metadata, repo_id, revision=commit)
    except NotASafetensorsRepoError:
        return {}
    except Exception:  # noqa: BLE001 (headers unreadable now: the weights are reported as not checked)
        return None
    # Offsets relative to the data section: the file is not here, so nothing reads by them (read_small_tensor
    # refuses a file that does not exist).
    return {name: {k: TensorInfo(str(v.dtype), tuple(v.shape), folder / name, int(v.data_offsets[0]),
                                 int(v.data_offsets[1])) for k, v in fm.tensors.items()}
            for name, fm in meta.files_metadata.items()}


def _short(e: BaseException) -> str:
    """The root cause in one short line (huggingface_hub wraps a ConnectError in a paragraph)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"


__all__ = ["METADATA_PATTERNS", "HubModel", "HubRef", "HubResolutionError", "download_hint", "hub_cache_dir",
           "hub_offline", "hub_timeout", "parse_hub_id", "resolve_hub"]
