"""bench's own arithmetic: the speedup bound and the tie test that explains half-precision divergences."""

from __future__ import annotations

import torch

from draftsmith.app.bench import diverged_at_tie, speedup_bound
from draftsmith.model.target import Target
from draftsmith.stages.decode import SpeculativeDecoder
from draftsmith.testing.models import build_tiny_model


def test_speedup_bound_is_tau_times_step_over_round():
    plain = {"verify_passes": 0, "step_time": 0.05}
    method = {"verify_passes": 10, "verify_time": 0.6, "draft_time": 0.1, "acceptance_length": 2.1}
    assert abs(speedup_bound(method, plain) - 2.1 * 0.05 / 0.07) < 1e-12
    assert speedup_bound(plain, plain) is None


def test_diverged_at_tie_tells_rounding_ties_from_real_differences():
    model = build_tiny_model("llama", seed=0, dtype=torch.float32, num_hidden_layers=4)
    target = Target(model)
    prompt = [5, 9, 17, 3]
    plain = SpeculativeDecoder(target, None, None).generate(prompt, 6).token_ids
    j = 3
    with torch.no_grad():
        logits = target(torch.tensor([prompt + plain[:j]]), cache=target.new_cache()).logits[0, -1]
        worst = int(logits.argmin())
        # A token whose output row equals the chosen token's: its logit is the same number, an exact tie.
        twin = worst
        target.lm_head.weight[twin] = target.lm_head.weight[plain[j]]
    assert diverged_at_tie(target, prompt, plain, plain[:j] + [twin])
    target.lm_head.weight.data[twin] = -target.lm_head.weight.data[plain[j]]  # now far apart
    assert not diverged_at_tie(target, prompt, plain, plain[:j] + [twin])
    # One output a prefix of the other (a stop token in one only) is not a tie.
    assert not diverged_at_tie(target, prompt, plain, plain[:j])
