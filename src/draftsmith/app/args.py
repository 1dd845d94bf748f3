"""What every command shares: the target flags, integer lists, and the one way an error is reported."""

from __future__ import annotations

import argparse
import sys

from draftsmith.core.errors import DraftsmithError, UsageError, one_line

# Errors that are the user's to fix: one line on stderr, exit code 2. ValueError is there for option values
# that library constructors validate (sampling parameters, draft shapes).
USER_ERRORS = (DraftsmithError, FileNotFoundError, NotADirectoryError, ValueError)


def fail(e: BaseException, code: int = 2, then: str = "") -> int:
    """The one way the CLI reports an error: ``draftsmith: error: <message on one line><then>``."""
    print(f"draftsmith: error: {one_line(e)}{then}", file=sys.stderr)
    return code


# Kept in step with draftsmith.stages.decode.MAX_DRAFT_LENGTH / MAX_TREE_TOKENS / MAX_TREE_CANDIDATES
# (not imported: no torch for --help).
K_BOUND = ("K is at most 64: acceptance decays geometrically with the draft position, so past a few dozen "
            "nothing is accepted while every drafted token still costs a drafter step")
TREE_BOUND = ("DEPTH at most 64 (as chain K), TOPK at most the drafter's draft vocabulary, TOTAL (verified "
               "tokens, root incl.) at most 1024: a longer verify pass costs a prefill; TOPK + (DEPTH-1) x TOPK^2 "
               "(the candidates a round scores) at most 16384: drafting cost grows with TOPK squared")


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2",
                   help="model directory, .gguf file, or 'smollm2' (the embedded default; default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--aux-layers", default=None,
                   help="comma-separated aux layer ids (input of layer L); default (2, N//2, N-3)")


def parse_ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise UsageError(f"expected comma-separated integers, got {text!r}") from e
