"""``export --push-to-hub REPO``: upload an export folder (weights, config, model card) with huggingface_hub.

The token comes from the environment (``HF_TOKEN``, or the login huggingface_hub keeps); none is read or
stored here. huggingface_hub's HTTP client has no timeout by default, so the upload runs under a client that has
one (connect and read), restored afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from draftsmith.stages.export.card import CARD_FILE, CARD_JSON
from draftsmith.stages.export.checkpoint import ExportError

#: Seconds to connect, and to wait for any one read or write, during an upload.
CONNECT_TIMEOUT_S, IO_TIMEOUT_S = 10.0, 120.0


@contextlib.contextmanager
def hub_timeouts(connect: float = CONNECT_TIMEOUT_S, io: float = IO_TIMEOUT_S) -> Iterator[None]:
    """huggingface_hub's shared HTTP client with a timeout on every call, for the duration of the block."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    http = _http_library()

    def factory():
        return http.Client(event_hooks={"request": [_http.hf_request_event_hook]}, follow_redirects=True,
                           timeout=http.Timeout(io, connect=connect))

    set_client_factory(factory)
    try:
        yield
    finally:
        set_client_factory(_http.default_client_factory)


def _http_library():
    """The HTTP library huggingface_hub itself uses: httpx2 from its 2.x releases, httpx before (1.x, which the
    oldest transformers this package supports brings)."""
    from huggingface_hub.utils import _http

    return getattr(_http, "httpx2", None) or _http.httpx


def hub_repo(repo_id: str):
    """``repo_id`` as a hub reference, or ExportError: export checks it before writing (the id goes into the card's
    serve lines), and an empty one is no way to skip the push."""
    from draftsmith.stages.doctor.hub import parse_hub_id

    ref = parse_hub_id(repo_id) if repo_id else None
    if ref is None or ref.revision:
        raise ExportError(f"--push-to-hub {repo_id!r}: give a hub repo id, ORG/NAME")
    return ref


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool | None = None,
                commit_message: str | None = None) -> str:
    """Create ``repo_id`` (a model repo; kept if it exists) and upload ``folder``; returns the commit's URL."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    ref = hub_repo(repo_id)
    if not (folder / CARD_FILE).is_file() or not (folder / CARD_JSON).is_file():
        raise ExportError(f"{folder}: no model card to push (export writes {CARD_FILE} and {CARD_JSON})")
    from huggingface_hub.errors import HfHubHTTPError

    http = _http_library()

    api = HfApi()
    try:
        with hub_timeouts():
            api.create_repo(ref.repo_id, repo_type="model", private=private, exist_ok=True)
            info = api.upload_folder(repo_id=ref.repo_id, folder_path=str(folder), repo_type="model",
                                     commit_message=commit_message or "draftsmith export",
                                     ignore_patterns=[".*", "*.tmp"])
    except (HfHubHTTPError, http.HTTPError, OSError) as e:
        msg = " ".join(str(e).split())[:300]
        raise ExportError(f"--push-to-hub {ref.repo_id}: upload failed ({type(e).__name__}: {msg}); the export "
                          f"in {folder} is complete, rerun the push when the hub is reachable") from None
    return str(getattr(info, "commit_url", info))
