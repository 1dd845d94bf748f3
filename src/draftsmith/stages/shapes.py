"""Hardware-aware drafting: pick the draft shape that pays most on this machine for this target.

A shape pays ``tau(shape) * t_step / (t_verify(n) + t_draft(shape))``: tokens per round over the cost of a
round, in units of a plain 1-token step. The verify curve ``t_verify(n)`` and the drafter step costs are
measured in a few seconds (``verify_cost``) and cached here per machine and target; ``tau`` comes
from the drafter's per-depth, per-rank acceptance, measured on a short calibration decode (cached per
drafter) and replayed round by round on it (``expectation``, ``rounds``). A hybrid (a tree with the
prompt-lookup continuation grafted on) adds lookup's reach, measured on the same calibration text. Shapes are
weighed by the low end of their interval over calibration prompts; when none exceeds 1, the answer is plain
decoding.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.core.machine import cache_get, cache_put, machine_key
from draftsmith.model.target import Target
from draftsmith.stages.block_decode import BlockSpec
from draftsmith.stages.decode import (
    ChainSpec,
    HybridSpec,
    NgramSpec,
    SamplingParams,
    SpeculativeDecoder,
    TreeSpec,
    logits_to_probs,
    ngram_match,
)
from draftsmith.stages.expectation import (  # noqa: F401  (some re-exported: callers look in shapes)
    Acceptance,
    chain_expectation,
    conservative_speedup,
    expectation,
    expected_speedup,
    expected_tau,
    expected_verify_time,
    tree_of,
    verified_tokens,
)
from draftsmith.stages.rounds import MISS, Trace
from draftsmith.stages.verify_cost import DEFAULT_KS, Shape, VerifyCost, measure_verify_cost

#: EAGLE-2 trees from narrow and shallow to EAGLE-2's own 6,10,60.
TREES: tuple[TreeSpec, ...] = tuple(TreeSpec(d, k, t) for d, k, t in (
    (2, 4, 6), (2, 6, 10), (3, 4, 8), (3, 6, 12), (3, 8, 16), (4, 6, 16), (4, 8, 24), (5, 8, 32), (6, 8, 48),
    (6, 10, 60)))
#: Lookup lengths a hybrid may graft. Lookup proposals cost no model pass, and where the text repeats (code,
#: lists, a small target's own loops) a long one is accepted whole, so the verify curve decides how far to go.
HYBRID_LOOKUP_KS = (3, 6, 10, 16)
#: The shortest recurring n-gram a hybrid grafts from: 1 grafts wherever any token recurs (code repeats its
#: names), 2 only where two tokens do (in prose a lone token's continuation is seldom right, and a round
#: without a graft verifies the tree alone). Calibration measures lookup's reach for each.
HYBRID_MIN_NGRAMS = (1, 2)
#: Chains 1..8, the trees, and each tree with each of those lookups grafted on.
DEFAULT_CANDIDATES: tuple[Shape, ...] = (
    *(ChainSpec(k) for k in range(1, 9)), *TREES,
    *(HybridSpec(t, NgramSpec(k, min_ngram=m)) for m in HYBRID_MIN_NGRAMS for k in HYBRID_LOOKUP_KS for t in TREES))
#: How far calibration follows prompt lookup's proposals (longer ones are cut to this).
LOOKUP_DEPTH = max(HYBRID_LOOKUP_KS)
#: Calibration decodes each prompt for the run's max_new_tokens, clamped to these (``calibration_tokens``).
CALIBRATION_TOKENS, CALIBRATION_MIN_TOKENS, CALIBRATION_MAX_TOKENS = 96, 64, 256
CALIBRATION_PROMPTS = (
    "Explain how a hash table works and when you would use one.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me three tips for writing clear emails, with an example of each.",
    "Write a Python function that merges two sorted lists into one sorted list, with a docstring and a test.",
)


def shape_name(shape: Shape | None) -> str:
    if shape is None:
        return "plain"
    if isinstance(shape, ChainSpec):
        return f"chain {shape.k}"
    if isinstance(shape, BlockSpec):
        return f"{shape.kind} block {shape.k}"
    if isinstance(shape, HybridSpec):
        tree = shape_name(shape.tree).removeprefix("tree ")
        return f"hybrid {tree}+lookup {shape.lookup.k}{shape.lookup.ngram_label}"
    return f"tree {shape.depth},{shape.top_k},{shape.total_tokens}"


def draft_depth(shape: Shape) -> int:
    return shape.k if isinstance(shape, ChainSpec | BlockSpec) else tree_of(shape).depth


def drafts_blocks(drafter) -> bool:
    from draftsmith.model.kinds import get_kind

    return get_kind(drafter.kind).drafts_blocks


def block_candidates(drafter) -> list[BlockSpec]:
    """Every block length a block drafter can draft (1..what it was trained for)."""
    return [BlockSpec(k, drafter.kind) for k in range(1, drafter.config.num_drafts + 1)]


@dataclass(frozen=True)
class Choice:
    """The chosen shape (None: plain decoding), its expected speedup (the conservative end of its interval: see
    ``conservative_speedup``), and a one-line reason; ``cost``: the verify curve it was weighed on, kept so a report
    can say why (what a wide pass costs here) and not only what; ``acceptance``: what it was weighed with (a bench
    puts its expectation beside every method it measures)."""

    shape: Shape | None
    speedup: float
    reason: str
    table: dict[str, float] = field(default_factory=dict)  # every candidate's expected (conservative) speedup
    cost: VerifyCost | None = None
    acceptance: Acceptance | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict:
        out = {"shape": shape_name(self.shape), "expected_speedup": self.speedup, "reason": self.reason,
               "candidates": self.table, **({"verify_cost": self.cost.to_dict()} if self.cost else {})}
        if self.acceptance is not None:
            exp = expectation(self.acceptance, self.shape, self.cost)
            out["expected"] = exp.to_dict()
            out["calibration"] = self.acceptance.source
        return out


def choose_shape(acceptance: Acceptance, cost: VerifyCost, candidates: Sequence[Shape] = DEFAULT_CANDIDATES,
                 max_top_k: int | None = None) -> Choice:
    """The argmax of the conservative expected speedup over the candidates, or plain decoding when none exceeds 1.

    With calibration traces a shape is weighed by the lower end of its interval over prompts
    (``conservative_speedup``); without, by the formulas' point estimate.
    """
    usable = [s for s in candidates if (max_top_k is None or tree_of(s) is None or tree_of(s).top_k <= max_top_k)
              and (not isinstance(s, HybridSpec) or acceptance.lookup_stats(s.lookup.min_ngram)[0])]
    # (no lookup measured: a hybrid would be its tree)
    table = {shape_name(s): conservative_speedup(acceptance, s, cost) for s in usable}
    best = max(usable, key=lambda s: table[shape_name(s)], default=None)
    if best is None or table[shape_name(best)] <= 1.0:
        top = f"; best was {shape_name(best)} at {table[shape_name(best)]:.2f}x" if best is not None else ""
        return Choice(None, 1.0, f"no shape pays on this machine{top}", table, cost, acceptance)
    exp = expectation(acceptance, best, cost)
    tau = exp.tau.low
    v = expected_verify_time(cost, best, acceptance) / cost.t_step
    dr = cost.t_draft(best) / cost.t_step
    others = []
    for kind in (ChainSpec, TreeSpec, HybridSpec, BlockSpec):
        rivals = [s for s in usable if isinstance(s, kind) and s != best]
        if rivals and not isinstance(best, kind):
            r = max(rivals, key=lambda s: table[shape_name(s)])
            others.append(f"{shape_name(r)} {table[shape_name(r)]:.2f}x")
    at = f" at T={acceptance.temperature:g}" if acceptance.temperature > 0 else ""
    spread = ""
    if acceptance.traces and exp.speedup is not None:
        spread = (f" (the low end of {exp.speedup.label()}x, {exp.speedup.level:.0%} over "
                  f"{len(acceptance.traces)} prompts; point {exp.speedup.point:.2f}x)")
    reason = (f"expected {table[shape_name(best)]:.2f}x{at}{spread}: tau {tau:.2f} at verify {v:.2f}x + draft "
              f"{dr:.2f}x a step; {', '.join([*others, 'plain 1.00x'])}")
    return Choice(best, table[shape_name(best)], reason, table, cost, acceptance)


def describe(choice: Choice, dtype_note: str = "") -> str:
    """The line the CLI prints: what was chosen and why."""
    extra = f"; {dtype_note}" if dtype_note else ""
    return f"shape: {shape_name(choice.shape)} ({choice.reason}{extra})"


# --- acceptance ---------------------------------------------------------------------------------------------
def calibration_prompts(tokenizer, prompts: Sequence[str] = CALIBRATION_PROMPTS) -> list[list[int]]:
    from draftsmith.data.chat import encode_prompt

    chat = bool(getattr(tokenizer, "chat_template", None))
    return [list(encode_prompt(tokenizer, p, chat=chat)) for p in prompts]


@torch.no_grad()
def calibrate_acceptance(target: Target, drafter, prompts: Sequence[Sequence[int]], depth: int = 6,
                         top_k: int = 10, max_new_tokens: int = CALIBRATION_TOKENS, temperature: float = 0.0,
                         seed: int = 0) -> Acceptance:
    """Per-depth, per-rank acceptance of the drafter on the target's own continuations of ``prompts``.

    Each prompt is decoded (chain 3: the target's own tokens, faster: greedy, or sampled at ``temperature``),
    then the drafter is unrolled ``depth`` steps over the whole sequence the way training-time test unrolls it,
    which is what it computes when drafting token d after d-1 accepted ones. Rank j at depth d counts how often
    the target's token is the drafter's (j+1)-th choice there. Prompt lookup is replayed on the same text,
    position by position. At temperature > 0 a sampled chain's rate is computed from both distributions.
    """
    from draftsmith.data.chat import stop_token_ids
    from draftsmith.model.ttt import TeacherScores, TTTBatch, ttt_forward

    stops = stop_token_ids(target.tokenizer) if target.tokenizer is not None else ()
    decoder = SpeculativeDecoder(target, drafter, ChainSpec(3))
    sampling = SamplingParams(temperature=temperature)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    top_k = min(top_k, drafter.config.draft_vocab_size)
    draft_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=target.device))
    hits = torch.zeros(depth, top_k)
    chain = torch.zeros(depth)  # sampled chains: summed min(p, q) mass
    counts = torch.zeros(depth)
    lookup = LookupReach()
    traces = []
    for prompt in prompts:
        gen = decoder.generate(list(prompt), max_new_tokens, sampling, eos_token_ids=stops,
                               generator=generator).token_ids
        looked = lookup.add(list(prompt), gen)
        seq = torch.tensor([list(prompt) + gen], device=target.device)
        n, start = seq.shape[1], len(prompt) + 1  # predicted tokens: the target's, after its first
        starts = max(0, len(gen) - 1)  # round starts: the context ends with answer token c, c + 1 is drafted
        ranks = [[MISS] * depth for _ in range(starts)]
        rates = [[0.0] * depth for _ in range(starts)] if not sampling.greedy else []
        out = target(seq)
        batch = TTTBatch(seq, torch.ones_like(seq, dtype=torch.bool), torch.cat(out.aux_hidden_states, -1),
                         out.hidden_state, torch.tensor([n], device=seq.device))
        teacher = (TeacherScores(torch.zeros(1, n, 1, device=seq.device)), torch.zeros_like(seq),
                   torch.zeros_like(seq, dtype=torch.bool))  # nothing trained: only the unrolled states are read
        unrolled: list[torch.Tensor] = []
        ttt_forward(drafter, batch, teacher, depth, unroll_hidden=unrolled)
        for d, h in enumerate(unrolled):
            cols = torch.arange(max(0, start - 2 - d), n - 2 - d, device=seq.device)  # column t predicts t+2+d
            if cols.numel() == 0:
                continue
            logits = drafter.logits(h[0, cols])
            best = drafter.to_target_ids(logits.topk(top_k, dim=-1).indices)
            match = best == seq[0, cols + 2 + d][:, None]
            hits[d] += match.float().sum(0).cpu()
            counts[d] += cols.numel()
            # Column t drafts the round whose context ends at t + 1, i.e. answer token c = t + 1 - len(prompt).
            round_of = [t + 1 - len(prompt) for t in cols.tolist()]
            for c, r in zip(round_of, torch.where(match.any(-1), match.float().argmax(-1), MISS).tolist(),
                            strict=True):
                if 0 <= c < starts:
                    ranks[c][d] = int(r)
            if not sampling.greedy:  # token t+2+d is drawn from the target's logits at t+1+d
                p = logits_to_probs(out.logits[0, cols + 1 + d], sampling)[:, draft_ids]
                q = logits_to_probs(logits, sampling)
                both = torch.minimum(p, q).sum(-1)
                chain[d] += both.sum().cpu()
                for c, r in zip(round_of, both.tolist(), strict=True):
                    if 0 <= c < starts:
                        rates[c][d] = float(r)
        traces.append(Trace(tuple(tuple(r) for r in ranks), looked, tuple(tuple(r) for r in rates)))
    # Rates conditional on the previous depths accepted: teacher forcing feeds the target's tokens.
    ranks = tuple(tuple((hits[d] / counts[d]).tolist()) if counts[d] else () for d in range(depth))
    rates = () if sampling.greedy else tuple(float(chain[d] / counts[d]) if counts[d] else 0.0 for d in range(depth))
    by_min = {m: lookup.result(m) for m in HYBRID_MIN_NGRAMS if m > 1}
    at = f" at T={temperature:g}" if temperature > 0 else ""
    return Acceptance(ranks, f"calibration on {len(prompts)} prompts{at}", *lookup.result(), by_min, rates,
                      temperature, tuple(traces))


@torch.no_grad()
def calibrate_block_acceptance(target: Target, drafter, prompts: Sequence[Sequence[int]],
                               max_new_tokens: int = CALIBRATION_TOKENS, temperature: float = 0.0, seed: int = 0,
                               anchors_per_pass: int = 64, **_) -> Acceptance:
    """A block drafter's acceptance per draft position on the target's own continuations of ``prompts``.

    Each prompt is decoded with the drafter (lossless: the target's tokens), then one training-layout pass puts a
    block at every generated position. Greedy: draft d's rate counts only blocks whose drafts 1..d-1 all matched
    (conditional, as the chain formula wants; DSpark's Markov head is fed the target's tokens, which is what it
    sees when they were accepted). At temperature > 0: the mean of sum_x min(p(x), q(x)) at each draft position.
    """
    from draftsmith.data.chat import stop_token_ids

    stops = stop_token_ids(target.tokenizer) if target.tokenizer is not None else ()
    decoder = SpeculativeDecoder(target, drafter)
    sampling = SamplingParams(temperature=temperature)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    draft_ids = drafter.to_target_ids(torch.arange(drafter.config.draft_vocab_size, device=target.device))
    k = drafter.config.num_drafts
    hits, counts, mass, valid = torch.zeros(k), torch.zeros(k), torch.zeros(k), torch.zeros(k)
    lookup = LookupReach()
    traces = []
    for prompt in prompts:
        gen = decoder.generate(list(prompt), max_new_tokens, sampling, eos_token_ids=stops,
                               generator=generator).token_ids
        looked = lookup.add(list(prompt), gen)
        seq = torch.tensor([list(prompt) + gen], device=target.device)
        out = target(seq)
        starts = torch.arange(len(prompt), seq.shape[1] - 1, device=seq.device)  # anchors: the generated tokens
        ranks: list[tuple[int, ...]] = []  # anchor c (answer token c): rank 0 at each slot its draft matched
        slot_rates: list[tuple[float, ...]] = []
        for chunk in starts.split(anchors_per_pass):
            res = drafter.forward_train(out.aux_hidden_states, seq, chunk[None])
            pos, ok = res.positions[0], res.positions[0] >= 0  # [A, k]
            match = (drafter.to_target_ids(res.logits[0].argmax(-1)) == seq[0, pos.clamp(min=0)]) & ok
            before = torch.cat([torch.ones_like(match[:, :1]), match[:, :-1].long().cumprod(-1).bool()], -1) & ok
            hits += (match & before).float().sum(0).cpu()
            counts += before.float().sum(0).cpu()
            valid += ok.float().sum(0).cpu()
            if not sampling.greedy:  # the token at p is drawn from the target's logits at p - 1
                p = logits_to_probs(out.logits[0, (pos - 1).clamp(min=0)], sampling)[..., draft_ids]
                q = logits_to_probs(res.logits[0], sampling)
                both = torch.minimum(p, q).sum(-1) * ok
                mass += both.sum(0).cpu()
                slot_rates += [tuple(r) for r in both.tolist()]
            ranks += [tuple(0 if m else MISS for m in row) for row in match.tolist()]
        traces.append(Trace(tuple(ranks), looked, tuple(slot_rates)))
    rates = tuple(float(hits[d] / counts[d]) if counts[d] else 0.0 for d in range(k))
    chain = () if sampling.greedy else tuple(float(mass[d] / valid[d]) if valid[d] else 0.0 for d in range(k))
    by_min = {m: lookup.result(m) for m in HYBRID_MIN_NGRAMS if m > 1}
    at = f" at T={temperature:g}" if temperature > 0 else ""
    return Acceptance(tuple((r,) for r in rates), f"block calibration on {len(prompts)} prompts{at}",
                      *lookup.result(), by_min, chain, temperature, tuple(traces))


@dataclass
class LookupReach:
    """Prompt lookup replayed on decoded text: at each emitted token, how many of the next ones it proposes right,
    by the length of the n-gram it matched (lookup needing n >= m proposes exactly where the match is >= m)."""

    depth: int = LOOKUP_DEPTH
    positions: int = 0
    spec: NgramSpec = field(init=False)
    proposed: list[int] = field(init=False)  # [n]: positions whose longest recurring n-gram has n tokens
    reach: list[list[int]] = field(init=False)  # [n][d]: of those, how many had lookup's first d+1 tokens right

    def __post_init__(self):
        self.spec = NgramSpec(self.depth)
        self.proposed = [0] * (self.spec.max_ngram + 1)
        self.reach = [[0] * self.depth for _ in self.proposed]

    def add(self, prompt: list[int], gen: list[int]) -> dict[int, tuple[int, ...]]:
        """A round starts after each emitted token but the last: the context ends with it, the rest is ahead.
        Returns, for each n-gram floor of ``HYBRID_MIN_NGRAMS``, lookup's right tokens at each round start
        (MISS where it proposes nothing): a ``rounds.Trace``'s ``lookup``."""
        seq = prompt + gen
        right: list[tuple[int, int]] = []  # (n-gram matched, 0 when nothing is proposed; right tokens)
        for t in range(len(prompt), len(seq) - 1):
            n, proposal = ngram_match(seq[: t + 1], self.spec)
            self.positions += 1
            self.proposed[n] += bool(proposal)
            good = 0
            for d, tok in enumerate(proposal):
                if t + 1 + d >= len(seq) or seq[t + 1 + d] != tok:
                    break
                self.reach[n][d] += 1
                good += 1
            right.append((n if proposal else 0, good))
        return {m: tuple(good if n >= m else MISS for n, good in right) for m in HYBRID_MIN_NGRAMS}

    def result(self, min_ngram: int = 1) -> tuple[tuple[float, ...], float]:
        """(P(lookup's first d+1 tokens are right) for each d, P(it proposes anything)), for lookup that needs
        an n-gram of at least ``min_ngram`` tokens to recur."""
        if not self.positions:
            return (), 0.0
        ns = range(min_ngram, len(self.proposed))
        return (tuple(sum(self.reach[n][d] for n in ns) / self.positions for d in range(self.depth)),
                sum(self.proposed[n] for n in ns) / self.positions)


def acceptance_from_eval(drafter_dir: str | Path) -> Acceptance | None:
    """Top-1 per-position accuracies that training wrote into best/eval.json (None when it did not)."""
    path = Path(drafter_dir) / "eval.json"
    try:
        acc = json.loads(path.read_text())["acc"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Acceptance.from_chain(acc, f"training eval ({path})")


# --- caching ----------------------------------------------------------------------------------------------
def target_key(target: Target) -> dict:
    return {"machine": machine_key(target.device), "target": target.fingerprint(),
            "dtype": str(target.dtype).removeprefix("torch."), "packed": target.packed}


def cached_verify_cost(target: Target, drafter=None, refresh: bool = False, **measure) -> tuple[VerifyCost, bool]:
    """(cost, whether it came from the cache). Keyed by machine, target fingerprint, dtype, drafter shape."""
    key = {**target_key(target), "drafter": drafter.config.shape_key() if drafter is not None else None,
           "measure": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(measure.items())}}
    hit = None if refresh else cache_get("verify-cost", key)
    if hit is not None:
        return VerifyCost.from_dict(hit), True
    cost = measure_verify_cost(target, drafter, **measure)
    cache_put("verify-cost", key, cost.to_dict())
    return cost, False


def _weights_key(drafter_dir: str | Path | None) -> dict | None:
    if drafter_dir is None:
        return None
    files = sorted(Path(drafter_dir).glob("*.safetensors")) + [Path(drafter_dir) / "config.json"]
    return {"dir": str(Path(drafter_dir).resolve()),
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]}


def cached_acceptance(target: Target, drafter, drafter_dir: str | Path | None, prompts: Sequence[Sequence[int]],
                      refresh: bool = False, **calibrate) -> tuple[Acceptance, bool]:
    """Calibrated acceptance, cached for a saved drafter (by its files) on this target and dtype."""
    weights = _weights_key(drafter_dir)
    key = {"target": target.fingerprint(), "dtype": str(target.dtype).removeprefix("torch."), "drafter": weights,
           "prompts": hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:16],
           "calibrate": dict(sorted(calibrate.items())), "lookup_depth": LOOKUP_DEPTH,
           "lookup_min_ngrams": list(HYBRID_MIN_NGRAMS), "traces": 1}
    hit = None if refresh or weights is None else cache_get("acceptance", key)
    if hit is not None:
        return Acceptance.from_dict(hit, ", cached"), True
    calibrate_fn = calibrate_block_acceptance if drafts_blocks(drafter) else calibrate_acceptance
    acc = calibrate_fn(target, drafter, prompts, **calibrate)
    if weights is not None:
        cache_put("acceptance", key, acc.to_dict())
    return acc, False


# --- the whole decision ------------------------------------------------------------------------------------
def curve_ks(candidates: Sequence[Shape] = DEFAULT_CANDIDATES) -> list[int]:
    """The verify-curve points ``auto_shape`` measures: ``DEFAULT_KS`` up to the largest candidate's pass."""
    top = max(verified_tokens(c) for c in candidates)
    return [k for k in DEFAULT_KS if k < top] + [top]  # the rest is interpolated


def auto_shape(target: Target, drafter, drafter_dir: str | Path | None = None,
               candidates: Sequence[Shape] = DEFAULT_CANDIDATES, prompts: Sequence[Sequence[int]] | None = None,
               reps: int = 5, calibrate: dict | None = None, acceptance: Acceptance | None = None
               ) -> tuple[Choice, VerifyCost, Acceptance]:
    """Measure (or read) the cost curve and acceptance, then choose. Calibration falls back to eval.json.

    Calibration prompts: draftsmith's mixed calibration set, out of the training distribution and no evaluation
    set (``stages.calibration``); ``prompts`` overrides it.

    ``acceptance``: already known (the same drafter calibrated in another dtype): only the curve is measured.
    A block drafter weighs its block lengths (``block_candidates``) instead of the EAGLE-3 shapes.
    """
    if drafts_blocks(drafter) and candidates is DEFAULT_CANDIDATES:
        candidates = block_candidates(drafter)
    max_depth = max(draft_depth(c) for c in candidates)
    trees = [tree_of(c) for c in candidates if tree_of(c) is not None]
    max_k = max((t.top_k for t in trees), default=1)
    widths = sorted({1, *(t.top_k for t in trees), *(c.k for c in candidates if isinstance(c, BlockSpec))})
    ks = curve_ks(candidates)
    cost, _ = cached_verify_cost(target, drafter, reps=reps, ks=tuple(ks), draft_widths=tuple(widths))
    acc, where = acceptance, ""
    if acc is None and prompts is None and target.tokenizer is not None:
        from draftsmith.stages.calibration import calibration_set

        cal = calibration_set(drafter_dir, target.tokenizer)  # the mixed set, out of the training distribution
        prompts, where, provenance = cal.prompts, f" ({cal.source})", cal.provenance()
    else:
        provenance = {"set": "given prompts", "count": len(prompts or ())}
    if acc is None and prompts:
        acc, _ = cached_acceptance(target, drafter, drafter_dir, prompts, depth=max_depth, top_k=max_k,
                                   **(calibrate or {}))
        acc = dataclasses.replace(acc, source=acc.source + where, prompts=provenance)
    if (acc is None or not any(acc.ranks)) and drafter_dir is not None:
        acc = acceptance_from_eval(drafter_dir)
    acc = acc or Acceptance((), "none")
    return choose_shape(acc, cost, candidates, max_top_k=drafter.config.draft_vocab_size), cost, acc


def expectation_basis(target: Target, drafter, drafter_dir: str | Path | None, extra: Sequence = (),
                      max_new_tokens: int | None = None, temperature: float = 0.0) -> tuple[Acceptance, VerifyCost]:
    """The calibrated acceptance and the verify curve ``--shape auto`` weighs shapes with (both cached), wide
    enough for ``extra`` shapes too: what a bench sets beside every method it measures."""
    candidates = list(block_candidates(drafter) if drafts_blocks(drafter) else DEFAULT_CANDIDATES)
    top = drafter.config.draft_vocab_size  # a wider tree is refused by the decoder: not weighed here either
    candidates += [s for s in extra if isinstance(s, ChainSpec | TreeSpec | HybridSpec | BlockSpec)
                   and s not in candidates and (tree_of(s) is None or tree_of(s).top_k <= top)]
    calibrate = {"max_new_tokens": calibration_tokens(max_new_tokens),
                 **({"temperature": float(temperature)} if temperature > 0 else {})}
    _, cost, acc = auto_shape(target, drafter, drafter_dir, candidates=candidates, calibrate=calibrate)
    return acc, cost


def calibration_tokens(max_new_tokens: int | None) -> int:
    """Tokens each calibration prompt is decoded for: the run's own length, within bounds.

    Lookup's reach grows with the answer (a long answer repeats itself and its prompt more), so acceptance
    calibrated on 96 tokens under-predicts the hybrids of a 256-token run; below the floor it is noise, and
    past the cap calibration would cost more than the choice is worth.
    """
    if not max_new_tokens:
        return CALIBRATION_TOKENS
    return max(CALIBRATION_MIN_TOKENS, min(int(max_new_tokens), CALIBRATION_MAX_TOKENS))
