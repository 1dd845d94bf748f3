"""What a drafting shape is expected to accept and gain: the drafter's measured acceptance, and the formulas and
round replays (``stages.rounds``) that turn it into a shape's tau and speedup, with an interval over prompts.

``shapes`` measures acceptance and the cost curve and chooses by these; ``bench`` and the card report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from draftsmith.stages.block_decode import BlockSpec
from draftsmith.stages.decode import ChainSpec, HybridSpec, NgramSpec, TreeSpec
from draftsmith.stages.rounds import Interval, Totals, Trace, bootstrap, chain_run, replay, sampled_run
from draftsmith.stages.verify_cost import Shape, VerifyCost


@dataclass(frozen=True)
class Acceptance:
    """``ranks[d][j]``: how often the target's token at depth d+1 is the drafter's (j+1)-th choice there,
    given that depths 1..d were accepted. A chain uses rank 0 only; a tree uses top_k ranks per depth.
    Depths and ranks not measured count as never accepted.

    ``lookup[d]``: how often prompt lookup's proposal there matches the target's next d+1 tokens (0 where it
    proposes nothing); ``lookup_rate``: how often it proposes anything. Empty: lookup never helps. Both are
    for lookup from any recurring token; ``lookup_by_min[m]`` holds the same pair for lookup that needs an
    n-gram of at least m tokens to recur.

    At temperature > 0 the target's tokens are sampled, and a one-hot candidate (a tree's child, a lookup
    token) is accepted exactly when the target's sample equals it, so ``ranks`` and ``lookup`` keep their
    meaning. A chain samples its drafts from the drafter and accepts with min(1, p/q): ``chain[d]`` is that
    rate, the mean of sum_x min(p(x), q(x)) (empty: greedy, where a chain accepts rank 0).

    ``traces``: the same text position by position, one per calibration prompt (``rounds.Trace``). Where they are
    there, expectations replay decoding's rounds on them instead of the formula over averaged rates (which
    overstates tau wherever acceptance is uneven: see ``stages.rounds``), and come with an interval over prompts.
    """

    ranks: tuple[tuple[float, ...], ...]
    source: str = "given"
    lookup: tuple[float, ...] = ()
    lookup_rate: float = 0.0
    lookup_by_min: dict[int, tuple[tuple[float, ...], float]] = field(default_factory=dict)
    chain: tuple[float, ...] = ()
    temperature: float = 0.0
    traces: tuple[Trace, ...] = ()
    prompts: dict = field(default_factory=dict, compare=False)  # the calibration set's provenance, where known

    def rank(self, depth: int, j: int) -> float:
        if depth >= len(self.ranks) or j >= len(self.ranks[depth]):
            return 0.0
        return self.ranks[depth][j]

    def lookup_stats(self, min_ngram: int = 1) -> tuple[tuple[float, ...], float]:
        """(reach per depth, proposal rate) of lookup from n-grams of >= min_ngram tokens; ((), 0) unmeasured."""
        if min_ngram == 1:
            return self.lookup, self.lookup_rate
        return self.lookup_by_min.get(min_ngram, ((), 0.0))

    @classmethod
    def from_chain(cls, acc: Sequence[float], source: str = "given") -> Acceptance:
        """Top-1 conditional acceptance per position (as training's eval.json records it)."""
        return cls(tuple((float(a),) for a in acc), source)

    def chain_rate(self, depth: int) -> float:
        """How often a chain's draft at depth+1 is accepted, given the earlier ones were."""
        if not self.chain:
            return self.rank(depth, 0)
        return self.chain[depth] if depth < len(self.chain) else 0.0

    def to_dict(self) -> dict:
        return {"ranks": [list(r) for r in self.ranks], "source": self.source, "lookup": list(self.lookup),
                "lookup_rate": self.lookup_rate,
                "lookup_by_min": {str(m): [list(r), rate] for m, (r, rate) in self.lookup_by_min.items()},
                "chain": list(self.chain), "temperature": self.temperature,
                "traces": [t.to_dict() for t in self.traces]}

    @classmethod
    def from_dict(cls, d: dict, note: str = "") -> Acceptance:
        by_min = {int(m): (tuple(r), float(rate)) for m, (r, rate) in d.get("lookup_by_min", {}).items()}
        return cls(tuple(tuple(r) for r in d["ranks"]), d["source"] + note, tuple(d.get("lookup", ())),
                   float(d.get("lookup_rate", 0.0)), by_min, tuple(d.get("chain", ())),
                   float(d.get("temperature", 0.0)), tuple(Trace.from_dict(t) for t in d.get("traces", ())))


def tree_nodes(acc: Acceptance, shape: TreeSpec) -> list[tuple[float, int]]:
    """EAGLE-2's selection replayed on expected values: (value, depth) of the kept nodes, where a node's value is
    its probability of lying on the target's path (see ``tree_paths``)."""
    return [(v, len(path)) for v, path in tree_paths(acc, shape)]


def tree_paths(acc: Acceptance, shape: TreeSpec) -> list[tuple[float, tuple[int, ...]]]:
    """(value, ranks from the root) of the nodes EAGLE-2's selection keeps, replayed on expected values.

    Node value = product of its ranks' acceptance along its path (what the drafter's cumulative score estimates).
    Each level expands the top_k best nodes of the previous level by top_k children; the total_tokens - 1 best
    nodes overall are kept, as in ``SpeculativeDecoder._draft_tree``. At most one child per node is accepted
    (at temperature > 0 too: one-hot candidates are tried in turn), so the expected number of accepted tokens is
    the sum of the kept nodes' values.
    """
    k = shape.top_k
    level = [(acc.rank(0, j), (j,)) for j in range(k)]
    nodes = list(level)
    for d in range(1, shape.depth):
        frontier = sorted(level, key=lambda n: n[0], reverse=True)[:k]
        level = [(v * acc.rank(d, j), path + (j,)) for v, path in frontier for j in range(k)]
        nodes += level
    return sorted(nodes, key=lambda n: n[0], reverse=True)[: shape.total_tokens - 1]


def hybrid_tau(acc: Acceptance, shape: HybridSpec) -> float:
    """1 + sum_d P(the tree or the lookup reaches depth d), the two taken as independent.

    At temperature 0 the tree reaches depth d with the summed value of its kept nodes there, and lookup with
    lookup's reach there (for its n-gram sizes); a round keeps whichever path the target accepts further.
    """
    tree = [0.0] * max(shape.tree.depth, shape.lookup.k)
    for v, d in tree_nodes(acc, shape.tree):
        tree[d - 1] += v
    reach = acc.lookup_stats(shape.lookup.min_ngram)[0]
    look = [reach[d] if d < min(shape.lookup.k, len(reach)) else 0.0 for d in range(len(tree))]
    return 1.0 + sum(1.0 - (1.0 - min(t, 1.0)) * (1.0 - x) for t, x in zip(tree, look, strict=True))


def expected_tau(acc: Acceptance, shape: Shape | None) -> float:
    """Expected tokens per verify pass (accepted + the bonus): replayed rounds where ``acc`` has traces, else
    1 + sum_k prod_{i<=k} a_i for a chain (and the tree's and hybrid's formulas)."""
    if shape is None:
        return 1.0
    if acc.traces:
        return expectation(acc, shape).tau.point
    if isinstance(shape, ChainSpec | BlockSpec):  # a block is verified as a chain
        tau, run = 1.0, 1.0
        for d in range(shape.k):
            run *= acc.chain_rate(d)
            tau += run
        return tau
    if isinstance(shape, HybridSpec):
        return hybrid_tau(acc, shape)
    return 1.0 + sum(v for v, _ in tree_nodes(acc, shape))


def verified_tokens(shape: Shape) -> int:
    """Tokens in the largest verify pass (root incl.); a hybrid's lookup branch may share nodes with the tree."""
    if isinstance(shape, ChainSpec | BlockSpec):
        return shape.k + 1
    if isinstance(shape, HybridSpec):
        return shape.tree.total_tokens + shape.lookup.k
    return shape.total_tokens


def expected_verify_time(cost: VerifyCost, shape: Shape, acc: Acceptance) -> float:
    """Seconds of the verify pass; a hybrid carries its lookup branch only in rounds where lookup proposes."""
    if isinstance(shape, HybridSpec):
        reach, rate = acc.lookup_stats(shape.lookup.min_ngram)
        rate = rate if reach else 0.0
        return (rate * cost.t_verify(verified_tokens(shape), True)
                + (1 - rate) * cost.t_verify(verified_tokens(shape.tree), True))
    return cost.t_verify(verified_tokens(shape), isinstance(shape, TreeSpec))


def expected_speedup(acceptance: Acceptance, shape: Shape | None, cost: VerifyCost) -> float:
    """tau(shape) * t_step / (t_verify(shape) + t_draft(shape)); plain decoding (None) is 1 by definition."""
    if shape is None:
        return 1.0
    if acceptance.traces:
        return expectation(acceptance, shape, cost).speedup.point
    per_round = expected_verify_time(cost, shape, acceptance) + cost.t_draft(shape)
    return expected_tau(acceptance, shape) * cost.t_step / per_round if per_round > 0 else 0.0


@dataclass(frozen=True)
class Expectation:
    """A shape's expected tau and speedup over plain decoding on the calibration prompts, each with its bootstrap
    interval over prompts (``speedup`` None without a cost curve). ``low`` is the conservative value."""

    tau: Interval
    speedup: Interval | None

    def to_dict(self) -> dict:
        return {"tau": self.tau.to_dict(), "speedup": self.speedup.to_dict() if self.speedup else None}


def _round_rule(acc: Acceptance, shape: Shape | NgramSpec, cost: VerifyCost | None, trace: Trace):
    """(drafts accepted in the round starting at c, that round's seconds) for ``shape`` on one trace."""
    verify = (lambda n, tree=False: cost.t_verify(n, tree)) if cost is not None else (lambda n, tree=False: 0.0)
    if isinstance(shape, NgramSpec):
        look = trace.lookup.get(shape.min_ngram, ())

        def lookup_only(c: int) -> int:
            return min(look[c], shape.k) if c < len(look) and look[c] >= 0 else 0

        return lookup_only, lambda c: verify(1 + shape.k if c < len(look) and look[c] >= 0 else 1)
    draft = cost.t_draft(shape) if cost is not None else 0.0
    if isinstance(shape, ChainSpec | BlockSpec):
        if trace.rates:
            return (lambda c: sampled_run(trace.rates[c], shape.k)), lambda c: verify(shape.k + 1) + draft
        return (lambda c: chain_run(trace.ranks[c], shape.k)), lambda c: verify(shape.k + 1) + draft
    tree = tree_of(shape)
    kept = {path for _, path in tree_paths(acc, tree)}

    def on_tree(c: int) -> int:
        r, d = trace.ranks[c], 0
        while d < min(tree.depth, len(r)) and r[d] >= 0 and tuple(r[: d + 1]) in kept:
            d += 1
        return d

    if not isinstance(shape, HybridSpec):
        return on_tree, lambda c: verify(tree.total_tokens, True) + draft
    look = trace.lookup.get(shape.lookup.min_ngram, ())

    def grafted(c: int) -> int:
        return max(on_tree(c), min(look[c], shape.lookup.k) if c < len(look) and look[c] >= 0 else 0)

    def seconds(c: int) -> float:
        lookup_proposes = c < len(look) and look[c] >= 0
        return verify(verified_tokens(shape) if lookup_proposes else verified_tokens(tree), True) + draft

    return grafted, seconds


def replayed(acc: Acceptance, shape: Shape | NgramSpec, cost: VerifyCost | None = None) -> list[Totals]:
    """Each calibration prompt's rounds of ``shape`` replayed on its trace (``stages.rounds``)."""
    out = []
    for trace in acc.traces:
        accepted, seconds = _round_rule(acc, shape, cost, trace)
        out.append(replay(trace.starts, accepted, seconds))
    return out


def expectation(acc: Acceptance, shape: Shape | NgramSpec | None, cost: VerifyCost | None = None) -> Expectation:
    """Expected tau and speedup of ``shape`` with a bootstrap interval over the calibration prompts: replayed
    rounds where ``acc`` has traces; else the formulas, as a point (an interval of zero width)."""
    if shape is None:
        return Expectation(Interval(1.0, 1.0, 1.0), Interval(1.0, 1.0, 1.0) if cost is not None else None)
    if not acc.traces or not any(t.starts for t in acc.traces):
        if isinstance(shape, NgramSpec):
            reach = acc.lookup_stats(shape.min_ngram)[0]
            tau = 1.0 + sum(reach[: shape.k])
            return Expectation(Interval(tau, tau, tau), None)
        tau = expected_tau(acc, shape)
        speed = expected_speedup(acc, shape, cost) if cost is not None else None
        return Expectation(Interval(tau, tau, tau), Interval(speed, speed, speed) if speed is not None else None)
    totals = replayed(acc, shape, cost)
    tau = bootstrap([t.tokens for t in totals], [t.rounds for t in totals])
    speed = bootstrap([t.tokens * cost.t_step for t in totals], [t.seconds for t in totals]) \
        if cost is not None and any(t.seconds for t in totals) else None
    return Expectation(tau, speed)


def chain_expectation(acc: Acceptance, max_k: int = 8, max_new_tokens: int | None = None) -> dict | None:
    """The card's expected acceptance (the shape of ``calibration.decoded_expectation``) from a calibration with
    traces: each greedy chain of k drafts replayed on them, the low end of its interval as ``by_k``."""
    from draftsmith.stages.rounds import LEVEL

    if not acc.traces or acc.temperature > 0:
        return None
    depth = min(max_k, max((len(r) for t in acc.traces for r in t.ranks), default=0))
    if depth < 1:
        return None
    taus = {str(k): expectation(acc, ChainSpec(k)).tau for k in range(1, depth + 1)}
    return {"source": f"greedy chains replayed on the target's answers ({acc.source})",
            "held_out": bool(acc.prompts.get("held_out")),
            "passes": sum(replayed(acc, ChainSpec(depth))[i].rounds for i in range(len(acc.traces))),
            "prompts": dict(acc.prompts) or {"count": len(acc.traces)}, "k": depth, "temperature": 0.0,
            **({"max_new_tokens": max_new_tokens} if max_new_tokens else {}),
            "per_position": [], "by_k": {k: round(t.low, 4) for k, t in taus.items()},
            "by_k_point": {k: round(t.point, 4) for k, t in taus.items()},
            "by_k_interval": {k: [round(t.low, 4), round(t.high, 4)] for k, t in taus.items()},
            "interval_level": LEVEL}


def conservative_speedup(acc: Acceptance, shape: Shape | None, cost: VerifyCost) -> float:
    """The lower end of ``shape``'s speedup interval: what ``choose_shape`` weighs shapes by.

    Why the lower end: the expectation is a promise (``check`` holds an engine to the card's, a user plans with
    ``--shape auto``'s), and it is measured on a dozen prompts while users' prompts vary far more than a machine's
    timings do. Promising the low end costs a shape that pays a little more than said; promising the middle makes
    a good drafter look broken wherever the prompts are harder than calibration's.
    """
    if shape is None:
        return 1.0
    if not acc.traces:
        return expected_speedup(acc, shape, cost)
    speed = expectation(acc, shape, cost).speedup
    return speed.low if speed is not None else 0.0


def tree_of(shape: Shape | None) -> TreeSpec | None:
    """The draft tree a shape verifies (a hybrid's own tree), or None for a chain or plain decoding."""
    return shape.tree if isinstance(shape, HybridSpec) else shape if isinstance(shape, TreeSpec) else None
