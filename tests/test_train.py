"""Training-time test and the training loop: exactness of the unrolled attention, learning, resume, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_chat_model, self_generated_conversations, tiny_target
from safetensors.torch import load_file

from draftsmith.model import ttt
from draftsmith.model.drafter import KVCache, load_drafter, new_drafter
from draftsmith.model.target import load_target
from draftsmith.model.ttt import TTTBatch, simulated_acceptance_length, target_argmax, teacher_targets, ttt_forward
from draftsmith.stages.decode import ChainSpec, SpeculativeDecoder
from draftsmith.stages.train.config import TrainConfig, TrainError, load_config
from draftsmith.stages.train.run import train


def _answer_batch(target, ids: torch.Tensor, lengths: list[int]):
    """The target's outputs on ``ids`` and the TTT batch built from them, every token an answer token."""
    out = target(ids)
    return out, TTTBatch(ids, torch.ones_like(ids, dtype=torch.bool), torch.cat(out.aux_hidden_states, -1),
                         out.hidden_state, torch.tensor(lengths))


def assert_unroll_equals_inference(target, drafter, ids, out, batch) -> None:
    """TTT step i at column t equals drafting token i+1 after position t with a KV cache (float64, 1e-7)."""
    teacher = teacher_targets(batch, target.lm_head.weight, drafter.to_target_ids(torch.arange(200)), drafter.t2d)
    hidden: list[torch.Tensor] = []
    ttt_forward(drafter, batch, teacher, 4, unroll_hidden=hidden)
    for col in (0, 5, 7):
        cache = KVCache()
        g = drafter.fuse(out.aux_hidden_states)[:1, : col + 1]
        h = drafter(g, ids[:1, 1: col + 2], torch.arange(col + 1)[None], cache)[:, -1:]
        torch.testing.assert_close(h[0, 0], hidden[0][0, col], atol=1e-7, rtol=0)
        for i in range(1, 4):
            h = drafter(h, ids[:1, col + 1 + i: col + 2 + i], torch.tensor([[col + i]]), cache)
            torch.testing.assert_close(h[0, 0], hidden[i][0, col], atol=1e-7, rtol=0)


def test_ttt_unroll_equals_inference_drafting():
    """Step i at column t of TTT computes what drafting token i+1 after position t computes at inference."""
    target = tiny_target("llama")
    drafter = new_drafter(target, draft_vocab_size=200, seed=3)
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    out, batch = _answer_batch(target, ids, [12, 9])
    assert_unroll_equals_inference(target, drafter, ids, out, batch)


def _dense_ttt_loss(drafter, batch, teacher, ttt_steps, decay=0.8):
    """The TTT loss written plainly: the head over every column, masked afterwards (slow, obviously right)."""
    from draftsmith.model.ttt import _shift

    probs, argmax, in_draft = teacher
    hidden: list[torch.Tensor] = []
    ttt_forward(drafter, batch, teacher, ttt_steps, decay, unroll_hidden=hidden)
    valid = torch.arange(batch.input_ids.shape[1])[None] < batch.lengths[:, None]
    total, correct, counted = 0.0, [], []
    for i, h in enumerate(hidden):
        logits = drafter.logits(h).float()
        predicted = _shift(batch.loss_mask & valid, 2 + i)
        trained = predicted & _shift(in_draft, 1 + i)
        ce = -(_shift(probs, 1 + i) * logits.log_softmax(-1)).sum(-1)
        total = total + decay**i * (ce * trained).sum() / trained.sum().clamp_min(1)
        correct.append(float(((logits.argmax(-1) == _shift(argmax, 1 + i)) & trained).sum()))
        counted.append(float(predicted.sum()))
    return total, correct, counted


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_in_the_flash_kernel_equals_the_reference(steps):
    """The CPU path (flash kernel plus diagonal keys merged by log-sum-exp) gives the plain-ops attention and
    its gradients, grouped K/V heads and every TTT step's diagonal included."""
    assert ttt._CPU_FLASH is not None  # the pinned torch has the kernel: the fast path is what training runs
    g = torch.Generator().manual_seed(steps)
    q = torch.randn(2, 6, 23, 16, generator=g, requires_grad=True)
    keys = [torch.randn(2, 2, 23, 16, generator=g, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(2, 2, 23, 16, generator=g, requires_grad=True) for _ in range(steps)]
    upstream = torch.randn(2, 6, 23, 16, generator=g)
    inputs = [q, *keys, *values]
    fast = ttt.ttt_attention(q, keys, values)
    ref = ttt.ttt_attention_reference(q, keys, values)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(fast, inputs, upstream), torch.autograd.grad(ref, inputs, upstream),
                    strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as training runs it: bf16 in, bf16 out
        half = [x.detach().bfloat16() for x in inputs]
        fast = ttt.ttt_attention(half[0], half[1:1 + steps], half[1 + steps:])
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), ref.detach(), atol=0.05, rtol=0.05)


def test_ttt_loss_on_trained_columns_equals_the_dense_loss():
    """The head runs only where a column is trained; loss, gradients and accuracy counts are the dense ones."""
    target = tiny_target("llama")
    drafter = new_drafter(target, draft_vocab_size=120, seed=5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (3, 16), generator=g)
    out = target(ids)
    loss_mask = torch.rand(3, 16, generator=g) < 0.6  # prompt and answer columns interleaved
    batch = TTTBatch(ids, loss_mask, torch.cat(out.aux_hidden_states, -1), out.hidden_state,
                     torch.tensor([16, 11, 7]))
    teacher = teacher_targets(batch, target.lm_head.weight, drafter.to_target_ids(torch.arange(120)), drafter.t2d)
    assert not bool(teacher[2].all())  # some target choices fall outside the draft vocabulary
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss, stats = ttt_forward(drafter, batch, teacher, 3)
    grads = torch.autograd.grad(loss, params)
    ref, correct, counted = _dense_ttt_loss(drafter, batch, teacher, 3)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert stats.correct == correct and stats.total == counted and sum(counted) > 0


def test_a_run_meets_a_bounded_set_of_shapes():
    """Batch lengths and the head's trained rows are rounded up to ttt.SHAPE_BUCKET, so a long run stops meeting
    new matmul shapes (CPU kernels keep state per shape: its memory grew for as long as new ones came). The loss
    and gradients stay the unrounded ones (test_ttt_loss_on_trained_columns_equals_the_dense_loss)."""
    from draftsmith.stages.train.data import collate

    bucket = ttt.SHAPE_BUCKET
    sample = [(torch.arange(n), torch.ones(n, dtype=torch.bool), torch.zeros(n, 6), torch.zeros(n, 2))
              for n in (5, bucket + 6)]
    batch = collate(sample, 4 * bucket, torch.float32)
    assert batch.input_ids.shape == (2, 2 * bucket) and batch.lengths.tolist() == [5, bucket + 6]
    assert not batch.loss_mask[:, bucket + 6:].any() and not batch.loss_mask[0, 5:].any()
    assert collate(sample, bucket + 10, torch.float32).input_ids.shape[1] == bucket + 10  # at most max_length
    assert collate(sample[:1], 4 * bucket, torch.float32).input_ids.shape[1] == bucket

    target = tiny_target("llama")
    drafter = new_drafter(target, draft_vocab_size=120, seed=5)
    seen: list[int] = []
    drafter.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
    g = torch.Generator().manual_seed(2)
    for t in (9, 14, 23):
        ids = torch.randint(3, 250, (2, t), generator=g)
        out, batch = _answer_batch(target, ids, [t, t - 4])
        teacher = teacher_targets(batch, target.lm_head.weight, drafter.to_target_ids(torch.arange(120)),
                                  drafter.t2d)
        loss, _ = ttt_forward(drafter, batch, teacher, 3)
        loss.backward()
    assert len(seen) == 9 and all(n % bucket == 0 and n > 0 for n in seen), seen


def test_teacher_temperature_sharpens_to_one_hot_on_the_same_argmax():
    """Temperature < 1 sharpens the soft labels around the target's choice; 0 is its one-hot."""
    target = tiny_target("llama")
    drafter = new_drafter(target, draft_vocab_size=120, seed=5)
    _, batch = _answer_batch(target, torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(2)),
                             [10, 10])
    kept = drafter.to_target_ids(torch.arange(120))
    scores, argmax, in_draft = teacher_targets(batch, target.lm_head.weight, kept, drafter.t2d)
    soft = scores[...]  # indexing gives the probabilities
    sharp = teacher_targets(batch, target.lm_head.weight, kept, drafter.t2d, temperature=0.5)[0][...]
    hard = teacher_targets(batch, target.lm_head.weight, kept, drafter.t2d, temperature=0)[0][...]
    assert torch.equal(sharp.argmax(-1), soft.argmax(-1)) and torch.equal(hard.argmax(-1), soft.argmax(-1))
    assert bool((sharp.max(-1).values > soft.max(-1).values).all())
    assert torch.equal(hard.sum(-1), torch.ones(2, 10)) and int((hard > 0).sum()) == 20
    # Where the target's choice lies in the draft vocabulary (the columns trained), the label is that choice.
    assert bool(in_draft.any()) and torch.equal(hard.argmax(-1)[in_draft], argmax[in_draft])
    with pytest.raises(TrainError, match="teacher_temperature"):
        load_config(None, {"store": "s", "teacher_temperature": -1.0})


def test_a_run_from_before_a_new_config_field_still_resumes():
    """A field added later hashes only off its default: a checkpoint hashed before it existed still matches."""
    import dataclasses
    import hashlib

    from draftsmith.stages.train.config import _RESUMABLE, BLOCK_FIELDS, config_hash

    cfg = TrainConfig(store="s")
    before = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in _RESUMABLE and k not in ("teacher_temperature", "train_on", "norm_before_fc", "fc_norm",
                                                   "norm_output", "norm_before_residual", "kind", *BLOCK_FIELDS,
                                                   "optimizer", "muon_lr", "muon_weight_decay", "loss")}
    hashed_before = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert config_hash(cfg) == hashed_before
    assert config_hash(dataclasses.replace(cfg, teacher_temperature=0.5)) != hashed_before
    assert config_hash(dataclasses.replace(cfg, train_on="all")) != hashed_before
    assert config_hash(dataclasses.replace(cfg, kind="dspark")) != hashed_before
    assert config_hash(dataclasses.replace(cfg, optimizer="muon")) != hashed_before
    assert config_hash(dataclasses.replace(cfg, loss="lk")) != hashed_before


def test_train_on_all_trains_prompt_columns_too_and_never_padding():
    """train_on="all": every real token is a training column (the teacher is the target's distribution there
    too); padding stays out, and the columns an answers-only batch trains are among them."""
    from draftsmith.stages.train.data import every_position

    target = tiny_target("llama")
    drafter = new_drafter(target, draft_vocab_size=250, seed=5)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 250, (2, 12), generator=g)
    out = target(ids)
    answers = torch.zeros(2, 12, dtype=torch.bool)
    answers[:, 8:] = True  # a prompt of 8 tokens, then the answer
    lengths = torch.tensor([12, 9])
    batch = TTTBatch(ids, answers.clone(), torch.cat(out.aux_hidden_states, -1), out.hidden_state, lengths)
    kept = drafter.to_target_ids(torch.arange(250))
    _, only_answers = ttt_forward(drafter, batch, teacher_targets(batch, target.lm_head.weight, kept, drafter.t2d), 2)
    everything = every_position(batch)
    assert everything.loss_mask.tolist() == [[True] * 12, [True] * 9 + [False] * 3]
    _, all_stats = ttt_forward(drafter, everything, teacher_targets(everything, target.lm_head.weight, kept,
                                                                      drafter.t2d), 2)
    assert all_stats.total[0] > only_answers.total[0] > 0
    assert all_stats.total[0] == 12 - 2 + 9 - 2  # step 0 predicts token t+2: every real one from the third on
    with pytest.raises(TrainError, match="train_on"):
        load_config(None, {"store": "s", "train_on": "prompts"})


def test_target_argmax_is_the_first_maximum_in_any_head_dtype():
    """The teacher's choice equals argmax of the full logits, ties going to the lower id, chunked or not."""
    g = torch.Generator().manual_seed(0)
    head = torch.randn(300, 16, generator=g)
    head[7] = head[250]  # a tie: both ids always score the same
    hidden = torch.randn(2, 40, 16, generator=g)
    hidden[0, 3] = head[250] * 10  # a row whose maximum is the tied pair
    for w in (head, head.bfloat16()):
        full = (hidden.to(w.dtype) @ w.T).argmax(-1)
        assert torch.equal(target_argmax(hidden, w, chunk=7), full)
    assert int(target_argmax(hidden, head)[0, 3]) == 7


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    model = save_tiny_chat_model(root / "model")
    target = load_target(model, dtype=torch.float32)
    convs = self_generated_conversations(target, root / "conversations.jsonl", n=32)
    return root, model, convs


def _cfg(workspace, out, **kw) -> TrainConfig:
    root, model, convs = workspace
    base = dict(target=str(model), conversations=str(convs), out=str(out), max_steps=12, batch_tokens=512,
                ttt_steps=3, lr=3e-3, warmup_steps=2, eval_every=6, save_every=3, draft_vocab_size=300,
                eval_fraction=0.15, progress=False, plot=False, autocast="off")
    base.update(kw)
    return load_config(None, base)


def test_online_training_learns_and_decoder_agrees(workspace, tmp_path, compiled_loss):
    """The whole loop on the compiled loss (the one training test that compiles it: conftest.py)."""
    root, model, convs = workspace
    result = train(_cfg(workspace, tmp_path / "run", max_steps=60, eval_every=20, plot=True))
    assert result.steps == 60
    assert (tmp_path / "run" / "best" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "training.png").is_file() and (tmp_path / "run" / "metrics.csv").is_file()
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("eval")]
    assert evals[-1]["simulated_tau"] > evals[0]["simulated_tau"]
    assert result.best_simulated_acceptance_length > 1.3
    # The trained drafter accepts tokens in the real decoder, losslessly.
    target = load_target(model, dtype=torch.float32)
    drafter = load_drafter(tmp_path / "run" / "best", target)
    tok = target.tokenizer
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "the cat sat"}], add_generation_prompt=True,
                                         tokenize=False), add_special_tokens=False)["input_ids"]
    plain = SpeculativeDecoder(target).generate(prompt, 30)
    spec = SpeculativeDecoder(target, drafter, ChainSpec(3)).generate(prompt, 30)
    assert spec.token_ids == plain.token_ids
    assert spec.acceptance_length > 1.2


def test_resume_is_exact(workspace, tmp_path):
    straight = train(_cfg(workspace, tmp_path / "a"))
    train(_cfg(workspace, tmp_path / "b", stop_at_step=5))
    resumed = train(_cfg(workspace, tmp_path / "b", resume=True))
    assert straight.steps == resumed.steps == 12
    a = load_file(tmp_path / "a" / "final" / "model.safetensors")
    b = load_file(tmp_path / "b" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_from_another_config_refused(workspace, tmp_path):
    train(_cfg(workspace, tmp_path / "r", stop_at_step=3))
    with pytest.raises(TrainError, match="another config.*lr"):
        train(_cfg(workspace, tmp_path / "r", resume=True, lr=1e-2))
    with pytest.raises(TrainError, match="already holds a run"):
        train(_cfg(workspace, tmp_path / "r"))


def test_unknown_config_key_names_closest(tmp_path):
    cfg = tmp_path / "train.toml"
    cfg.write_text('store = "s"\nttt_step = 3\n')
    with pytest.raises(TrainError, match="unknown config key 'ttt_step'; did you mean 'ttt_steps'"):
        load_config(cfg)
    cfg.write_text('[train]\nstore = "s"\nttt_steps = 3\n')  # a [train] table is read as the config
    assert load_config(cfg).ttt_steps == 3
    (tmp_path / "t.yaml").write_text("store: s\nlr: 0.001\nttt_steps: 5\n")
    assert load_config(tmp_path / "t.yaml", {"lr": 0.01}).lr == 0.01
    with pytest.raises(TrainError, match="exactly one data source"):
        load_config(None, {"lr": 1.0})
    with pytest.raises(TrainError, match="autocast must be auto, bf16 or off, not 'fp16'"):
        load_config(None, {"store": "s", "autocast": "fp16"})


def test_autocast_setting(monkeypatch, tmp_path, quiet_machine):
    from draftsmith.model.target import bf16_native
    from draftsmith.stages.train import precision

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    cpu = torch.device("cpu")
    assert precision.fixed_autocast("bf16", cpu) and not precision.fixed_autocast("off", cpu)
    # auto: on where the CPU has AMX tiles; on other CPUs it is measured.
    assert precision.fixed_autocast("auto", cpu) == (True if bf16_native(cpu) else None)
    monkeypatch.setattr(precision, "bf16_native", lambda device: False)
    target = tiny_target("llama", dtype=torch.float32)
    drafter = new_drafter(target, draft_vocab_size=64)
    calls, lines = [], []

    def probe(seconds):
        return lambda: calls.append(seconds) or seconds

    faster_bf16 = {"float32": 2.0, "bf16": 1.0}
    assert precision.choose_autocast("auto", cpu, drafter, 512, 2, probe(faster_bf16), lines.append)
    assert lines[-1].startswith("autocast bf16: a training step took 2.00 s in float32, 1.00 s")
    # Cached per machine and drafter shape: the second run does not measure again.
    assert precision.choose_autocast("auto", cpu, drafter, 512, 2, probe({"float32": 1.0, "bf16": 2.0}),
                                     lines.append)
    assert calls == [faster_bf16]
    # Another batch size is another measurement, and here float32 wins.
    assert not precision.choose_autocast("auto", cpu, drafter, 1024, 2, probe({"float32": 1.0, "bf16": 2.0}),
                                         lines.append)


def test_measuring_autocast_leaves_the_run_as_it_was(workspace):
    from draftsmith.stages.train import precision
    from draftsmith.stages.train.data import OnlineSource

    root, model, convs = workspace
    target = load_target(model, dtype=torch.float32, pack=False)
    source = OnlineSource(target, str(convs), 256)
    drafter = new_drafter(target, draft_vocab_size=300).train()
    lm_head = target.lm_head.weight.detach()
    ids = drafter.to_target_ids(torch.arange(300))

    def make_teacher(bf16):
        head = lm_head.to(torch.bfloat16 if bf16 else torch.float32)
        return lambda b: teacher_targets(b, head, ids, drafter.t2d, None)

    rng = torch.get_rng_state()
    from draftsmith.stages.train.kinds import TTTObjective

    seconds = precision.measure_autocast(drafter, source.load([0, 1]), make_teacher, TTTObjective(2, 0.8), reps=1)
    assert set(seconds) == {"float32", "bf16"} and min(seconds.values()) > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in drafter.parameters())


def test_resume_keeps_the_checkpoints_autocast_choice(workspace, tmp_path, monkeypatch):
    from draftsmith.stages.train import precision
    from draftsmith.stages.train import run as run_mod

    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(precision, "bf16_native", lambda device: False)
    choices = iter([{"float32": 1.0, "bf16": 2.0}, {"float32": 2.0, "bf16": 1.0}])
    monkeypatch.setattr(precision, "cache_get", lambda kind, key: None)
    monkeypatch.setattr(run_mod, "measure_autocast", lambda *a, **k: next(choices))
    train(_cfg(workspace, tmp_path / "r", autocast="auto", stop_at_step=3))
    train(_cfg(workspace, tmp_path / "r", autocast="auto", resume=True))  # would measure bf16 faster now
    blob = torch.load(tmp_path / "r" / "checkpoints" / "step-0000012" / "trainer_state.pt", weights_only=True)
    assert blob["state"]["autocast"] is False
    assert next(choices) == {"float32": 2.0, "bf16": 1.0}  # the resumed run did not measure


def test_nan_loss_stops_and_keeps_last_good_checkpoint(workspace, tmp_path, monkeypatch):
    import draftsmith.stages.train.kinds as kinds_mod  # the module whose EAGLE-3 objective calls it

    real = kinds_mod.ttt_forward
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 4 else loss), stats

    monkeypatch.setattr(kinds_mod, "ttt_forward", poisoned)
    with pytest.raises(TrainError, match="loss is nan at step 5.*last good checkpoint"):
        train(_cfg(workspace, tmp_path / "n", eval_every=100))
    ckpts = sorted(p.name for p in (tmp_path / "n" / "checkpoints").glob("step-*"))
    assert ckpts[-1] == "step-0000003"
    weights = load_file(tmp_path / "n" / "checkpoints" / "step-0000003" / "drafter" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


def test_cli_train_overrides(workspace, tmp_path, capsys):
    from draftsmith.cli import main

    root, model, convs = workspace
    cfg = tmp_path / "train.toml"
    cfg.write_text(f'target = "{model}"\nconversations = "{convs}"\nmax_steps = 100\nttt_steps = 2\n'
                   f'batch_tokens = 512\nprogress = false\nplot = false\n')
    code = main(["train", "--config", str(cfg), "--max-steps", "2", "--out", str(tmp_path / "cli"), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    saved = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert saved["ttt_steps"] == 2 and saved["max_steps"] == 2
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(cfg), "--ttt-stepz", "2"])
    assert exit_.value.code == 2 and "--ttt-stepz" in capsys.readouterr().err


@pytest.mark.slow
def test_distributed_two_processes_gloo(workspace, tmp_path):
    """torchrun with 2 CPU processes: both ranks train, rank 0 checkpoints, the result loads. In the slow run: slow
    by nature (a launcher and two ranks, each importing torch and transformers, and a gloo rendezvous)."""
    root, model, convs = workspace
    cfg = tmp_path / "train.toml"
    cfg.write_text(f'target = "{model}"\nconversations = "{convs}"\nmax_steps = 4\nttt_steps = 2\n'
                   f'batch_tokens = 256\nprogress = false\nplot = false\nout = "{tmp_path / "ddp"}"\n'
                   f'eval_every = 4\nsave_every = 2\n')
    # No tokenizer thread pool either: the only threads a rank starts are then the process group's.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # The CLI's entry point, then each rank's thread count once the run has returned.
    entry = tmp_path / "entry.py"
    entry.write_text("import os, sys\nfrom draftsmith.cli import main\ncode = main(sys.argv[1:])\n"
                     f"open(r'{tmp_path}/threads.' + os.environ['RANK'], 'w')"
                     ".write(str(len(os.listdir('/proc/self/task'))))\nsys.exit(code)\n")
    # --standalone: the rendezvous on a free port. A fixed port is taken whenever another checkout's suite runs
    # this test at the same moment on the same machine, and the run then fails with no bug to find.
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(entry), "train", "--config", str(cfg)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ddp" / "final" / "model.safetensors").is_file()
    assert Path(tmp_path / "ddp" / "checkpoints" / "latest").read_text().strip() == "step-0000004"
    # The process group's gloo threads are joined before the interpreter shuts down: one left then can free the
    # last collectives' tensors during shutdown and abort the rank (once in a few runs on a loaded machine).
    assert [(tmp_path / f"threads.{r}").read_text() for r in (0, 1)] == ["1", "1"]


# --- hardening: untrusted run directories and stores, concurrent runs, resumed logs ------------------------
class _Evil:
    """A pickle that creates a marker file when unpickled with weights_only=False."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _stderr_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _cli_args(workspace, out, *extra: str) -> list[str]:
    root, model, convs = workspace
    return ["train", "--target", str(model), "--conversations", str(convs), "--out", str(out), "--max-steps", "4",
            "--batch-tokens", "512", "--ttt-steps", "2", "--save-every", "2", "--eval-every", "100",
            "--draft-vocab-size", "300", "--no-progress", "--no-plot", *extra]


def test_resume_refuses_a_malicious_trainer_state(workspace, tmp_path, capsys):
    from draftsmith.cli import main

    out = tmp_path / "evil"
    assert main(_cli_args(workspace, out, "--stop-at-step", "2")) == 0
    state = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "trainer_state.pt"
    # The checkpoint written by train itself loads without unpickling code.
    blob = torch.load(state, weights_only=True)
    assert blob["state"]["step"] == 2
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Evil(str(marker))}, state)
    capsys.readouterr()
    assert main(_cli_args(workspace, out, "--resume")) == 2
    assert not marker.exists()
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("draftsmith: error:") and "trainer_state.pt" in err[0], err


def test_resume_does_not_repeat_logged_steps(workspace, tmp_path):
    from draftsmith.stages.train.logs import read_metrics

    out = tmp_path / "m"
    train(_cfg(workspace, out, log_every=1, stop_at_step=5))  # checkpoints at steps 3 and 5
    (out / "checkpoints" / "latest").write_text("step-0000003")  # as if killed after logging steps 4 and 5
    state = torch.load(out / "checkpoints" / "step-0000003" / "trainer_state.pt", weights_only=True)
    spent = state["state"]["elapsed_s"]
    train(_cfg(workspace, out, log_every=1, resume=True))
    rows = read_metrics(out)
    keys = [(r["step"], bool(r.get("eval"))) for r in rows]
    assert len(keys) == len(set(keys)), keys
    assert sorted(k for k, e in keys if not e) == list(range(1, 13))
    # elapsed_s runs on one clock across the resume: the resumed rows go on from the checkpoint's time.
    steps = sorted((r["step"], r["elapsed_s"]) for r in rows if not r.get("eval"))
    assert all(t > spent for s, t in steps if s > 3)
    assert [t for _, t in steps] == sorted(t for _, t in steps)


def test_second_run_into_the_same_out_is_refused(workspace, tmp_path, capsys):
    from draftsmith.cli import main
    from draftsmith.core.io import ExclusiveLock

    out = tmp_path / "locked"
    out.mkdir()
    lock = ExclusiveLock(out / ".train.lock", "a train run")
    try:
        capsys.readouterr()
        assert main(_cli_args(workspace, out)) == 2
    finally:
        lock.release()
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("draftsmith: error:") and "resume" not in err[0], err
    assert not (out / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def small_store(workspace, tmp_path_factory):
    """A store captured from the workspace target, in several small shards."""
    from draftsmith.stages.capture import CaptureConfig, run_capture

    root, model, convs = workspace
    store = tmp_path_factory.mktemp("store") / "s"
    run_capture(CaptureConfig(conversations=Path(convs), out=store, target=str(model), max_length=256,
                              draft_vocab_size=300, shard_max_bytes=64 * 1024, progress=False))
    return store


def test_corrupt_late_shard_is_refused_before_the_first_step(workspace, small_store, tmp_path):
    import shutil

    from draftsmith.data.store import FeatureStore

    root, model, convs = workspace
    store = tmp_path / "s"
    shutil.copytree(small_store, store)
    shards = FeatureStore(store).shards
    assert len(shards) >= 3
    last = store / shards[-1]["file"]
    data = bytearray(last.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the payload: same size, different sha256
    last.write_bytes(bytes(data))
    cfg = load_config(None, dict(target=str(model), store=str(store), out=str(tmp_path / "run"), max_steps=6,
                                 batch_tokens=512, ttt_steps=2, log_every=1, save_every=100, eval_every=100,
                                 eval_fraction=0.0, progress=False, plot=False))
    with pytest.raises(TrainError, match=rf"{shards[-1]['file']}.*capture") as info:
        train(cfg)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

    # What the error advises works: drop the shard and its manifest entry, rerun capture, which resumes.
    from draftsmith.stages.capture import CaptureConfig, run_capture

    manifest = json.loads((store / "manifest.json").read_text())
    bad = manifest["shards"].pop()
    manifest["num_samples"] -= bad["num_samples"]
    manifest["total_tokens"] -= bad["num_tokens"]
    manifest["total_loss_tokens"] -= sum(s["loss_tokens"] for s in bad["samples"])
    (store / "manifest.json").write_text(json.dumps(manifest))
    last.unlink()
    report = run_capture(CaptureConfig(conversations=Path(convs), out=store, target=str(model), max_length=256,
                                       draft_vocab_size=300, shard_max_bytes=64 * 1024, progress=False))
    assert report.counts.captured == bad["num_samples"]
    fixed, original = FeatureStore(store), FeatureStore(small_store)
    fixed.verify_all()
    assert sorted(fixed.sample_ids) == sorted(original.sample_ids)
    assert (fixed.total_tokens, fixed.total_loss_tokens) == (original.total_tokens, original.total_loss_tokens)


def test_train_samples_is_a_nested_random_subset_with_the_same_held_out_split():
    from draftsmith.stages.train.data import first_samples, split_eval

    ids = [f"conv-{i}" for i in range(400)]
    train_idx, eval_idx = split_eval(ids, 0.1)
    small, large = first_samples(ids, train_idx, 50), first_samples(ids, train_idx, 150)
    assert len(small) == 50 and len(large) == 150 and set(small) < set(large) < set(train_idx)
    assert not set(large) & set(eval_idx)
    assert first_samples(ids, train_idx, 0) == train_idx == first_samples(ids, train_idx, 10_000)
    # Not the first ids in store order (a store sorts samples by length): spread over the whole range.
    assert max(small) > 300 and min(small) < 100
    with pytest.raises(TrainError, match=r"train_samples\) must be >= 0"):
        load_config(None, {"store": "s", "train_samples": -1})


def test_the_time_budget_plans_the_most_steps_whose_estimate_fits():
    """plan_steps on made-up timings: steady steps, the first epoch's one-time argmax, and evaluations."""
    from draftsmith.stages.train.budget import END_S, MARGIN, Timing, plan_steps

    left = 100 * (1 - MARGIN) - 10 - END_S  # 82 s for steps after a 10 s start
    plain = Timing(elapsed_s=10, step=5, step_s=1.0, argmax_s_per_token=0.0, uncached_tokens=0,
                   steps_per_epoch=1000, eval_s=0.0, eval_every=50)
    assert plan_steps(100, 1000, plain) == 5 + int(left)
    assert plan_steps(100, 40, plain) == 40  # the budget never adds steps
    assert plan_steps(1, 1000, plain) == 6  # a spent budget still ends with one step (and its saves)
    # 41 s of argmax still to do, spread over the first epoch's remaining 100 steps: 1.41 s a step there.
    first = Timing(10, 5, 1.0, 1e-3, 41_000, 105, 0.0, 50)
    assert plan_steps(100, 1000, first) == 5 + int(left / 1.41)
    # an evaluation of 4 s every 10 steps, and one at the end
    evals = Timing(10, 5, 1.0, 0.0, 0, 1000, 4.0, 10)
    n = plan_steps(100, 1000, evals)
    assert (n - 5) + 4 * (n // 10 - 0 + (n % 10 != 0)) <= left < (n + 1 - 5) + 4 * ((n + 1) // 10 + ((n + 1) % 10 != 0))


def test_the_time_budget_plans_again_at_each_evaluation_from_the_steps_timed_since(workspace, small_store, tmp_path,
                                                                                     monkeypatch):
    """An early plan that missed the steady step cost is corrected at the next evaluations: the run ends at the
    last plan, its cosine at the floor there, and a resumed run's budget counts the time its checkpoint spent."""
    from draftsmith.stages.train import loop

    seen: list = []

    def plan(budget_s, max_steps, timing):
        seen.append((max_steps, timing))
        return 30 if timing.step < 10 else 20

    monkeypatch.setattr(loop, "plan_steps", plan)

    def cfg(out, **kw):
        return _cfg(workspace, out, conversations=None, store=str(small_store), max_steps=40, warmup_steps=5,
                    eval_every=5, max_minutes=2.0, **kw)

    assert train(cfg(tmp_path / "a")).steps == 20
    assert [(m, t.step) for m, t in seen] == [(40, 5), (40, 10), (40, 15)]  # after the warm-up, then each eval
    assert all(t.step_s > 0 for _, t in seen) and seen[1][1].eval_s > 0  # an evaluation was timed by then
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["planned_steps"] for r in rows if "planned_steps" in r] == [30, 20, 20]
    lrs = [r["lr"] for r in rows if "lr" in r and r["step"] == 20]
    assert lrs and lrs[-1] == pytest.approx(3e-3 * 0.1)

    seen.clear()
    train(cfg(tmp_path / "b", stop_at_step=9))
    spent = torch.load(tmp_path / "b" / "checkpoints" / "step-0000009" / "trainer_state.pt",
                       weights_only=True)["state"]["elapsed_s"]
    resumed = train(cfg(tmp_path / "b", resume=True))
    assert resumed.steps == 20 and [t.step for _, t in seen] == [5, 15]  # resumed at 9: its first window ends at 15
    assert spent > 0 and seen[-1][1].elapsed_s > spent


def test_a_time_budget_fixes_the_step_count_once_and_resume_keeps_it(workspace, small_store, tmp_path, monkeypatch):
    """The plan is made after the warm-up from what was timed, the cosine ends at the planned step, and a run
    killed after the plan resumes to the same weights as one that was not, whatever budget the resume gives."""
    from draftsmith.stages.train import loop

    seen: list = []

    def plan(budget_s, max_steps, timing):
        seen.append((budget_s, max_steps, timing))
        return 9

    monkeypatch.setattr(loop, "plan_steps", plan)

    def cfg(out, **kw):
        return _cfg(workspace, out, conversations=None, store=str(small_store), max_steps=30, warmup_steps=5,
                    **{"max_minutes": 2.0, **kw})

    straight = train(cfg(tmp_path / "a"))
    assert straight.steps == 9 and len(seen) == 1
    budget_s, max_steps, timing = seen[0]
    assert (budget_s, max_steps, timing.step) == (120.0, 30, 5)
    assert timing.step_s > 0 and timing.elapsed_s > 0 and timing.uncached_tokens > 0  # first epoch not done
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["planned_steps"] for r in rows if "planned_steps" in r] == [9]
    lrs = [r["lr"] for r in rows if "lr" in r and r["step"] == 9]
    assert lrs and lrs[-1] == pytest.approx(3e-3 * 0.1)  # decayed to the floor at the planned end

    train(cfg(tmp_path / "b", stop_at_step=7))
    resumed = train(cfg(tmp_path / "b", resume=True, max_minutes=0.5))
    assert resumed.steps == 9 and len(seen) == 2  # the resume kept its checkpoint's plan
    a = load_file(tmp_path / "a" / "final" / "model.safetensors")
    b = load_file(tmp_path / "b" / "final" / "model.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_trainer_takes_the_fused_adamw_where_torch_has_it():
    """Fused AdamW is the plain AdamW's update in one pass: the same parameters after a few steps."""
    from draftsmith.stages.train.run import _fused_adamw_ok

    g = torch.Generator().manual_seed(0)
    start = [torch.randn(7, 5, generator=g), torch.randn(5, generator=g)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(4)]
    result = []
    for fused in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        assert _fused_adamw_ok(params)
        opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, fused=fused)
        for gs in grads:
            for p, gr in zip(params, gs, strict=True):
                p.grad = gr.clone()
            opt.step()
        result.append(params)
    for a, b in zip(*result, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not _fused_adamw_ok([torch.nn.Parameter(torch.zeros(2, device="meta"))])
