"""Which prompts an acceptance estimate is calibrated on: the drafter's own held-out split, never its training data.

An estimate calibrated on text the drafter was trained on (or on a few hand-written prompts that sit closer to its
training distribution than the user's traffic) promises more than the engine delivers: in a demo run ``--shape
auto`` expected tau 3.00 and MT-bench measured 2.28. Training already holds samples out by a hash of their id
(``stages.train.data.split_eval``); this module finds the run that trained a drafter, recomputes that very split
from the run's config and data, and hands back the held-out samples' prompts. Where there is no run (a drafter
imported from elsewhere) ``shapes.calibration_set`` falls back to the hand-written prompts, and says so.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Held-out prompts a calibration decodes (each for the run's length: see shapes.calibration_tokens).
CALIBRATION_LIMIT = 4


@dataclass(frozen=True)
class CalibrationSet:
    """Prompts as token ids, where they came from, and whether the drafter is known never to have trained on them.

    ``ids``: the samples' ids in the training data (held-out split), empty for the hand-written fallback.
    """

    prompts: list[list[int]]
    source: str
    held_out: bool
    ids: tuple[str, ...] = ()


def _run_config(drafter_dir: str | Path | None) -> tuple[Path, dict] | None:
    from draftsmith.stages.export.card import run_of

    run = run_of(drafter_dir)
    return (run, json.loads((run / "config.json").read_text())) if run is not None else None


def _conversation_prompts(path: Path) -> tuple[list[str], dict[str, str]]:
    """(every conversation id, in file order; each id's first user turn)."""
    from draftsmith.data.records import Conversation, read_jsonl

    ids, first = [], {}
    for _line, conv in read_jsonl(path):
        if not isinstance(conv, Conversation):
            continue
        ids.append(conv.id)
        user = next((m["content"] for m in conv.messages if m["role"] == "user"), None)
        if user:
            first[conv.id] = user
    return ids, first


def _held_out_order(ids: Sequence[str], fraction: float) -> list[int]:
    """Indices of the held-out split (exactly training's), first by id hash: a stable choice of a few."""
    from draftsmith.stages.train.data import _id_hash, split_eval

    _, held = split_eval(list(ids), fraction)
    return sorted(held, key=lambda i: _id_hash(ids[i]))


def heldout_calibration(drafter_dir: str | Path | None, tokenizer, limit: int = CALIBRATION_LIMIT
                        ) -> CalibrationSet | None:
    """Prompts of the samples the drafter's training run held out, or None where the run or its data is gone."""
    found = _run_config(drafter_dir)
    if found is None:
        return None
    run, cfg = found
    fraction = float(cfg.get("eval_fraction") or 0.0)
    if fraction <= 0:
        return None
    if cfg.get("conversations") and Path(cfg["conversations"]).is_file():
        from draftsmith.data.chat import encode_prompt

        ids, first = _conversation_prompts(Path(cfg["conversations"]))
        chat = bool(getattr(tokenizer, "chat_template", None))
        chosen = [ids[i] for i in _held_out_order(ids, fraction) if ids[i] in first][:limit]
        prompts = [list(encode_prompt(tokenizer, first[sid], chat=chat)) for sid in chosen]
    elif cfg.get("store") and Path(cfg["store"]).is_dir():
        from draftsmith.data.store import FeatureStore

        store = FeatureStore(cfg["store"])
        ids = list(store.sample_ids)
        chosen, prompts = [], []
        for i in _held_out_order(ids, fraction):
            s = store.get(i)
            answer = s["loss_mask"].nonzero()
            if answer.numel() == 0 or int(answer[0]) == 0:
                continue
            prompts.append(s["input_ids"][: int(answer[0])].tolist())  # up to the first trained (answer) token
            chosen.append(ids[i])
            if len(prompts) == limit:
                break
    else:
        return None
    if not prompts:
        return None
    return CalibrationSet(prompts, f"{len(prompts)} held-out prompts of {run.name}'s training data (eval split "
                                   f"{fraction:g}, never trained on)", True, tuple(chosen))


def decoded_expectation(target, drafter, cal: CalibrationSet, k: int = 5, max_new_tokens: int = 96) -> dict:
    """The acceptance a greedy chain of 1..k drafts reaches in draftsmith's decoder on ``cal``'s prompts: the
    card's expected numbers, measured by decoding rather than simulated.

    One chain-k decode: a greedy draft at position i depends only on the drafts before it, so P(at least i drafts
    accepted in a pass) also gives the chain of i < k (1 + sum_{j<=i} P(>= j accepted)). Training's simulated
    acceptance (eval.json, teacher-forced) read ~30% above a decode on the test pairs of issue 52 (3.59 vs 2.76 in
    llama.cpp), so a decode is what the card promises when the target is at hand.
    """
    from draftsmith.data.chat import stop_token_ids
    from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder

    stops = list(stop_token_ids(target.tokenizer)) if target.tokenizer is not None else []
    dec = SpeculativeDecoder(target, drafter, ChainSpec(k))
    passes, at_least = 0, [0] * k
    for p in cal.prompts:
        r = dec.generate(list(p), max_new_tokens, eos_token_ids=stops)
        passes += len(r.accepted_per_step)
        at_least = [a + b for a, b in zip(at_least, r.accepted_per_position(k), strict=True)]
    by_k, tau = {}, 1.0
    for i in range(k):
        tau += at_least[i] / passes if passes else 0.0
        by_k[str(i + 1)] = round(tau, 4)
    return {"source": f"draftsmith decode (greedy chain, {max_new_tokens} new tokens) of {cal.source}",
            "held_out": cal.held_out, "passes": passes,
            "per_position": [round(a / passes, 4) if passes else 0.0 for a in at_least], "by_k": by_k}
