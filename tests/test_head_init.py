"""The drafter's read-out starts as the target's: lm_head rows for the draft vocabulary and the final norm."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_chat_model, tiny_target
from safetensors.torch import load_file

from draftsmith.core import vocab as vocab_mod
from draftsmith.model.drafter import init_head_from_target, new_drafter
from draftsmith.model.target import heads_of, load_target, load_target_heads


def _shuffled_vocab(vocab_size: int, n: int, seed: int = 0) -> vocab_mod.DraftVocab:
    """A draft vocabulary that is not the first n ids, so a copy of the wrong rows shows."""
    counts = torch.rand(vocab_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    dv, _ = vocab_mod.from_counts(counts, n)
    assert not torch.equal(dv.d2t, torch.zeros_like(dv.d2t))
    return dv


def _randomize_final_norm(target) -> torch.nn.Module:
    norm = target._decoder.norm
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.3 + 0.2)
    return norm


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3"])
def test_the_read_out_equals_the_targets_over_the_draft_vocabulary(arch):
    target = tiny_target(arch, dtype=torch.float64)
    norm = _randomize_final_norm(target)
    try:
        dv = _shuffled_vocab(target.vocab_size, 40)
        drafter = new_drafter(target, draft_vocab=dv)
        heads = heads_of(target)
        assert init_head_from_target(drafter, heads.lm_head_weight, heads.final_norm_weight)
        x = torch.randn(5, target.hidden_size, dtype=torch.float64)
        ids = dv.d2t + torch.arange(40)
        expected = target.lm_head(norm(x))[:, ids]
        got = drafter.lm_head(drafter.norm(x))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)  # Gemma normalises in float32
    finally:
        with torch.no_grad():  # the tiny target is cached for other tests
            norm.weight.fill_(0.0 if arch.startswith("gemma") else 1.0)


def test_heads_read_from_safetensors_carry_the_final_norm(tmp_path):
    path = save_tiny_chat_model(tmp_path / "m")
    state = load_file(str(path / "model.safetensors"))
    key = "model.norm.weight"
    state[key] = torch.linspace(0.5, 1.5, state[key].numel())
    from safetensors.torch import save_file

    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    heads = load_target_heads(path, dtype=torch.float32)
    torch.testing.assert_close(heads.final_norm_weight, state[key])
    loaded = heads_of(load_target(path, dtype=torch.float32, pack=False))
    torch.testing.assert_close(loaded.final_norm_weight, state[key])


def test_a_drafter_of_another_width_keeps_its_own_head():
    target = tiny_target("llama", dtype=torch.float32)
    drafter = new_drafter(target, draft_vocab_size=32, hidden_size=target.hidden_size * 2,
                          intermediate_size=64)
    before = drafter.lm_head.weight.clone()
    heads = heads_of(target)
    assert not init_head_from_target(drafter, heads.lm_head_weight, heads.final_norm_weight)
    assert torch.equal(drafter.lm_head.weight, before)


def test_train_starts_from_the_targets_head_unless_told_not_to(tmp_path):
    from conftest import self_generated_conversations
    from test_train import _cfg

    from draftsmith.stages.train.run import train

    model = save_tiny_chat_model(tmp_path / "model")
    target = load_target(model, dtype=torch.float32, pack=False)
    convs = self_generated_conversations(target, tmp_path / "c.jsonl", n=8)
    workspace = (tmp_path, model, convs)
    rows = {}
    for flag in (True, False):  # lr 1e-30 (train refuses 0): one step leaves float32 weights bit for bit
        out = tmp_path / f"run-{flag}"
        train(_cfg(workspace, out, max_steps=1, lr=1e-30, init_head=flag, eval_every=1, save_every=1))
        saved = load_file(str(out / "final" / "model.safetensors"))
        ids = saved["d2t"] + torch.arange(saved["d2t"].numel())
        rows[flag] = torch.equal(saved["lm_head.weight"], target.lm_head.weight[ids])
    assert rows == {True: True, False: False}
