"""What a verify pass and a drafter step cost on this machine: the curve the shape chooser weighs shapes with.

Timings are medians over interleaved reps (machine noise lands on all alike), after a warm-up, with the cache
rolled back after each pass as decoding does.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from draftsmith.model.target import Target
from draftsmith.stages.block_decode import BlockSpec
from draftsmith.stages.decode import ChainSpec, HybridSpec, TreeSpec

#: Verified tokens (root incl.) at which the verify curve is measured; others are interpolated. Dense where
#: the candidates sit: packed GEMMs change kernels between sizes, so the curve is not smooth there.
DEFAULT_KS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64)

Shape = ChainSpec | TreeSpec | HybridSpec | BlockSpec


# --- the cost model ----------------------------------------------------------------------------------------
def _interp(points: dict[int, float], n: float) -> float:
    """Piecewise-linear in n through the measured points, extended linearly past both ends."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]] * n / xs[0]
    lo_i = 0
    while lo_i < len(xs) - 2 and n > xs[lo_i + 1]:
        lo_i += 1
    x0, x1 = xs[lo_i], xs[lo_i + 1]
    y0, y1 = points[x0], points[x1]
    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


@dataclass(frozen=True)
class VerifyCost:
    """Seconds per pass, measured on one machine for one target (and drafter architecture).

    ``verify[n]``: a target pass over n tokens (root incl.) with a causal mask (chain verify); ``tree_verify``
    the same with a 4D tree mask (falls back to ``verify``); ``draft[w]``: one drafter step over w tokens
    plus its head (w = 1 for a chain, top_k for a tree level), or for a block drafter one block of w drafts.
    """

    t_step: float
    verify: dict[int, float]
    tree_verify: dict[int, float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)

    def t_verify(self, n: int, tree: bool = False) -> float:
        return _interp(self.tree_verify if tree and self.tree_verify else self.verify, n)

    def t_draft(self, shape: Shape) -> float:
        """A chain: k one-token steps. A tree: one step for the root, then depth-1 levels of top_k nodes.
        A hybrid drafts its tree; the lookup costs no model pass."""
        if not self.draft:
            return 0.0
        if isinstance(shape, HybridSpec):
            shape = shape.tree
        if isinstance(shape, BlockSpec):
            return _interp(self.draft, shape.k)
        if isinstance(shape, ChainSpec):
            return shape.k * _interp(self.draft, 1)
        return _interp(self.draft, 1) + (shape.depth - 1) * _interp(self.draft, shape.top_k)

    def to_dict(self) -> dict:
        return {"t_step": self.t_step, **{k: {str(n): t for n, t in getattr(self, k).items()}
                                          for k in ("verify", "tree_verify", "draft")}}

    @classmethod
    def from_dict(cls, d: dict) -> VerifyCost:
        return cls(float(d["t_step"]), *({int(n): float(t) for n, t in d.get(k, {}).items()}
                                         for k in ("verify", "tree_verify", "draft")))


# --- measuring ------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def _tree_parents(n: int) -> list[int]:
    """A tree of n nodes (root incl.) that branches from its first level on: node i's parent is (i - 1) // 2, a
    binary tree. Attention costs the same under any mask; a recurrent target steps a tree node by node, where it
    passes a chain in one call, so the measured tree must branch."""
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def _tree_mask(n: int, prefix: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An additive [1, 1, n, prefix + n] mask and the positions, as tree verify builds them for ``_tree_parents``."""
    parents = _tree_parents(n)
    allowed = torch.eye(n, dtype=torch.bool, device=device)
    depth = [0] * n
    for i in range(1, n):
        allowed[i] |= allowed[parents[i]]
        depth[i] = depth[parents[i]] + 1
    allowed = torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=device), allowed], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None], prefix + torch.tensor([depth], device=device)


@torch.no_grad()
def measure_verify_cost(target: Target, drafter=None, ks: Sequence[int] = DEFAULT_KS, reps: int = 5,
                        prefix: int = 128, draft_widths: Sequence[int] = (1, 4, 6, 8, 10), seed: int = 0) -> VerifyCost:
    """Time target passes of k tokens after a ``prefix``-token KV cache (chain and tree masks) and drafter steps.

    Every rep runs every measurement once, in a shuffled order, so machine noise lands on all alike; each
    point is the median over reps. The cache is rolled back after each pass, as decoding does.
    """
    device = target.device
    g = torch.Generator().manual_seed(seed)
    vocab = target.vocab_size
    ids = torch.randint(0, vocab, (1, prefix + max(ks)), generator=g).to(device)
    cache = target.new_cache()
    out = target(ids[:, :prefix], cache=cache, logits_to_keep=1)
    jobs: dict[tuple[str, int], Callable[[], object]] = {}

    def verify(n: int, tree: bool) -> Callable[[], object]:
        mask, pos = _tree_mask(n, prefix, target.dtype, device) if tree else (None, None)
        parents = _tree_parents(n) if tree else list(range(-1, n - 1))

        def run():
            cache.begin_block(parents)
            target(ids[:, prefix: prefix + n], cache=cache, attention_mask=mask, position_ids=pos)
            cache.keep(prefix)
        return run

    for n in ks:
        jobs[("verify", n)] = verify(n, False)
        if n > 1:
            jobs[("tree_verify", n)] = verify(n, True)
    if drafter is not None and getattr(drafter.config, "num_drafts", None):
        jobs.update(_block_draft_jobs(drafter, out.aux_hidden_states, ids, prefix, draft_widths))
    elif drafter is not None:
        from draftsmith.model.drafter import KVCache

        dcache = KVCache()
        h = drafter(drafter.fuse(out.aux_hidden_states), ids[:, 1: prefix + 1],
                    torch.arange(prefix, device=device)[None], dcache)[:, -1:]

        def draft(w: int) -> Callable[[], object]:
            pos = torch.full((1, w), prefix, device=device)
            mask = None if w == 1 else torch.cat([torch.ones(w, prefix, dtype=torch.bool, device=device),
                                                  torch.eye(w, dtype=torch.bool, device=device)], 1)[None, None]
            toks = ids[:, prefix: prefix + w]

            def run():
                o = drafter(h.expand(1, w, -1), toks, pos, dcache, mask)
                drafter.logits(o)[0].float().log_softmax(-1).topk(min(w, drafter.config.draft_vocab_size), dim=-1)
                dcache.crop(prefix)
            return run

        for w in sorted(set(draft_widths) | {1}):
            jobs[("draft", w)] = draft(w)
    for fn in jobs.values():  # warm-up: first calls allocate
        fn()
    times: dict[tuple[str, int], list[float]] = {key: [] for key in jobs}
    order = list(jobs)
    rng = random.Random(seed)
    for _ in range(reps):
        rng.shuffle(order)
        for key in order:
            times[key].append(_timed(jobs[key], device))
    med = {key: statistics.median(v) for key, v in times.items()}
    part = {kind: {n: t for (k, n), t in med.items() if k == kind} for kind in ("verify", "tree_verify", "draft")}
    if 1 in part["verify"]:
        part["tree_verify"].setdefault(1, part["verify"][1])
    part = {kind: _monotone(points) for kind, points in part.items()}
    return VerifyCost(part["verify"][min(part["verify"])], part["verify"], part["tree_verify"], part["draft"])


def _block_draft_jobs(drafter, aux, ids: torch.Tensor, prefix: int, widths: Sequence[int]) -> dict:
    """One greedy block of w drafts on a ``prefix``-position context, for each w (the context stays cached, as
    in decoding, where a round only appends the few positions it verified)."""
    from draftsmith.stages.block_decode import SamplingLike, draft_block, new_block_cache

    cache = new_block_cache(drafter)
    drafter.extend_context(aux, torch.arange(prefix, device=ids.device)[None], cache)
    pending = int(ids[0, prefix])

    def job(w: int) -> Callable[[], object]:
        return lambda: draft_block(drafter, cache, pending, prefix, w, SamplingLike(), None)

    return {("draft", w): job(w) for w in sorted({min(w, drafter.config.num_drafts) for w in (1, *widths)})}


def _monotone(points: dict[int, float]) -> dict[int, float]:
    """Running max over n: a pass over more tokens never costs less, so a dip is timing noise."""
    out, top = {}, 0.0
    for n in sorted(points):
        top = max(top, points[n])
        out[n] = top
    return out


@torch.no_grad()
def step_time(target: Target, reps: int = 7, prefix: int = 128) -> float:
    """Median seconds of a 1-token step after a ``prefix``-token cache (what plain decoding repeats)."""
    return measure_verify_cost(target, None, ks=(1,), reps=reps, prefix=prefix).t_step
