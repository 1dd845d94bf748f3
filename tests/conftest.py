"""Shared fixtures: tiny random targets built in-process, and drafters fitted to them."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

# Tiny models: one thread is ~10x faster than two fighting over a busy 2-core machine (and steadier).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The training loss runs eagerly (the same math in row chunks) unless a test asks for the compiled kernels with the
# ``compiled_loss`` fixture: compiling costs seconds of every process that trains (each `draftsmith train` or
# torchrun rank a test starts inherits this), and most tests that train are about something else. The tests that
# take the fixture keep the compiled path checked, alone and in the whole loop.
os.environ.setdefault("DRAFTSMITH_COMPILE", "0")

import pytest

if TYPE_CHECKING:
    import torch

    from draftsmith.model.drafter import Eagle3Drafter
    from draftsmith.model.target import Target

# torch is imported by the helpers below, not here: xdist's controller loads this file before it starts the workers,
# and runs no test.


def pytest_collection_finish(session):
    """One torch thread in each process that runs tests, whatever OMP_NUM_THREADS says (the controller collects
    nothing, so it never gets here)."""
    import torch

    torch.set_num_threads(1)


# --- results shared by the run's worker processes ----------------------------------------------------------
# pytest-xdist hands each worker whole files, so a set-up several files import (a fitted drafter, a target's
# reference continuations) would be built once per worker. The first worker to need one builds it under a lock and
# saves it here; the others load it, bitwise the same. The controller makes the folder before the workers start
# (they inherit the variable) and removes it at the end.
_SHARED_ENV = "DRAFTSMITH_TEST_SHARED"
_made_shared: list[str] = []
T = TypeVar("T")


def pytest_configure(config):
    if not os.environ.get(_SHARED_ENV):
        os.environ[_SHARED_ENV] = tempfile.mkdtemp(prefix="draftsmith-tests-")
        _made_shared.append(os.environ[_SHARED_ENV])


def pytest_unconfigure(config):
    import shutil

    for path in _made_shared:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(_SHARED_ENV, None)


def shared_result(key: str, build: Callable[[], T], save: Callable[[T, Path], None],
                  load: Callable[[Path], T]) -> T:
    """``build()``, once for the whole run: saved under ``key`` by the first worker that asks, loaded by the rest."""
    from filelock import FileLock

    root = os.environ.get(_SHARED_ENV)
    if not root:
        return build()
    path = Path(root) / key
    with FileLock(f"{path}.lock"):
        if path.exists():
            return load(path)
        value = build()
        tmp = path.with_name(path.name + ".tmp")
        save(value, tmp)
        tmp.rename(path)
        return value


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """The CLI's ``main`` in the test's process: (exit code, stdout, stderr). A subprocess is for what only a
    process shows (a kill, a signal, the allocator set at start)."""
    from draftsmith.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def save_json(value, path: Path) -> None:
    path.write_text(json.dumps(value))


def load_json(path: Path):
    return json.loads(path.read_text())


def shared_drafter(key: str, target: Target, build: Callable[[], Eagle3Drafter], **new_drafter_kw) -> Eagle3Drafter:
    """``shared_result`` for a drafter of ``target``: its weights go through a safetensors file."""
    from safetensors.torch import load_file, save_file

    from draftsmith.model.drafter import new_drafter

    def save(drafter: Eagle3Drafter, path: Path) -> None:
        save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(path))

    def load(path: Path) -> Eagle3Drafter:
        drafter = new_drafter(target, **new_drafter_kw)
        drafter.load_state_dict(load_file(str(path)))
        return drafter.eval()

    return shared_result(key, build, save, load)


# --- the slow suite on every core: `make test-slow` runs it with --dist loadgroup --------------------------------
# vLLM's CPU engine pins its threads to cores: two vLLM tests at once would pin theirs to the same cores, so the
# tests that start vLLM form one group, run one after another on one worker; the tests that start OpenVINO (which
# takes every core) form a second. Every other slow test is grouped by its file, so a module's set-up (a converted
# target, a fitted pair) is built once.
#
# The groups are given to xdist as a scheduler (below), not as xdist_group marks: with pytest 9.2, xdist 3.8 no
# longer reads those marks (it appends the group to a node id pytest now derives elsewhere, pytest-xdist#1386), and
# every slow test was then sent to any worker, each module's set-up built on both.
VLLM_MODULES = {"test_vllm_block", "test_vllm_capture", "test_vllm_engine", "test_vllm_plugin", "test_vllm_serve",
                "test_vllm_hybrid", "test_deepseek_e2e", "test_eagle31", "test_export"}


def slow_group(nodeid: str) -> str:
    """The group of a test id: "openvino" or "vllm" for a test that starts that engine (its module is one of its
    modules, or its name says which engine it drives), else its file."""
    path, _, name = nodeid.partition("::")
    module = path.rpartition("/")[2].removesuffix(".py")
    if "openvino" in name or module == "test_openvino_engine":
        return "openvino"
    return "vllm" if module in VLLM_MODULES or "vllm" in name else path


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlowGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return slow_group(nodeid)

    return SlowGroups(config, log)


@pytest.fixture
def quiet_machine(monkeypatch):
    """Timings cache as on a quiet machine, whatever runs beside the test: on a busy one a timing is not reused
    (core/machine.py), and these tests check the cache's reuse."""
    from draftsmith.core import machine

    monkeypatch.setattr(machine, "load_per_core", lambda: 0.5)


@pytest.fixture
def compiled_loss(monkeypatch):
    """The training loss's compiled kernels for this test (``model/ttt._compiled_ce``), built afresh (a None cached
    while compiling was off would otherwise stick); the returned pair is None only where no compiler is found."""
    import shutil

    from draftsmith.model.ttt import _compiled_ce

    monkeypatch.setenv("DRAFTSMITH_COMPILE", "1")
    _compiled_ce.cache_clear()
    kernels = _compiled_ce("cpu")
    if shutil.which("c++") or shutil.which("g++"):
        assert kernels is not None, "a C++ compiler is here, yet the fused loss did not compile"
    yield kernels
    _compiled_ce.cache_clear()  # the tests after this one run eagerly again


def _new_tiny_target(arch: str, dtype: torch.dtype | None, num_hidden_layers: int, seed: int) -> Target:
    """A tiny random ``arch`` model in a Target, float64 unless ``dtype`` says otherwise."""
    import torch

    from draftsmith.model.target import Target
    from draftsmith.testing.models import build_tiny_model

    return Target(build_tiny_model(arch, seed=seed, dtype=dtype or torch.float64, num_hidden_layers=num_hidden_layers))


@functools.cache
def tiny_target(arch: str, dtype: torch.dtype | None = None, num_hidden_layers: int = 8, seed: int = 0) -> Target:
    """Cached per (arch, dtype): building one takes a fraction of a second, tests use many."""
    return _new_tiny_target(arch, dtype, num_hidden_layers, seed)


@functools.cache
def block_target(arch: str, dtype: torch.dtype | None = None, seed: int = 0) -> Target:
    """``tiny_target``'s model in a Target of its own: block drafters point a target's aux layers at theirs, which
    must not leak into the EAGLE-3 tests that share ``tiny_target`` in the same worker."""
    return _new_tiny_target(arch, dtype, 6, seed)


def random_prompts(n: int, seed: int, vocab: int = 256, max_len: int = 24) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g)
    return [torch.randint(3, vocab, (int(n_),), generator=g).tolist() for n_ in lengths]


def fit_drafter(target: Target, sequences: list[list[int]], steps: int = 200, seed: int = 0,
                ttt_steps: int = 3) -> Eagle3Drafter:
    """Fit a drafter to the target's own greedy continuations so that it accepts often.

    A deliberately small stand-in for the trainer, used to exercise the accept paths of the decoder:
    step 0 on target features, then ``ttt_steps - 1`` steps fed with the drafter's own outputs.
    Sequences are right-padded into one batch (causal attention keeps padding out of real positions).
    Fitted in float32 and cast to the target's dtype at the end: float64 steps cost twice as much and a drafter
    fitted to accept often does so in either precision.
    """
    import torch

    from draftsmith.model.drafter import new_drafter

    torch.manual_seed(seed)
    t = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), t, dtype=torch.long)
    valid = torch.zeros(len(sequences), t, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        valid[i, : len(s)] = True
    with torch.no_grad():
        out = target(ids)
    labels = out.logits.argmax(-1)  # labels[:, t] = the target's choice after token t
    aux = tuple(a[:, :-1].float() for a in out.aux_hidden_states)
    drafter = new_drafter(target, seed=seed).float()
    drafter.train()
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    for _ in range(steps):
        g, inp, loss = drafter.fuse(aux), ids[:, 1:], 0.0
        for step in range(ttt_steps):
            n = inp.shape[1]
            pos = torch.arange(step, step + n)[None]
            h = drafter(g, inp, pos)
            # column c predicts what the target chooses after token c+1+step
            want = labels[:, 1 + step: 1 + step + n]
            ok = valid[:, 2 + step: 2 + step + n]
            want, ok, h = want[:, : ok.shape[1]], ok, h[:, : ok.shape[1]]
            ce = torch.nn.functional.cross_entropy(drafter.logits(h).transpose(1, 2), want, reduction="none")
            loss = loss + 0.8**step * (ce * ok).sum() / ok.sum().clamp_min(1)
            g, inp = h[:, :-1], want[:, :-1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.to(target.dtype).eval()




def fit_block_drafter(target: Target, sequences: list[list[int]], kind: str, steps: int = 80, seed: int = 0,
                      anchors: int = 8, draft_vocab=None, **overrides):
    """Fit a DFlash/DSpark drafter to the target's own choices so that it accepts often: a small stand-in for the
    trainer (cross-entropy on the target's argmax at every drafted position of ``anchors`` random blocks per
    sequence), fitted in float32 and cast to the target's dtype. Sequences are right-padded; a block whose
    position passes a sequence's end is not scored there. With a reduced ``draft_vocab`` (a ``DraftVocab``) a
    position whose choice lies outside it is not scored either, as in the trainer; the head then costs a fraction
    of a full-vocabulary one."""
    import torch

    from draftsmith.model.block_drafter import new_block_drafter

    torch.manual_seed(seed)
    t = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), t, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in sequences])
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
    drafter = new_block_drafter(target, kind, draft_vocab=draft_vocab, seed=seed, **overrides).float().train()
    target.set_aux_hidden_state_layers(drafter.config.aux_layer_ids)
    with torch.no_grad():
        out = target(ids)
    labels = out.logits.argmax(-1)  # labels[:, p - 1] = the target's choice for position p
    in_vocab = torch.ones_like(labels, dtype=torch.bool)
    if draft_vocab is not None:  # target ids -> draft ids; a choice outside the draft vocabulary is not scored
        labels = draft_vocab.draft_ids(labels)
        in_vocab, labels = labels >= 0, labels.clamp(min=0)
    aux = tuple(a.float() for a in out.aux_hidden_states)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        anchor = (torch.rand(len(sequences), anchors, generator=g) * (lengths[:, None] - 1)).long()
        res = drafter.forward_train(aux, ids, anchor)
        pos = res.positions
        prev = (pos - 1).clamp(min=0).flatten(1)
        want = labels.gather(1, prev).view_as(pos)
        ok = (pos >= 0) & (pos < lengths[:, None, None]) & in_vocab.gather(1, prev).view_as(pos)
        ce = torch.nn.functional.cross_entropy(res.logits.flatten(0, 2), want.flatten(), reduction="none")
        loss = (ce * ok.flatten()).sum() / ok.sum().clamp_min(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.to(target.dtype).eval()


_TEXT = ("the cat sat on a mat and then it ran over to see the dog who was very happy about "
         "rain sun tree water light house green blue small fast slow")
WORDS = _TEXT.split()


def save_tiny_chat_model(path, arch: str = "llama", style: str = "chatml", seed: int = 0, **overrides):
    from draftsmith.testing.models import save_tiny_target

    return save_tiny_target(path, arch, style, seed=seed, **overrides)


def self_generated_conversations(target: Target, path, n: int = 24, seed: int = 0, new_tokens: int = 40):
    """Conversations whose assistant turns are the target's own greedy continuations (what EAGLE trains on)."""
    import json
    import random

    from draftsmith.stages.generate.backends import LocalBackend, _Sampling

    rng = random.Random(seed)
    tok = target.tokenizer
    questions = [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(n)]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"] for q in questions]
    # One batched greedy pass (the local backend's loop; rows equal their unbatched generations).
    answers = LocalBackend(target, batch_size=n).generate_ids(prompts, _Sampling(new_tokens, 0.0, 1.0), [0] * n)
    with open(path, "w") as f:
        for i, (question, (ids, _)) in enumerate(zip(questions, answers, strict=True)):
            answer = tok.decode([t for t in ids if t != tok.eos_token_id], skip_special_tokens=True)
            f.write(json.dumps({"id": f"conv-{i}", "messages": [{"role": "user", "content": question},
                                                                 {"role": "assistant", "content": answer}]}) + "\n")
    return path
