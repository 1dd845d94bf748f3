"""Which prompts an acceptance estimate is calibrated on, and the card's expectation measured on them.

Out of distribution, on purpose. The training run's held-out split (issue 52's choice) is the training
distribution: in a demo run calibrated there, ``--shape auto`` expected tau 4.44 and MT-bench measured 2.21 (issue
60). Evaluation sets are out too: what is reported on is never what is tuned on. So calibration decodes the target's
own answers to draftsmith's small mixed prompt set (``data.calibration_prompts``: writing, code, reasoning, maths,
extraction, science, humanities, role play), which no training data and no evaluation set holds. Where the drafter's
training run is found beside it and trained on conversations, prompts that appear in them are dropped.

The expectation is reported as an interval over prompts (a bootstrap, ``stages.rounds``), and what is promised is
its lower end: see ``shapes.conservative_speedup`` for why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Calibration prompts decoded (each for the run's length: see shapes.calibration_tokens): every category of the
#: mixed set once. Enough for a bootstrap over prompts to mean something, few enough to decode in a minute or two.
CALIBRATION_LIMIT = 8
#: The prompt set's name, as the card records it (bump the version when the prompts change).
MIXED_SET = "draftsmith-mixed-v1"


@dataclass(frozen=True)
class CalibrationSet:
    """Prompts as token ids, where they came from, and whether the drafter is known never to have trained on them.

    ``name``: the prompt set (the card records it); ``ids``: each prompt's id within it.
    """

    prompts: list[list[int]]
    source: str
    held_out: bool
    ids: tuple[str, ...] = ()
    name: str = ""

    def provenance(self) -> dict:
        """What the card records: which prompt set, how many prompts and which, whether known held out."""
        return {"set": self.name, "count": len(self.prompts), "ids": list(self.ids), "held_out": self.held_out}


def _training_conversations(drafter_dir: str | Path | None) -> tuple[str, Path | None] | None:
    """(the run's name, its conversations file where it trained on one), or None where no run is beside it."""
    from draftsmith.stages.export.card import run_of

    run = run_of(drafter_dir)
    if run is None:
        return None
    cfg = json.loads((run / "config.json").read_text())
    conv = Path(cfg["conversations"]) if cfg.get("conversations") else None
    return run.name, conv if conv is not None and conv.is_file() else None


def calibration_set(drafter_dir: str | Path | None, tokenizer, limit: int = CALIBRATION_LIMIT) -> CalibrationSet:
    """The first ``limit`` prompts of the mixed calibration set, rendered for ``tokenizer`` (its chat template where
    it has one), less any the drafter's training conversations hold."""
    from draftsmith.data.calibration_prompts import MIXED_PROMPTS
    from draftsmith.data.chat import encode_prompt
    from draftsmith.data.prompts import BenchPrompt, training_overlap

    chosen = [BenchPrompt(f"{MIXED_SET}/{i}-{cat}", [text]) for i, (cat, text) in enumerate(MIXED_PROMPTS[:limit])]
    run = _training_conversations(drafter_dir)
    note = "a drafter from elsewhere: what it trained on is unknown"
    if run is not None:
        name, conv = run
        if conv is not None:
            seen = set(training_overlap(chosen, conv))
            chosen = [p for p in chosen if p.id not in seen]
            note = f"none in {name}'s training conversations" + (f" ({len(seen)} found there, dropped)" if seen else "")
        else:
            note = f"not {name}'s training data (a feature store of other prompts)"
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompts = [list(encode_prompt(tokenizer, p.turns[0], chat=chat)) for p in chosen]
    return CalibrationSet(prompts, f"{len(prompts)} prompts of {MIXED_SET}, the target's own answers (mixed "
                                   f"categories, no evaluation set; {note})", run is not None,
                          tuple(p.id for p in chosen), MIXED_SET)


def decoded_expectation(target, drafter, cal: CalibrationSet, k: int = 5, max_new_tokens: int = 96) -> dict:
    """The acceptance a greedy chain of 1..k drafts reaches in draftsmith's decoder on ``cal``'s prompts: the
    card's expected numbers, measured by decoding rather than simulated, with where they came from.

    One chain-k decode: a greedy draft at position i depends only on the drafts before it, so P(at least i drafts
    accepted in a pass) also gives the chain of i < k (1 + sum_{j<=i} P(>= j accepted)). Training's simulated
    acceptance (eval.json, teacher-forced) read ~30% above a decode on the test pairs of issue 52 (3.59 vs 2.76 in
    llama.cpp), so a decode is what the card promises when the target is at hand.

    ``by_k`` is the lower end of the bootstrap interval over prompts (``rounds.bootstrap``), the conservative
    value ``check`` then holds engines to; ``by_k_point`` and ``by_k_interval`` keep the rest.
    """
    from draftsmith.data.chat import stop_token_ids
    from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder
    from draftsmith.stages.rounds import LEVEL, bootstrap

    stops = list(stop_token_ids(target.tokenizer)) if target.tokenizer is not None else []
    dec = SpeculativeDecoder(target, drafter, ChainSpec(k))
    passes, at_least = [], []  # per prompt
    for p in cal.prompts:
        r = dec.generate(list(p), max_new_tokens, eos_token_ids=stops)
        passes.append(len(r.accepted_per_step))
        at_least.append(r.accepted_per_position(k))
    total = sum(passes)
    by_k, point, spread = {}, {}, {}
    for i in range(k):
        est = bootstrap([n + sum(a[: i + 1]) for n, a in zip(passes, at_least, strict=True)], passes)
        by_k[str(i + 1)] = round(est.low, 4) if total else 1.0
        point[str(i + 1)] = round(est.point, 4) if total else 1.0
        spread[str(i + 1)] = [round(est.low, 4), round(est.high, 4)] if total else [1.0, 1.0]
    return {"source": f"draftsmith decode (greedy chain, {max_new_tokens} new tokens) of {cal.source}",
            "held_out": cal.held_out, "passes": total,
            "prompts": cal.provenance(), "k": k, "temperature": 0.0, "max_new_tokens": max_new_tokens,
            "per_position": [round(sum(a[i] for a in at_least) / total, 4) if total else 0.0 for i in range(k)],
            "by_k": by_k, "by_k_point": point, "by_k_interval": spread, "interval_level": LEVEL}
