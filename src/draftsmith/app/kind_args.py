"""The drafter-kind flags decode and bench share: --kind, --random-drafter, --block, and the drafter they make."""

from __future__ import annotations

from draftsmith.app.args import parse_ints
from draftsmith.core.conventions import DRAFTER_KINDS, aux_to_block_layer_ids
from draftsmith.core.errors import UsageError

BLOCK_HELP = "DFlash/DSpark: draft K tokens a block (default: as many as the drafter was trained for)"


def add_kind_args(p) -> None:
    p.add_argument("--kind", choices=DRAFTER_KINDS, default=None,
                   help="drafter kind for --random-drafter (default eagle3); with --drafter it must match the saved "
                        "drafter's own kind, which is read from its config.json")


def drafter_kind(args) -> str | None:
    """The kind the command line asks for: a saved drafter's own kind (``--kind`` must agree), else ``--kind``."""
    if not (args.drafter or args.random_drafter):
        if args.kind:
            raise UsageError("--kind needs --drafter PATH or --random-drafter")
        return None
    if args.drafter:
        from draftsmith.model.kinds import kind_of_dir

        kind = kind_of_dir(args.drafter)
        if args.kind and args.kind != kind:
            raise UsageError(f"--kind {args.kind}, but {args.drafter} holds a {kind} drafter")
        return kind
    return args.kind or "eagle3"


def drafts_blocks(args, kind: str | None, shape_flags: tuple[str, ...]) -> bool:
    """Whether the run drafts blocks; refuses the flags of the other family."""
    from draftsmith.model.kinds import get_kind

    blocks = kind is not None and get_kind(kind).drafts_blocks
    if args.block is not None and not blocks:
        raise UsageError("--block K drafts with a dflash or dspark drafter (--kind, or --drafter of that kind)")
    values = {f: getattr(args, f.removeprefix("--").replace("-", "_"), None) for f in shape_flags}
    given = [f for f, v in values.items() if v is not None and v is not False]
    if blocks and given:
        raise UsageError(f"a {kind} drafter drafts blocks: use --block K, not {', '.join(given)}")
    return blocks


def make_drafter(args, kind: str, target):
    """Load ``--drafter`` or make a random drafter of ``kind`` for ``target`` (a block drafter's target layers
    from ``--aux-layers`` when given)."""
    from draftsmith.model.kinds import get_kind

    k = get_kind(kind)
    if args.drafter:
        return k.load(args.drafter, target)
    overrides = {}
    if k.drafts_blocks and getattr(args, "aux_layers", None):
        overrides["target_layer_ids"] = aux_to_block_layer_ids(parse_ints(args.aux_layers))
    return k.new(target, **overrides)
