"""Expected acceptance and speedup by replaying decoding rounds on calibration text, prompt by prompt.

Why not a formula over averaged rates: 1 + sum_d prod_{i<=d} a_i weighs every position of the text alike, and
decoding does not. Where drafts are accepted a round covers several tokens, where they are not it covers one, so
hard text holds more rounds than its share of tokens: tokens / rounds is a harmonic mean of the local tau, which the
formula's arithmetic mean overstates wherever acceptance is uneven (prompt lookup copying a block, then nothing).
Taking a hybrid's tree and lookup as independent overstates it again: both succeed on the same easy text. Replaying
the rounds a decoder would run, on the text the target decoded, counts what it would count; and counting per prompt
lets a bootstrap over prompts say how far the estimate can be trusted (``bootstrap``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: A rank that says "not among the drafter's top choices" (a tree node that was never drafted).
MISS = -1
#: The interval an expectation reports: its lower end is what ``--shape auto`` chooses by and the card promises.
LEVEL = 0.9
RESAMPLES = 1000


@dataclass(frozen=True)
class Trace:
    """One calibration prompt's decoded answer, seen from every round start c (the context ends with answer token c;
    the drafts of that round would be answer tokens c+1, c+2, ...).

    ``ranks[c][d]``: the rank of the target's token at draft depth d+1 among the drafter's choices there, given
    depths 1..d accepted (teacher-forced), MISS when it is not among the top_k measured; a chain or a block accepts
    rank 0. ``lookup[m][c]``: how many of prompt lookup's proposed tokens are right, lookup needing an n-gram of at
    least m tokens to recur (MISS: it proposes nothing). ``rates[c][d]``: at temperature > 0, the probability a
    sampled chain's draft at depth d+1 is accepted (empty when greedy).
    """

    ranks: tuple[tuple[int, ...], ...]
    lookup: dict[int, tuple[int, ...]]
    rates: tuple[tuple[float, ...], ...] = ()

    @property
    def starts(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict:
        return {"ranks": [list(r) for r in self.ranks], "lookup": {str(m): list(v) for m, v in self.lookup.items()},
                "rates": [[round(x, 5) for x in r] for r in self.rates]}

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        return cls(tuple(tuple(int(x) for x in r) for r in d["ranks"]),
                   {int(m): tuple(int(x) for x in v) for m, v in d.get("lookup", {}).items()},
                   tuple(tuple(float(x) for x in r) for r in d.get("rates", ())))


@dataclass(frozen=True)
class Totals:
    """What replaying one prompt's rounds counted: answer tokens emitted, rounds (verify passes), their seconds."""

    tokens: float
    rounds: int
    seconds: float


def chain_run(ranks: Sequence[int], k: int) -> int:
    """Drafts a greedy chain of k accepts: the leading run of rank-0 depths."""
    n = 0
    while n < min(k, len(ranks)) and ranks[n] == 0:
        n += 1
    return n


def sampled_run(rates: Sequence[float], k: int) -> float:
    """Drafts a sampled chain of k accepts on average: sum_d prod_{i<=d} rate_i (each accepted with min(1, p/q))."""
    total, run = 0.0, 1.0
    for r in rates[:k]:
        run *= r
        total += run
    return total


def replay(starts: int, accepted: Callable[[int], float], cost: Callable[[int], float]) -> Totals:
    """Run the rounds from the first round start: each accepts ``accepted(c)`` drafts (cut where the text ends)
    plus the target's own token, and costs ``cost(c)`` seconds. A sampled chain accepts a mean, not a whole number:
    the round then advances by it (a mean-field replay, still weighing hard text by the rounds it holds)."""
    c, tokens, rounds, seconds = 0.0, 0.0, 0, 0.0
    while c < starts:
        at = int(c)
        n = min(accepted(at), starts - 1 - c) + 1
        tokens, rounds, seconds = tokens + n, rounds + 1, seconds + cost(at)
        c += n
    return Totals(tokens, rounds, seconds)


@dataclass(frozen=True)
class Interval:
    """A ratio of sums over prompts: the point estimate, and the ``level`` bootstrap interval over prompts."""

    low: float
    point: float
    high: float
    level: float = LEVEL

    def to_dict(self) -> dict:
        return {"low": round(self.low, 4), "point": round(self.point, 4), "high": round(self.high, 4),
                "level": self.level}

    def label(self) -> str:
        return f"{self.low:.2f}-{self.high:.2f}"


def bootstrap(num: Sequence[float], den: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES,
              seed: int = 0) -> Interval:
    """sum(num) / sum(den), and the central ``level`` interval of that ratio over prompts drawn with replacement.

    Prompts, not positions, are resampled: positions of one answer accept alike, so a resample of positions would
    make a few prompts look like many and the interval far too narrow.
    """
    n = torch.tensor([float(x) for x in num], dtype=torch.float64)
    d = torch.tensor([float(x) for x in den], dtype=torch.float64)
    point = float(n.sum() / d.sum()) if float(d.sum()) > 0 else 0.0
    if len(n) < 2:
        return Interval(point, point, point, level)
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(n), (resamples, len(n)), generator=g)
    weights = torch.zeros(resamples, len(n), dtype=torch.float64).scatter_add_(
        1, picks, torch.ones_like(picks, dtype=torch.float64))
    ratios = (weights @ n) / (weights @ d).clamp(min=1e-12)
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(ratios, q).tolist()
    return Interval(min(low, point), point, max(high, point), level)
