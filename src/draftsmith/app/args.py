"""What every command shares: the target flags, integer lists, and the one way an error is reported."""

from __future__ import annotations

import argparse
import errno
import math
import sys

from draftsmith.core.device import DEVICE_HELP
from draftsmith.core.errors import DraftsmithError, UsageError, one_line

# Errors that are the user's to fix: one line on stderr, exit code 2. ValueError is there for option values
# that library constructors validate (sampling parameters, draft shapes).
USER_ERRORS = (DraftsmithError, FileNotFoundError, NotADirectoryError, ValueError)


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: ``draftsmith train: error: argument --dtype: invalid choice ...``
    and exit 2, without the usage block (``--help`` has it). No abbreviated flags: ``--co`` for ``--config``
    would reach argparse but not the recipe scanner, which reads argv first, and a prefix that is unique today
    changes meaning when a flag is added."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(ValueError(message))} (see {self.prog} --help)\n")


def finite_float(text) -> float:
    """argparse type of every float option: ``nan`` and ``inf`` parse as floats but make no sense as a budget,
    a size or a probability, and NaN compares false with every bound a later check tests."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


finite_float.base_type = float  # type: ignore[attr-defined]  # what a recipe's TOML value must be (app/recipe.py)


#: draftsmith's environment switches and the values each takes ("" = unset); any other value is refused rather than
#: read as one of them (DRAFTSMITH_COMPILE=false compiled, DRAFTSMITH_DENORMALS=off kept subnormals).
ENV_SWITCHES = {"DRAFTSMITH_COMPILE": ("", "0", "1"), "DRAFTSMITH_DENORMALS": ("", "0", "1")}


def check_env_switches(environ=None) -> None:
    """Each switch set to a value it takes, else one UsageError line naming it."""
    import os

    env = os.environ if environ is None else environ
    for name, allowed in ENV_SWITCHES.items():
        value = env.get(name, "")
        if value not in allowed:
            raise UsageError(f"{name}={value!r}: takes 0 or 1 (or unset)")


def fail(e: BaseException, code: int = 2, then: str = "") -> int:
    """The one way the CLI reports an error: ``draftsmith: error: <message on one line><then>``."""
    print(f"draftsmith: error: {one_line(e)}{then}", file=sys.stderr)
    return code


# OSErrors that are the user's to fix (exit 2): a name over the file system's limit, a file where a folder goes,
# no permission, a read-only disk, not a program. Others (an I/O error, a full disk) exit 1.
_USER_ERRNOS = {errno.ENAMETOOLONG, errno.EACCES, errno.EPERM, errno.EEXIST, errno.EISDIR, errno.ENOTDIR,
                errno.EROFS, errno.ENOEXEC, errno.ELOOP, errno.ENOENT, errno.ENOTEMPTY}


def fail_os(e: OSError) -> int:
    """An OSError no stage turned into its own message: the path (shortened) and the system's reason, one line."""
    name = "" if e.filename is None else str(e.filename)
    if len(name) > 120:
        name = f"{name[:60]}...{name[-40:]}"
    text = f"{name}: {e.strerror}" if name and e.strerror else one_line(e)
    return fail(UsageError(text), 2 if e.errno in _USER_ERRNOS else 1)


# Kept in step with draftsmith.stages.decode.MAX_DRAFT_LENGTH / MAX_TREE_TOKENS / MAX_TREE_CANDIDATES
# (not imported: no torch for --help).
K_BOUND = ("K is at most 64: acceptance decays geometrically with the draft position, so past a few dozen "
            "nothing is accepted while every drafted token still costs a drafter step")
TREE_BOUND = ("DEPTH at most 64 (as chain K), TOPK at most the drafter's draft vocabulary, TOTAL (verified "
               "tokens, root incl.) at most 1024: a longer verify pass costs a prefill; TOPK + (DEPTH-1) x TOPK^2 "
               "(the candidates a round scores) at most 16384: drafting cost grows with TOPK squared")


# The grammar every command shares (docs/cli.md is generated from these): --device and --dtype mean the device and
# compute dtype of the model(s) a command runs; storage and export dtypes have their own names.
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def add_device_arg(p, default: str = "auto") -> None:
    p.add_argument("--device", default=default, help=DEVICE_HELP)


def add_dtype_arg(p, help: str = "compute dtype of the model(s) (default: float32 on CPU, bfloat16 on CUDA)") -> None:
    p.add_argument("--dtype", choices=COMPUTE_DTYPES, default=None, help=help)


def add_json_arg(p) -> None:
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")


def add_progress_arg(p) -> None:
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2",
                   help="model directory, .gguf file, or 'smollm2' (the embedded default; default)")
    add_device_arg(p)
    add_dtype_arg(p)
    p.add_argument("--aux-layers", default=None,
                   help="comma-separated aux layer ids (input of layer L); default (2, N//2, N-3)")


# vLLM's engine flags, named as vLLM's own CLI names them; generate, capture and serve take them from here.
VLLM_FLAGS = ("vllm_python", "tensor_parallel_size", "data_parallel_size", "max_num_seqs", "kv_cache_gib",
              "gpu_memory_utilization")


def add_vllm_args(p, *, omit: tuple[str, ...] = (), max_num_seqs: int | None = 256, kv_cache_gib: float | None = 4.0,
                  title: str = "vLLM engine (--backend vllm)") -> None:
    """The one vLLM engine flag group. ``omit``: flags (dest names) this command cannot use; it then lacks them.
    A default of None means: vLLM's own."""
    g = p.add_argument_group(title)
    seqs, kv = max_num_seqs or "vLLM's", kv_cache_gib or "vLLM's"
    flags = {
        "vllm_python": (("--vllm-python",), dict(default=None, metavar="PYTHON",
                        help="a Python with vLLM installed, e.g. .venv-vllm/bin/python (`make vllm-env`)")),
        "tensor_parallel_size": (("--tensor-parallel-size", "-tp"), dict(type=int, default=None, metavar="N",
                                 help="devices per engine (default 1)")),
        "data_parallel_size": (("--data-parallel-size", "-dp"), dict(type=int, default=None, metavar="N",
                               help="engine replicas; work is split between them (default 1)")),
        "max_num_seqs": (("--max-num-seqs",), dict(type=int, default=max_num_seqs, metavar="N",
                         help=f"sequences an engine runs at once (default {seqs})")),
        "kv_cache_gib": (("--kv-cache-gib",), dict(type=finite_float, default=kv_cache_gib, metavar="GIB",
                         help=f"KV cache size in GiB, vLLM on CPU (default {kv}); on GPUs "
                              "--gpu-memory-utilization applies")),
        "gpu_memory_utilization": (("--gpu-memory-utilization",), dict(type=finite_float, default=None, metavar="F",
                                   help="fraction of GPU memory vLLM may use, in (0, 1] (default vLLM's)")),
    }
    for dest, (names, kw) in flags.items():
        if dest not in omit:
            g.add_argument(*names, dest=dest, **kw)


def check_vllm_args(args) -> None:
    """Bounds of the vLLM group's values, whichever command parsed them."""
    for name in ("tensor_parallel_size", "data_parallel_size", "max_num_seqs"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    kv = getattr(args, "kv_cache_gib", None)
    if kv is not None and not kv > 0:
        raise UsageError(f"--kv-cache-gib must be > 0, got {kv}")
    util = getattr(args, "gpu_memory_utilization", None)
    if util is not None and not 0 < util <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {util}")


def parse_ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise UsageError(f"expected comma-separated integers, got {text!r}") from e
