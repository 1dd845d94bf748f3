"""How the demo splits its wall-clock budget between capture, training and the bench, from this machine's speed.

Machines differ several-fold in every stage, and not in the same proportion: on a CPU that emulates bf16
(AVX2 only) a k-token verify pass costs many 1-token steps, so the bench's speculative methods run slower
than plain decoding, while capture's long passes run in float32. A fixed store and a fixed bench then leave
training a minute. So each of capture and the bench is estimated from measured rates first and, where it
would take more than its share of the budget, cut down: capture to fewer conversations (the drafter gains
more from steps than from conversations past a few hundred, docs/recipes-and-levers.md, "Data"), the bench to fewer
prompts and then shorter answers, never below a floor. Training gets what is left and plans its steps to fit
(stages/train/budget.py). On a machine where everything fits, nothing is cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from draftsmith.stages.calibration import CALIBRATION_LIMIT
from draftsmith.stages.shapes import curve_ks
from draftsmith.stages.verify_cost import VerifyCost

#: The most of the budget capture and the bench may each take before they are cut down.
CAPTURE_SHARE, BENCH_SHARE = 0.3, 0.3
#: Floors of the cuts: fewer conversations train no useful drafter, fewer prompts or tokens measure noise.
MIN_CONVERSATIONS, MIN_BENCH_PROMPTS, MIN_BENCH_TOKENS = 100, 4, 128
#: The acceptance length the bench's estimate assumes for every speculative method (the drafter is not
#: trained yet; a better one only makes the bench shorter than estimated).
TAU_GUESS = 1.3
#: Prompt lookup lengths the demo's bench runs (bench_in_fresh_process), and its calibration prompts.
LOOKUP_KS, CALIBRATION_PROMPTS = (3, 10), CALIBRATION_LIMIT
#: Bench measures its verify curve (``shapes.curve_ks``) with chain and tree masks, warm-up plus five reps each,
#: in both dtypes where it chooses one (counted at this dtype's cost).
CURVE_RUNS = 2 * 6 * 2
#: What the budget keeps for exporting and for the bench's loading, and the least training it plans.
EXPORT_S, BENCH_FIXED_S, MIN_TRAIN_MINUTES = 10.0, 30.0, 1.0


@dataclass(frozen=True)
class Rates:
    """What the demo measured before capture."""

    cost: VerifyCost  # the target's passes in the bench's dtype (a few points; the rest is interpolated)
    capture_tok_s: float  # tokens a second of a long cache-free pass in capture's dtype
    record_tokens: Sequence[int]  # tokens of each record capture would read, in order (0: one it skips)
    decode_s_per_token: float | None = None  # plain greedy decoding's seconds a token, measured end to end

    @property
    def overhead(self) -> float:
        """Real decoding over the bare step: a growing cache, the sampling, the loop (1: not measured)."""
        return max(1.0, self.decode_s_per_token / self.t_step) if self.decode_s_per_token else 1.0

    @property
    def t_step(self) -> float:
        return self.cost.t_step

    def pass_s(self, n: int) -> float:
        return self.cost.t_verify(n)


@dataclass(frozen=True)
class Plan:
    conversations: int
    bench_limit: int
    bench_tokens: int
    capture_s: float
    bench_s: float
    cuts: tuple[str, ...] = ()  # what was cut and why, one line each

    def to_dict(self) -> dict:
        return {**asdict(self), "cuts": list(self.cuts)}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(**{**d, "cuts": tuple(d["cuts"])})


def verified_per_method(chain: int, tree_tokens: int | None) -> list[int]:
    """Tokens in one verify pass of each speculative method the demo's bench runs."""
    return [chain + 1, *([tree_tokens] if tree_tokens else []), *(k + 1 for k in LOOKUP_KS)]


def bench_seconds(rates: Rates, prompts: int, tokens: int, methods: Sequence[int], datasets: int = 1) -> float:
    """Plain decoding of every prompt (``prompts`` in each of ``datasets``), each speculative method at
    ``TAU_GUESS`` tokens a pass of its size, the calibration decodes (chain 3), and the verify curve's measurement."""
    per_token = [rates.pass_s(n) / TAU_GUESS for n in methods]
    decodes = datasets * prompts * tokens * (rates.t_step + sum(per_token)) * rates.overhead
    calibration = CALIBRATION_PROMPTS * tokens * rates.pass_s(4) / TAU_GUESS * rates.overhead
    ks = curve_ks()
    curve = CURVE_RUNS * sum(ks) / ks[-1] * rates.pass_s(ks[-1])
    return decodes + calibration + curve + BENCH_FIXED_S


def capture_seconds(rates: Rates, conversations: int) -> float:
    return sum(rates.record_tokens[:conversations]) / rates.capture_tok_s


def plan(minutes: float | None, conversations: int, bench_limit: int, bench_tokens: int, methods: Sequence[int],
         rates: Rates, datasets: int = 1) -> Plan:
    """The preset's sizes, cut down where capture or the bench would take more than its share of ``minutes``."""
    cuts: list[str] = []
    n = available = min(conversations, len(rates.record_tokens)) or conversations
    prompts, tokens = bench_limit, bench_tokens
    if minutes:
        budget = minutes * 60
        cap_share, bench_share = CAPTURE_SHARE * budget, BENCH_SHARE * budget
        full = capture_seconds(rates, n)
        while n > MIN_CONVERSATIONS and capture_seconds(rates, n) > cap_share:
            n -= 1
        if n < available:
            cuts.append(f"capture {n} of {available} conversations (all of them: ~{full / 60:.1f} min at "
                        f"{rates.capture_tok_s:.0f} tok/s, over its {cap_share / 60:.1f})")
        def bench_s(prompts: int, tokens: int) -> float:
            return bench_seconds(rates, prompts, tokens, methods, datasets)

        full = bench_s(prompts, tokens)
        while prompts > MIN_BENCH_PROMPTS and bench_s(prompts, tokens) > bench_share:
            prompts -= 1
        while tokens > MIN_BENCH_TOKENS and bench_s(prompts, tokens) > bench_share:
            tokens = max(MIN_BENCH_TOKENS, tokens - 16)
        if (prompts, tokens) != (bench_limit, bench_tokens):
            cuts.append(f"bench {prompts} prompts a set x {tokens} tokens (the preset's {bench_limit} x "
                        f"{bench_tokens}: "
                        f"~{full / 60:.1f} min, over its {bench_share / 60:.1f}; a step takes "
                        f"{1e3 * rates.t_step:.1f} ms, a {methods[0]}-token pass "
                        f"{rates.pass_s(methods[0]) / rates.t_step:.2f}x that)")
    return Plan(n, prompts, tokens, capture_seconds(rates, n),
                bench_seconds(rates, prompts, tokens, methods, datasets), tuple(cuts))


def train_minutes(minutes: float | None, spent_s: float, bench_s: float) -> float:
    """The minutes of the budget left to training after ``spent_s`` and the bench's estimate; 0: no budget."""
    if not minutes:
        return 0.0
    return max(MIN_TRAIN_MINUTES, (minutes * 60 - spent_s - bench_s - EXPORT_S) / 60)
