"""The verdict of ``draftsmith check``: served acceptance against the expected one, output against plain.

Thresholds, on the accepted part of the acceptance length (gain = tau - 1, what a drafter adds):
* against draftsmith's own decoder on the same prompts (same text, same chain): the engine should match it
  (vLLM measured 0.000 apart, llama.cpp within 0-5%): below ``OWN_PASS`` of its gain is a loss to explain;
* against the card (held-out samples of the training data, not these prompts): prompts differ, so the bar is
  lower (``CARD_PASS``);
* below ``COLLAPSE`` of either gain: a silent collapse (the 2026 reports sit at 1.02-1.2 for 3-4 expected);
* a reference gain below ``MIN_GAIN`` (draftsmith's own decode, or the card, accepts ~nothing): nothing to compare
  with, "cannot tell" (every served number would pass as a share of zero);
* above ``ABOVE_OWN`` of draftsmith's gain on the same prompts (``ABOVE_CARD`` of the card's, other prompts): the
  engine counts otherwise or serves another drafter than the reference read; flagged, as a loss is.
Output: the speculative run must emit plain's tokens. llama.cpp's batched verify rounds differently from its
one-token steps and flips near-ties; a divergence where plain's own top-2 log-probabilities are within ``TIE_NATS``
and the speculative run took the second is a near-tie flip, any other is a real divergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OWN_PASS, CARD_PASS, COLLAPSE = 0.9, 0.8, 0.5
MIN_GAIN = 0.05
ABOVE_OWN, ABOVE_CARD, ABOVE_MARGIN = 1.25, 1.5, 0.1
#: OpenVINO GenAI serves a good drafter below draftsmith's decoder on the same prompts, with output equal to plain
#: (tau -4.9% and -9.3% in two measured runs, 0.86-0.92 of the gain; the cause is GenAI's, not found): its own bar.
OWN_PASS_BY_ENGINE = {"openvino": 0.8}
#: The widest near-tie llama.cpp was measured flipping (0.056-0.10 nats, issue 52), with a margin.
TIE_NATS = 0.12


@dataclass
class Equality:
    compared: int = 0
    identical: int = 0
    near_ties: list[str] = field(default_factory=list)  # "prompt i, token j: 0.07 nats"
    divergences: list[str] = field(default_factory=list)


def compare_outputs(plain: list[list[int]], spec: list[list[int]], top: list | None,
                    tie_nats: float = TIE_NATS) -> Equality:
    """Per prompt: identical, a near-tie flip at the first difference, or a real divergence."""
    eq = Equality()
    for i, (a, b) in enumerate(zip(plain, spec, strict=False)):
        eq.compared += 1
        j = next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if j is None:
            if len(a) == len(b):
                eq.identical += 1
            else:
                eq.divergences.append(f"prompt {i}: {len(b)} tokens where plain emitted {len(a)}")
            continue
        cands = top[i][j] if top is not None and i < len(top) and j < len(top[i]) else []
        lp = {int(t): float(v) for t, v in cands}
        gap = lp[a[j]] - lp[b[j]] if a[j] in lp and b[j] in lp else None
        if gap is not None and gap <= tie_nats:
            eq.near_ties.append(f"prompt {i}, token {j}: {gap:.3f} nats")
        else:
            why = f"{gap:.3f} nats below plain's choice" if gap is not None else "not among plain's top tokens"
            eq.divergences.append(f"prompt {i}, token {j}: took {b[j]} for plain's {a[j]} ({why})")
    return eq


def gain_ratio(served: float, expected: float) -> float:
    """Share of the expected accepted drafts per pass the engine delivers (1: all)."""
    return (served - 1.0) / (expected - 1.0) if expected > 1.0 else 1.0


def acceptance_verdict(served: float, expected: float, against: str, engine: str | None = None) -> str:
    """'pass', 'partial loss', 'silent collapse', or 'cannot tell' (a reference that accepts ~nothing)."""
    if expected - 1.0 < MIN_GAIN:
        return "cannot tell"
    r = gain_ratio(served, expected)
    if r < COLLAPSE:
        return "silent collapse"
    own = OWN_PASS_BY_ENGINE.get(engine or "", OWN_PASS)
    return "pass" if r >= (own if against == "draftsmith" else CARD_PASS) else "partial loss"


def far_above(served: float, expected: float, against: str) -> bool:
    """Served far above the reference: the engine's counters count otherwise, or it serves another drafter."""
    if expected - 1.0 < MIN_GAIN or served - expected <= ABOVE_MARGIN:
        return False
    return gain_ratio(served, expected) > (ABOVE_OWN if against == "draftsmith" else ABOVE_CARD)
