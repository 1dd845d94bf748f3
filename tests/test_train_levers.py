"""The field's training levers: the optimizer (AdamW, Muon + AdamW), the EAGLE-3 step losses (kl, tv, nla, lk)
and a draft vocabulary counted on the target's own choices."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.model.ttt import draft_loss
from draftsmith.stages.train.config import TrainError, load_config
from draftsmith.stages.train.optim import MuonAdamW, split_for_muon


# --- the losses against a hand-written reference ----------------------------------------------------------
def _reference(logits: list[list[float]], p: list[list[float]], kind: str) -> float:
    """The loss written from its definition, one row and one token at a time, in plain floats."""
    total = 0.0
    for row, prow in zip(logits, p, strict=True):
        z = math.log(sum(math.exp(x) for x in row))
        q = [math.exp(x - z) for x in row]
        alpha = sum(min(a, b) for a, b in zip(prow, q, strict=True))
        tv = 0.5 * sum(abs(a - b) for a, b in zip(prow, q, strict=True))  # = 1 - alpha for two distributions
        kl = sum(a * (math.log(a) - math.log(b)) for a, b in zip(prow, q, strict=True) if a > 0)
        if kind == "kl":
            total += -sum(a * math.log(b) for a, b in zip(prow, q, strict=True))
        elif kind == "tv":
            total += tv
        elif kind == "nla":
            total += -math.log(alpha)
        else:  # lk: lambda = exp(-3 alpha)
            lam = math.exp(-3.0 * alpha)
            total += lam * kl + (1 - lam) * tv
    return total


def _rows(seed: int, n: int = 5, v: int = 7, one_hot_row: bool = True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    p = (torch.randn(n, v, generator=g, dtype=torch.float64) * 2).softmax(-1)
    if one_hot_row:  # temperature 0's labels: KL's p log p terms at p = 0 must vanish, not turn NaN
        p[0] = torch.nn.functional.one_hot(torch.tensor(3), v).double()
    return logits, p


@pytest.mark.parametrize("kind", ["kl", "tv", "nla", "lk"])
def test_each_loss_equals_its_hand_written_definition(kind):
    for seed in range(3):
        logits, p = _rows(seed)
        got = draft_loss(logits, p, kind)
        assert float(got) == pytest.approx(_reference(logits.tolist(), p.tolist(), kind), rel=1e-5, abs=1e-7)


def test_tv_is_half_the_l1_distance_and_lk_holds_its_blend_weight_constant():
    """TV's value is 0.5 |p - q|_1; LK-lambda's gradient is lambda * grad KL + (1 - lambda) * grad TV with
    lambda a constant (a blend weight that took gradients would move the drafter towards alpha's own slope)."""
    logits, p = _rows(7, one_hot_row=False)
    q = logits.softmax(-1)
    assert float(draft_loss(logits, p, "tv")) == pytest.approx(float(0.5 * (p - q).abs().sum()), rel=1e-9)

    x = logits.clone().requires_grad_(True)
    draft_loss(x, p, "lk").backward()
    lam = torch.exp(-3.0 * torch.minimum(p, q).sum(-1))[:, None]  # computed outside autograd: a constant
    parts = []
    for kind in ("kl", "tv"):
        y = logits.clone().requires_grad_(True)
        draft_loss(y, p, kind).backward()
        parts.append(y.grad)
    # KL(p || q) and soft cross-entropy differ by p's entropy, a constant: the same gradient.
    torch.testing.assert_close(x.grad, lam * parts[0] + (1 - lam) * parts[1], rtol=1e-9, atol=1e-12)


def test_nla_is_cross_entropy_on_one_hot_labels_and_kl_is_the_previous_loss():
    """On one-hot labels -log alpha = -log q[label] (the LK paper's remark); kl is the soft cross-entropy the
    trainer always used, bit for bit."""
    logits, _ = _rows(3)
    labels = torch.tensor([1, 4, 0, 6, 2])
    p = torch.nn.functional.one_hot(labels, 7).double()
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    assert float(draft_loss(logits, p, "nla")) == pytest.approx(float(ce), rel=1e-9)
    logits32, p32 = (t.float() for t in _rows(4))
    assert torch.equal(draft_loss(logits32, p32, "kl"), -(p32 * logits32.log_softmax(-1)).sum())
    with pytest.raises(ValueError, match="unknown loss"):
        draft_loss(logits, p, "js")


@pytest.mark.parametrize("chunk", [0, 3])  # 0: the compiled kernels where a compiler is found; 3: eager chunks
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_fused_soft_cross_entropy_is_kl_on_the_teachers_softmax(chunk, temperature, request):
    """The trainer's fused KL (from both sides' logits, nothing [N, Vd] kept) equals draft_loss's kl on the
    teacher's probabilities, value and gradient, and its argmax is the first maximum, as argmax's."""
    from draftsmith.model.ttt import soft_cross_entropy

    if chunk == 0:
        request.getfixturevalue("compiled_loss")  # the tests run eagerly otherwise (conftest.py)

    logits, _ = _rows(5)
    teacher = torch.randn(5, 7, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 3
    logits[2, 4] = logits[2, 1] = logits[2].max() + 1  # a tie: the first index wins
    x, y = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    got, drafted = soft_cross_entropy(x, teacher, temperature, chunk=chunk)
    ref = draft_loss(y, (teacher / temperature).softmax(-1), "kl")
    assert float(got) == pytest.approx(float(ref), rel=1e-12)
    got.backward()
    ref.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(drafted, logits.argmax(-1)) and int(drafted[2]) == 1
    empty = logits[:0].clone().requires_grad_(True)  # a batch with no trained row: zero, and a gradient
    none, no_drafts = soft_cross_entropy(empty, teacher[:0], temperature, chunk=chunk)
    none.backward()
    assert float(none) == 0.0 and no_drafts.numel() == 0 and empty.grad.shape == (0, 7)
    with pytest.raises(ValueError, match="temperature"):
        soft_cross_entropy(x, teacher, 0.0)


# --- Muon: which parameters, and the optimizer's state ---------------------------------------------------
def test_muon_takes_the_hidden_matrices_and_adamw_the_tables_heads_and_vectors():
    from conftest import tiny_target

    from draftsmith.model.block_drafter import new_block_drafter
    from draftsmith.model.drafter import new_drafter

    target = tiny_target("llama")
    eagle = new_drafter(target, draft_vocab_size=200, seed=3, norm_before_fc=True)
    muon, adamw = split_for_muon(list(eagle.named_parameters()))
    assert {n for n, _ in muon} == {"fc.weight", *(f"layers.0.self_attn.{x}_proj.weight" for x in "qkvo"),
                                    *(f"layers.0.mlp.{x}_proj.weight" for x in ("gate", "up", "down"))}
    assert "lm_head.weight" in {n for n, _ in adamw} and all(p.ndim == 1 or "lm_head" in n for n, p in adamw)
    block = new_block_drafter(target, "dspark", draft_vocab_size=200)
    muon, adamw = split_for_muon(list(block.named_parameters()))
    names = {n for n, _ in adamw}
    assert {"lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias"} <= names  # [1, N]: a vector, not a matrix
    assert all(p.ndim == 2 and min(p.shape) > 1 for _, p in muon) and len(muon) == 1 + 2 * 7
    assert len(muon) + len(adamw) == len(list(block.parameters()))


def test_muon_adamw_steps_both_halves_and_its_state_round_trips():
    """One scheduler drives both halves' learning rates; a state dict saved mid-run and loaded into a fresh
    optimizer continues exactly as the original does."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(6, 4, generator=g), torch.randn(4, generator=g)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(6)]

    def make():
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = MuonAdamW([params[0]], [params[1]], lr=1e-2, muon_lr=1e-1, weight_decay=0.0, muon_weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return params, opt, sched

    def run(params, opt, sched, steps):
        for gs in steps:
            for p, gr in zip(params, gs, strict=True):
                p.grad = gr.clone()
            opt.step()
            sched.step()

    a = make()
    run(*a, grads)
    b = make()
    run(*b, grads[:3])
    assert [grp["lr"] for grp in b[1].param_groups] == pytest.approx([1e-1 / 4, 1e-2 / 4])
    state, sched_state = b[1].state_dict(), b[2].state_dict()
    c = make()
    c[1].load_state_dict(state)
    c[2].load_state_dict(sched_state)
    for p, q in zip(c[0], b[0], strict=True):
        p.data.copy_(q.data)
    run(*c, grads[3:])
    for p, q in zip(a[0], c[0], strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(a[0][0], start[0]) and not torch.equal(a[0][1], start[1])
    with pytest.raises(ValueError, match="Muon"):
        c[1].load_state_dict(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]).state_dict())


def test_options_of_another_optimizer_or_kind_are_refused(tmp_path):
    base = dict(store=str(tmp_path), out=str(tmp_path / "o"))
    with pytest.raises(TrainError, match="--muon-lr.*add --optimizer muon"):
        load_config(None, {**base, "muon_lr": 0.01})
    with pytest.raises(TrainError, match="--loss must be"):
        load_config(None, {**base, "loss": "js"})
    with pytest.raises(TrainError, match="--loss tv: an eagle3 option"):
        load_config(None, {**base, "loss": "tv", "kind": "dspark"})
    assert load_config(None, {**base, "optimizer": "muon", "muon_lr": 0.01, "loss": "lk"}).loss == "lk"


# --- the trainer: resume exact with Muon, EAGLE-3 and a block drafter ------------------------------------
@pytest.fixture(scope="module")
def store_workspace(tmp_path_factory):
    from conftest import save_tiny_chat_model, self_generated_conversations

    from draftsmith.model.target import load_target
    from draftsmith.stages.capture import CaptureConfig, run_capture

    root = tmp_path_factory.mktemp("optim")
    model = save_tiny_chat_model(root / "model")
    target = load_target(model, dtype=torch.float32)
    convs = self_generated_conversations(target, root / "conversations.jsonl", n=24)
    store = root / "store"
    run_capture(CaptureConfig(conversations=convs, out=store, target=str(model), max_length=256,
                              aux_layers=(1, 3, 5), draft_vocab_size=300, progress=False))
    return model, store


def _cfg(ws, out, **kw):
    model, store = ws
    base = dict(target=str(model), store=str(store), out=str(out), max_steps=10, batch_tokens=512, ttt_steps=2,
                lr=3e-3, warmup_steps=2, eval_every=5, save_every=3, eval_fraction=0.15, progress=False,
                plot=False, autocast="off", optimizer="muon")
    base.update(kw)
    return load_config(None, base)


@pytest.mark.parametrize("kind", ["eagle3", "dspark"])
def test_a_muon_run_resumes_exactly(store_workspace, tmp_path, kind):
    """Stopped after step 4 and resumed, a Muon run (its momentum buffers and AdamW moments checkpointed)
    ends with the weights of a straight run; a resume with the other optimizer is refused."""
    from draftsmith.stages.train.run import train

    extra = dict(kind="dspark", num_anchors=16, block_size=3, markov_rank=8) if kind == "dspark" else dict(loss="lk")
    straight = train(_cfg(store_workspace, tmp_path / "a", **extra))
    train(_cfg(store_workspace, tmp_path / "b", stop_at_step=4, **extra))
    blob = torch.load(tmp_path / "b" / "checkpoints" / "step-0000004" / "trainer_state.pt", weights_only=True)
    assert blob["optimizer"]["muon"]["state"] and blob["optimizer"]["adamw"]["state"]
    with pytest.raises(TrainError, match="another config.*optimizer"):
        train(_cfg(store_workspace, tmp_path / "b", resume=True, optimizer="adamw", **extra))
    resumed = train(_cfg(store_workspace, tmp_path / "b", resume=True, **extra))
    assert straight.steps == resumed.steps == 10
    a = load_file(tmp_path / "a" / "final" / "model.safetensors")
    b = load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert straight.last_eval == resumed.last_eval


@pytest.mark.slow
def test_a_muon_run_under_torchrun_two_processes_gloo(store_workspace, tmp_path):
    """Muon under torchrun (gradients averaged over ranks before its step): the run finishes and rank 0's
    checkpoint holds both halves' state."""
    import os
    import subprocess
    import sys

    model, store = store_workspace
    cfg = tmp_path / "train.toml"
    cfg.write_text(f'target = "{model}"\nstore = "{store}"\noptimizer = "muon"\nloss = "lk"\nmax_steps = 3\n'
                   f'ttt_steps = 2\nbatch_tokens = 256\nautocast = "off"\nprogress = false\nplot = false\n'
                   f'eval_every = 3\nsave_every = 3\nout = "{tmp_path / "ddp"}"\n')
    # --standalone: the rendezvous on a free port (a fixed one collides with a concurrent run of this test)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "draftsmith.cli", "train", "--config", str(cfg)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blob = torch.load(tmp_path / "ddp" / "checkpoints" / "step-0000003" / "trainer_state.pt", weights_only=True)
    assert blob["optimizer"]["muon"]["state"]


# --- the draft vocabulary counted on the target's own choices --------------------------------------------
def test_vocab_from_target_counts_the_targets_greedy_choice_before_each_loss_position(store_workspace, tmp_path,
                                                                                      capsys):
    from draftsmith.cli import main
    from draftsmith.core.vocab import load_vocab_file
    from draftsmith.data.store import FeatureStore
    from draftsmith.model.target import load_target_heads
    from draftsmith.stages.capture import build_vocab

    model, store = store_workspace
    head = load_target_heads(str(model), dtype=torch.float32).lm_head_weight
    fs = FeatureStore(store)
    expected = torch.zeros(head.shape[0], dtype=torch.int64)
    for s in fs:  # plainly: every position t whose token is a loss token, the full logits at t - 1
        for t in range(1, len(s["input_ids"])):
            if s["loss_mask"][t]:
                expected[int((head @ s["hidden_state"][t - 1].float()).argmax())] += 1
    report = build_vocab(store, 40, out=tmp_path / "t.safetensors", source="target", lm_head_weight=head)
    vocab, counts, meta = load_vocab_file(tmp_path / "t.safetensors", head.shape[0])
    assert torch.equal(counts, expected) and "argmax" in meta["counted"]
    assert report.counted_tokens == int(expected.sum()) and vocab.draft_vocab_size == 40
    with pytest.raises(ValueError, match="lm_head"):
        build_vocab(store, 40, out=tmp_path / "x.safetensors", source="target")

    capsys.readouterr()
    out = tmp_path / "cli.safetensors"
    assert main(["vocab", "--store", str(store), "--from", "target", "--target", str(model), "--draft-vocab-size",
                 "40", "--out", str(out)]) == 0
    assert torch.equal(load_vocab_file(out, head.shape[0])[1], expected)
    assert main(["vocab", "--store", str(store), "--from", "target", "--out", str(out)]) == 2
    assert "needs --target" in capsys.readouterr().err
