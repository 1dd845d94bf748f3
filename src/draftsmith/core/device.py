"""The one reading of ``--device``: ``auto`` (CUDA when this torch sees a GPU, else the CPU), ``cpu``, ``cuda``,
``cuda:N``. Every command and every library entry point that places a model resolves its device here, so a bad
spelling or a GPU this build cannot see is one line, not a traceback deep inside a loader."""

from __future__ import annotations

from draftsmith.core.errors import UsageError

DEVICE_HELP = "auto (default: CUDA when this torch sees a GPU, else cpu), cpu, cuda, cuda:N"


class DeviceError(UsageError):
    """A --device this machine or this torch build cannot run on."""


def resolve_device(spec: object = "auto") -> str:
    """``spec`` (a string, a torch.device, or None for auto) as a concrete device string (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``), checked against this machine."""
    import torch  # here, not at the top: the CLI's --help reads DEVICE_HELP without loading torch

    text = "auto" if spec is None else str(spec).strip().lower()
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise DeviceError(f"--device {spec!r}: expected {DEVICE_HELP}") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise DeviceError(f"--device {spec!r}: draftsmith runs on cpu or cuda ({DEVICE_HELP})")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "a CUDA build that sees no GPU"
        raise DeviceError(f"--device {spec}: this torch ({torch.__version__}) is {build}; use --device cpu or auto, "
                          "or install a CUDA build of torch")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceError(f"--device {spec}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
    return str(device)
