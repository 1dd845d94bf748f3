"""Block drafters' training (DFlash, DSpark): anchors, the block-sparse attention, the loss, the trainer."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.stages.train.block import BlockSpec, block_attention, block_labels, sample_anchors


def _dense_block_attention(q, k_blk, v_blk, k_ctx, v_ctx, rows, anchors):
    """Each block on its own, written plainly: keys = the context before the anchor, then the block's own."""
    rep = q.shape[1] // k_ctx.shape[1]
    out = []
    for m in range(q.shape[0]):
        r, a = int(rows[m]), int(anchors[m])
        k = torch.cat([k_ctx[r, :, :a], k_blk[m]], dim=1).repeat_interleave(rep, 0)
        v = torch.cat([v_ctx[r, :, :a], v_blk[m]], dim=1).repeat_interleave(rep, 0)
        scores = q[m] @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        out.append(scores.softmax(-1) @ v)
    return torch.stack(out)


def test_block_attention_sees_the_context_before_its_anchor_and_its_own_block():
    """The flash-kernel layout equals a dense per-block attention, values and gradients, grouped K/V heads,
    several blocks per row (one of them anchored at 1: one context key)."""
    g = torch.Generator().manual_seed(0)
    b, t, kv, heads, bs, d = 2, 13, 2, 4, 3, 8
    rows, anchors = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1, 5, 11, 3, 9])
    m = rows.numel()
    q = torch.randn(m, heads, bs, d, generator=g, requires_grad=True)
    k_blk, v_blk = (torch.randn(m, kv, bs, d, generator=g, requires_grad=True) for _ in range(2))
    k_ctx, v_ctx = (torch.randn(b, kv, t, d, generator=g, requires_grad=True) for _ in range(2))
    inputs = [q, k_blk, v_blk, k_ctx, v_ctx]
    fast = block_attention(*inputs, rows, anchors)
    ref = _dense_block_attention(*inputs, rows, anchors)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    up = torch.randn(fast.shape, generator=g)
    for a, r in zip(torch.autograd.grad(fast, inputs, up), torch.autograd.grad(ref, inputs, up), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)
    # A context key at or after the anchor changes nothing: only keys before it are seen.
    k2 = k_ctx.detach().clone()
    k2[0, :, 5:] += 100.0
    again = block_attention(q, k_blk, v_blk, k2, v_ctx, rows, anchors)
    torch.testing.assert_close(again[:2], fast[:2])  # the blocks anchored at 1 and 5 of row 0
    assert not torch.allclose(again[2], fast[2])  # the block anchored at 11 sees keys 5..10


@pytest.mark.parametrize("path", ["flash", "plain"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_attention_merges_ragged_blocks_exactly(path, dtype, monkeypatch):
    """Rows holding different numbers of blocks (one none), listed out of row order, anchored at 1 (one context
    key) and at the last position (every key but one): the per-row layout and the log-sum-exp merge of each
    block's own keys equal the dense per-block attention, values and every input's gradient, in the CPU flash
    kernel and in the plain path that other devices take."""
    from draftsmith.stages.train import block

    if path == "plain":
        monkeypatch.setattr(block, "_CPU_FLASH", None)
    g = torch.Generator().manual_seed(1)
    b, t, kv, heads, bs, d = 3, 11, 3, 6, 4, 16
    rows, anchors = torch.tensor([2, 0, 2, 2, 0, 2]), torch.tensor([10, 1, 1, 5, 10, 6])
    m = rows.numel()
    q = torch.randn(m, heads, bs, d, generator=g, dtype=dtype, requires_grad=True)
    k_blk, v_blk = (torch.randn(m, kv, bs, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    k_ctx, v_ctx = (torch.randn(b, kv, t, d, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    inputs = [q, k_blk, v_blk, k_ctx, v_ctx]
    fast = block.block_attention(*inputs, rows, anchors)
    ref = _dense_block_attention(*inputs, rows, anchors)
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(fast, ref, **tol)
    up = torch.randn(fast.shape, generator=g, dtype=dtype)
    for a, r in zip(torch.autograd.grad(fast, inputs, up), torch.autograd.grad(ref, inputs, up), strict=True):
        torch.testing.assert_close(a, r, **tol)


def test_block_attention_in_bf16_stays_close_to_the_exact_attention():
    """Under bf16 autocast the kernel runs in bf16 and merges in float32: within bf16's rounding of the exact."""
    from draftsmith.stages.train.block import block_attention

    g = torch.Generator().manual_seed(2)
    b, t, kv, heads, bs, d = 2, 40, 3, 9, 7, 64
    rows, anchors = torch.tensor([0, 0, 1, 1, 1]), torch.tensor([3, 30, 1, 20, 38])
    inputs = [torch.randn(rows.numel(), heads, bs, d, generator=g), *(torch.randn(rows.numel(), kv, bs, d,
              generator=g) for _ in range(2)), *(torch.randn(b, kv, t, d, generator=g) for _ in range(2))]
    fast = block_attention(*(x.bfloat16() for x in inputs), rows, anchors)
    ref = _dense_block_attention(*(x.double() for x in inputs), rows, anchors)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.double(), ref, atol=3e-2, rtol=3e-2)


def test_anchors_are_distinct_answer_positions_with_a_scored_first_label():
    answer = torch.zeros(3, 12, dtype=torch.bool)
    answer[0, 4:] = True  # answer tokens 4..11, length 12: candidates 4..10
    answer[1, 2:6] = True  # length 8: 2..6 answer tokens... candidates with a next answer: 2..4
    answer[2, 0:2] = True  # a 1-token context: candidate 1 needs answer[2] (False): none
    lengths = torch.tensor([12, 8, 12])
    rows, anchors = sample_anchors(answer, lengths, num_anchors=100)
    got = {(int(r), int(a)) for r, a in zip(rows, anchors, strict=True)}
    assert got == {(0, a) for a in range(4, 11)} | {(1, a) for a in range(2, 5)}
    assert rows.tolist() == sorted(rows.tolist())
    # A cap draws that many, at random, distinct, and the same from the same generator.
    r1, a1 = sample_anchors(answer, lengths, 3, torch.Generator().manual_seed(1))
    r2, a2 = sample_anchors(answer, lengths, 3, torch.Generator().manual_seed(1))
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    assert r1.tolist() == [0, 0, 0, 1, 1, 1] and len(set(zip(r1.tolist(), a1.tolist(), strict=True))) == 6
    draws = {tuple(sample_anchors(answer, lengths, 3, torch.Generator().manual_seed(s))[1][:3].tolist())
             for s in range(20)}
    assert len(draws) > 5


@pytest.mark.parametrize("next_token", [True, False])
def test_labels_are_the_slots_tokens_and_scoring_stops_at_the_first_unscored_label(next_token):
    spec = BlockSpec(block_size=4, next_token=next_token)
    answer = torch.ones(1, 10, dtype=torch.bool)
    answer[0, 7] = False  # a prompt token inside (a second user turn)
    labels, scored = block_labels(spec, answer, torch.tensor([9]), torch.tensor([0, 0]), torch.tensor([2, 5]))
    if next_token:  # slot k predicts x[a+k+1]: 4 drafts
        assert labels.tolist() == [[3, 4, 5, 6], [6, 7, 8, 9]]
        assert scored.tolist() == [[True] * 4, [True, False, False, False]]
    else:  # slot k predicts x[a+k], the anchor's slot nothing: 3 drafts
        assert labels.tolist() == [[3, 4, 5], [6, 7, 8]]
        assert scored.tolist() == [[True] * 3, [True, False, False]]
    assert spec.drafted == (4 if next_token else 3)


# --- the objective on a real block drafter ------------------------------------------------------------------
VARIANTS = {  # both slot conventions and every Markov head type
    "dflash": ("dflash", {}),
    "dspark": ("dspark", {"markov_rank": 16}),
    "dspark-fill-in-gated": ("dspark", {"markov_rank": 8, "sample_from_anchor": False, "block_size": 5,
                                        "markov_head_type": "gated", "confidence_head_with_markov": False}),
    "dspark-rnn": ("dspark", {"markov_rank": 8, "markov_head_type": "rnn", "block_size": 4}),
}


def _case(name: str, draft_vocab_size: int = 200):
    """A block drafter on a tiny target, a 2-row batch (one row padded, prompts and answers mixed), its teacher."""
    from conftest import block_target

    from draftsmith.model.block_drafter import new_block_drafter
    from draftsmith.model.ttt import TTTBatch, teacher_targets

    target = block_target("llama")
    kind, overrides = VARIANTS[name]
    d = new_block_drafter(target, kind, draft_vocab_size=draft_vocab_size, **overrides)
    target.set_aux_hidden_state_layers(d.config.aux_layer_ids)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 256, (2, 24), generator=g)
    out = target(ids)
    answer = torch.zeros(2, 24, dtype=torch.bool)
    answer[0, 5:] = True
    answer[0, 14:16] = False  # a second prompt inside the first row
    answer[1, 3:] = True
    batch = TTTBatch(ids, answer, torch.cat(out.aux_hidden_states, -1), out.hidden_state, torch.tensor([24, 17]))
    kept = d.to_target_ids(torch.arange(d.config.draft_vocab_size))
    teacher = teacher_targets(batch, target.lm_head.weight, kept, d.t2d)
    return d, batch, teacher


@pytest.mark.parametrize("name", VARIANTS)
def test_block_hidden_equals_the_models_training_pass(name):
    """The block-sparse pass equals the model's own dense-masked forward_train (which equals its decoding path),
    blocks from both rows, a short row's padding never seen."""
    from draftsmith.stages.train.block import block_hidden

    d, batch, _ = _case(name)
    rows, anchors = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 9, 4, 11])
    with torch.no_grad():
        fast = block_hidden(d, batch, rows, anchors)
        for r in (0, 1):
            ref = d.forward_train(batch.aux_hidden_states[r:r + 1], batch.input_ids[r:r + 1],
                                  anchors[rows == r][None]).hidden[0]
            torch.testing.assert_close(fast[rows == r], ref, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["dspark", "dspark-fill-in-gated", "dspark-rnn"])
def test_batched_greedy_drafts_are_decodings_wherever_the_acceptance_counts_read_them(name):
    """The acceptance counts' drafts, from one batched Markov pass, equal the decoder's left-to-right greedy drafts
    (each slot biased by the draft before it) up to and including the first slot whose earlier drafts all were the
    target's choices, for every Markov head type; a strong Markov head, so that the previous token decides."""
    from draftsmith.stages.train.block import greedy_drafts

    d, _, _ = _case(name)
    with torch.no_grad():
        d.markov_head.markov_w1.weight.mul_(100.0)
        d.markov_head.markov_w2.weight.mul_(300.0)
    g = torch.Generator().manual_seed(3)
    m, k, vd = 40, d.config.num_drafts, d.config.draft_vocab_size
    hidden = torch.randn(m, k, d.config.hidden_size, generator=g, dtype=d.fc.weight.dtype)
    base = d.logits(hidden).float().detach()
    first = torch.randint(0, d.config.vocab_size, (m,), generator=g)
    with torch.no_grad():  # the decoder's loop
        prev, state, seq = first, None, []
        for j in range(k):
            bias, state = d.markov_bias(prev, hidden[:, j], state)
            seq.append((base[:, j] + bias.float()).argmax(-1))
            prev = d.to_target_ids(seq[-1])
        seq = torch.stack(seq, dim=1)
    with torch.no_grad():  # the previous token decides most drafts
        other = (base[:, 0] + d.markov_bias(first.roll(1), hidden[:, 0])[0].float()).argmax(-1)
    assert (other != seq[:, 0]).float().mean() > 0.5
    assert torch.equal(greedy_drafts(d, base, hidden, first, seq), seq)  # the target chose every draft
    choice = seq.clone()
    miss = torch.randint(0, k, (m,), generator=g)  # each block's first miss
    choice[torch.arange(m), miss] = (seq[torch.arange(m), miss] + 1) % vd
    got = greedy_drafts(d, base, hidden, first, choice)
    read = torch.arange(k)[None] <= miss[:, None]
    assert torch.equal(got[read], seq[read])


def _reference_loss(d, batch, teacher, spec, rows, anchors):
    """The block loss written out block by block and slot by slot (DeepSpec's definition, notes/block-training.md)."""
    probs, choice, in_draft = teacher
    k = d.config.num_drafts
    ce_n = ce_d = l1_n = l1_d = bce_n = bce_d = 0.0
    correct, total = [0.0] * k, [0.0] * k
    for r, a in zip(rows.tolist(), anchors.tolist(), strict=True):
        out = d.forward_train(batch.aux_hidden_states[r:r + 1], batch.input_ids[r:r + 1], torch.tensor([[a]]))
        n = int(batch.lengths[r])
        prev, state, accepted = batch.input_ids[r, a], None, True
        for j in range(k):
            p = a + 1 + j  # draft j's label
            if p >= n or not all(bool(batch.loss_mask[r, i]) for i in range(a + 1, p + 1)):
                break  # this slot and every later one are not scored
            w = math.exp(-j / spec.gamma)
            logits = out.logits[0, 0, j].double()
            q = logits.softmax(-1)
            l1 = (q - probs[r, p - 1].double()).abs().sum()
            l1_n, l1_d = l1_n + w * l1, l1_d + w
            if bool(in_draft[r, p - 1]):
                ce_n, ce_d = ce_n - w * logits.log_softmax(-1)[choice[r, p - 1]], ce_d + w
            if out.confidence is not None:
                c = out.confidence[0, 0, j].double()
                bce = torch.nn.functional.binary_cross_entropy_with_logits(c, (1 - l1 / 2).detach())
                bce_n, bce_d = bce_n + w * bce, bce_d + w
            # Acceptance at T=0: the greedy draft, its Markov bias fed the previous draft.
            base = d.logits(out.hidden[0, 0, j]).double()
            if d.markov_head is not None:
                bias, state = d.markov_bias(prev[None], out.hidden[0, 0, j][None], state)
                base = base + bias[0].double()
            draft = int(base.argmax())
            prev = d.to_target_ids(torch.tensor(draft))
            if accepted:
                total[j] += 1
                accepted = bool(in_draft[r, p - 1]) and draft == int(choice[r, p - 1])
                correct[j] += accepted
    loss = spec.ce_weight * ce_n / max(ce_d, 1e-6) + spec.l1_weight * l1_n / max(l1_d, 1e-6)
    if d.confidence_head is not None and spec.confidence_weight:
        loss = loss + spec.confidence_weight * bce_n / max(bce_d, 1e-6)
    return loss, correct, total


@pytest.mark.parametrize("name", ["dspark", "dspark-fill-in-gated", "dflash"])
def test_block_objective_equals_a_hand_written_reference(name):
    """Loss (CE to the target's choice + L1 of probabilities + confidence BCE to 1 - TV, each decay-weighted over the
    scored prefix), its gradients, and the per-slot greedy acceptance counts, on anchors drawn by the objective."""
    from draftsmith.stages.train.block import BlockSpec, block_objective, sample_anchors

    d, batch, teacher = _case(name)
    d = d.train()
    spec = BlockSpec(block_size=d.config.block_size, next_token=d.config.sample_from_anchor, num_anchors=6,
                     gamma=2.0, ce_weight=0.3, l1_weight=0.7, confidence_weight=0.5)
    answer = batch.loss_mask & (torch.arange(24)[None] < batch.lengths[:, None])
    rows, anchors = sample_anchors(answer, batch.lengths, 6, torch.Generator().manual_seed(7))
    assert rows.tolist() == [0] * 6 + [1] * 6
    params = [p for p in d.parameters() if p.requires_grad]
    loss, stats = block_objective(d, batch, teacher, spec, torch.Generator().manual_seed(7))
    ref, correct, total = _reference_loss(d, batch, teacher, spec, rows, anchors)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-8)
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref, params), strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-8)
    assert stats.correct == correct and stats.total == total
    assert total[0] == 12 and 0 < sum(total) < 12 * d.config.num_drafts  # some blocks run past a prompt or the end


# --- the trainer: offline and online, resume, refusals, the CLI ----------------------------------------------
@pytest.fixture(scope="module")
def block_workspace(tmp_path_factory):
    """A tiny chat target, its own answers, and a store captured at 4 layers (any list, not EAGLE-3's 3)."""
    from conftest import save_tiny_chat_model, self_generated_conversations

    from draftsmith.model.target import load_target
    from draftsmith.stages.capture import CaptureConfig, run_capture

    root = tmp_path_factory.mktemp("block")
    model = save_tiny_chat_model(root / "model")
    target = load_target(model, dtype=torch.float32)
    convs = self_generated_conversations(target, root / "conversations.jsonl", n=32)
    store = root / "store"
    run_capture(CaptureConfig(conversations=convs, out=store, target=str(model), max_length=256,
                              aux_layers=(1, 3, 5, 6), draft_vocab_size=300, progress=False))
    return root, model, convs, store


def _block_cfg(ws, out, kind, **kw):
    from draftsmith.stages.train.config import load_config

    root, model, convs, store = ws
    base = dict(target=str(model), store=str(store), out=str(out), kind=kind, max_steps=30, batch_tokens=512,
                lr=3e-3, warmup_steps=2, eval_every=10, save_every=5, eval_fraction=0.15, progress=False, plot=False,
                autocast="off", num_anchors=32, block_size=4)
    if kind == "dspark":
        base["markov_rank"] = 16
    base.update(kw)
    return load_config(None, base)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_offline_block_training_learns(block_workspace, tmp_path, kind):
    """On the store's 4 layers: the loss falls, held-out acceptance rises, best/ is a block drafter of the kind
    reading the store's layers, and the decoder drafts with it token-exact to plain greedy."""
    from draftsmith.model.kinds import load_any
    from draftsmith.model.target import load_target
    from draftsmith.stages.decode import SpeculativeDecoder
    from draftsmith.stages.train.logs import read_metrics
    from draftsmith.stages.train.run import train

    # The untrained drafter's held-out acceptance: one step at a learning rate that moves nothing.
    untrained = train(_block_cfg(block_workspace, tmp_path / "untrained", kind, max_steps=1, lr=1e-12, eval_every=1))
    result = train(_block_cfg(block_workspace, tmp_path / kind, kind))
    rows = read_metrics(tmp_path / kind)
    losses = [r["loss"] for r in rows if not r.get("eval") and "loss" in r]
    evals = [r for r in rows if r.get("eval")]
    assert result.steps == 30 and losses[-1] < losses[0] and evals[-1]["loss"] < evals[0]["loss"]
    assert untrained.best_simulated_acceptance_length < 1.1
    assert result.best_simulated_acceptance_length > untrained.best_simulated_acceptance_length + 0.5
    drafts = 4 if kind == "dspark" else 3
    assert len([k for k in evals[-1] if k.startswith("eval_acc_")]) == drafts
    root, model, convs, store = block_workspace
    target = load_target(model, dtype=torch.float32)
    drafter = load_any(tmp_path / kind / "best", target)
    assert drafter.kind == kind and drafter.config.target_layer_ids == (0, 2, 4, 5)
    tok = target.tokenizer
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "the cat sat"}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    plain = SpeculativeDecoder(target).generate(prompt, 30)
    spec = SpeculativeDecoder(target, drafter).generate(prompt, 30)
    assert spec.token_ids == plain.token_ids and spec.acceptance_length > 1.2


def test_block_resume_is_exact(block_workspace, tmp_path):
    """Killed after step 7 and resumed, a dspark run ends with the weights of a straight run: the anchors drawn
    after the resume are the ones the straight run drew (the checkpoint keeps the RNG)."""
    from safetensors.torch import load_file

    from draftsmith.stages.train.run import train

    cfg = dict(max_steps=12, eval_every=6, save_every=4)
    straight = train(_block_cfg(block_workspace, tmp_path / "a", "dspark", **cfg))
    train(_block_cfg(block_workspace, tmp_path / "b", "dspark", stop_at_step=7, **cfg))
    resumed = train(_block_cfg(block_workspace, tmp_path / "b", "dspark", resume=True, **cfg))
    assert straight.steps == resumed.steps == 12
    a = load_file(tmp_path / "a" / "final" / "model.safetensors")
    b = load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("markov_head.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert straight.last_eval == resumed.last_eval


def test_store_layers_other_than_the_drafters_are_refused_with_one_line(block_workspace, tmp_path, capsys):
    from draftsmith.cli import main
    from draftsmith.stages.train.config import TrainError
    from draftsmith.stages.train.run import train

    root, model, convs, store = block_workspace
    with pytest.raises(TrainError, match=r"holds target layers \[0, 2, 4, 5\].*reads target_layer_ids \[1, 2, 4, 5\]"
                                         r".*--aux-layers 2,3,5,6 or train with --target-layer-ids 0,2,4,5"):
        train(_block_cfg(block_workspace, tmp_path / "x", "dflash", target_layer_ids="1,2,4,5"))
    capsys.readouterr()
    argv = ["train", "--kind", "dspark", "--target", str(model), "--store", str(store), "--out", str(tmp_path / "y"),
            "--target-layer-ids", "0,2,4", "--no-progress", "--no-plot"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("draftsmith: error:") and "--aux-layers 1,3,5" in err[0], err
    assert not (tmp_path / "y" / "checkpoints").exists()
    # An EAGLE-3 run is refused a block option instead of ignoring it; a dflash run a DSpark head.
    assert main(["train", "--store", str(store), "--out", str(tmp_path / "z"), "--block-size", "4"]) == 2
    assert "dflash/dspark option" in capsys.readouterr().err
    assert main(["train", "--kind", "dflash", "--store", str(store), "--out", str(tmp_path / "z"),
                 "--markov-rank", "8"]) == 2
    assert "dspark option" in capsys.readouterr().err


def test_train_kind_cli_end_to_end_online(block_workspace, tmp_path, capsys):
    """`train --kind dspark` online (the target in the loop, capturing the drafter's own layers), through the CLI:
    the run's config says the kind, best/ loads as a DSpark drafter, and --resume of a finished run is a no-op."""
    import json

    from draftsmith.cli import main
    from draftsmith.model.kinds import kind_of_dir

    root, model, convs, store = block_workspace
    out = tmp_path / "online"
    argv = ["train", "--kind", "dspark", "--target", str(model), "--conversations", str(convs), "--out", str(out),
            "--max-steps", "4", "--batch-tokens", "512", "--block-size", "3", "--draft-layers", "1",
            "--markov-rank", "8", "--num-anchors", "16", "--target-layer-ids", "1,3", "--eval-every", "4",
            "--draft-vocab-size", "300", "--autocast", "off", "--no-progress", "--no-plot", "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["steps"] == 4 and len(report["last_eval"]["acc"]) == 3
    saved = json.loads((out / "config.json").read_text())
    assert saved["kind"] == "dspark" and saved["block_size"] == 3
    assert kind_of_dir(out / "best") == "dspark"
    conf = json.loads((out / "best" / "config.json").read_text())
    assert conf["target_layer_ids"] == [1, 3] and conf["block_size"] == 3 and conf["markov_rank"] == 8


@pytest.mark.slow
def test_block_training_under_torchrun_two_processes_gloo(block_workspace, tmp_path):
    """The loop EAGLE-3 uses runs a dspark drafter on 2 CPU ranks: gradients averaged, rank 0 checkpoints."""
    import os
    import subprocess
    import sys

    root, model, convs, store = block_workspace
    cfg = tmp_path / "train.toml"
    cfg.write_text(f'target = "{model}"\nstore = "{store}"\nkind = "dspark"\nmax_steps = 2\nbatch_tokens = 256\n'
                   f'block_size = 3\nmarkov_rank = 8\nnum_anchors = 8\ndraft_layers = 1\nautocast = "off"\n'
                   f'progress = false\nplot = false\neval_every = 2\nsave_every = 2\nout = "{tmp_path / "ddp"}"\n')
    # --standalone: the rendezvous on a free port (a fixed one collides with a concurrent run of this test)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "draftsmith.cli", "train", "--config", str(cfg)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ddp" / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    assert (tmp_path / "ddp" / "final" / "model.safetensors").is_file()
