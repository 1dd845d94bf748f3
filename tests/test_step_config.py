"""The target's step configuration: dtype and prepacked linears, each kept only where it steps faster here."""

from __future__ import annotations

import itertools

import pytest
import torch

from draftsmith.model import packing
from draftsmith.model.packing import packing_available
from draftsmith.model.target import Target, load_target
from draftsmith.stages import step_config
from draftsmith.testing.models import build_tiny_model, save_tiny_target

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN packing")

COMBOS = list(itertools.product((torch.float32, torch.bfloat16), (True, False)))
needs_bf16_packing = pytest.mark.skipif(not packing.dtype_packable(torch.bfloat16),
                                        reason="this CPU cannot pack bf16 weights (AVX2 only)")


def load(dtype: torch.dtype) -> Target:
    """What load_target does by default: the model in ``dtype``, its linears prepacked."""
    target = Target(build_tiny_model("llama", seed=0, dtype=dtype))
    target.pack()
    return target


@pytest.fixture
def timed(monkeypatch, tmp_path, quiet_machine):
    """A step costs what ``costs[(dtype, packed)]`` says; returns the costs and the list of measured configs."""
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path))
    monkeypatch.delenv("DRAFTSMITH_PACK", raising=False)
    costs: dict = {}
    measured: list = []

    def fake_step_time(target: Target) -> float:
        measured.append((target.dtype, target.packed))
        return costs[(target.dtype, target.packed)]

    monkeypatch.setattr(step_config, "step_time", fake_step_time)
    return costs, measured


@needs_bf16_packing
@pytest.mark.parametrize("fastest", COMBOS)
def test_choose_dtype_keeps_the_fastest_of_dtype_and_packing(timed, fastest):
    costs, measured = timed
    costs.update({c: 0.05 for c in COMBOS})
    costs[fastest] = 0.03
    target, note = step_config.choose_dtype(load, log=lambda line: None)
    assert (target.dtype, target.packed) == fastest
    assert sorted(measured, key=str) == sorted(COMBOS, key=str)  # each of the four timed once
    assert note.startswith(f"dtype {str(fastest[0]).removeprefix('torch.')}")
    # A float32 pick is a fresh load (casting bf16 weights back would keep their rounding).
    if fastest[0] == torch.float32:
        ref = load(torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(target.model.state_dict().values(),
                                                        ref.model.state_dict().values(), strict=True))
    measured.clear()
    again, _ = step_config.choose_dtype(load, log=lambda line: None)
    assert measured == [] and (again.dtype, again.packed) == fastest  # read from the cache


@needs_bf16_packing
def test_packing_is_dropped_where_it_steps_slower_and_kept_on_a_tie(timed):
    costs, measured = timed
    target = load(torch.float32)
    costs.update({(torch.float32, True): 0.041, (torch.float32, False): 0.031})
    note = step_config.choose_packing(target)
    assert not target.packed and "plain" in note and "41.0 ms packed" in note
    tie = load(torch.bfloat16)
    costs.update({(torch.bfloat16, True): 0.03, (torch.bfloat16, False): 0.03})
    step_config.choose_packing(tie)
    assert tie.packed  # a tie goes to packing: it also cheapens the multi-token verify pass


def test_the_users_switch_turns_packing_off_and_it_is_never_timed(timed, monkeypatch):
    costs, measured = timed
    monkeypatch.setenv("DRAFTSMITH_PACK", "0")
    costs.update({c: 0.05 for c in COMBOS})
    costs[(torch.bfloat16, True)] = 0.01

    def plain_load(dtype):
        return Target(build_tiny_model("llama", seed=0, dtype=dtype))

    target, note = step_config.choose_dtype(plain_load, log=lambda line: None)
    assert not target.packed and all(not packed for _, packed in measured)
    assert "packed" not in note


def test_where_bf16_cannot_be_packed_the_chooser_times_it_plain_only(timed, monkeypatch):
    """An AVX2-only CPU: oneDNN cannot pack bf16, so bf16 is timed unpacked and never reported packed."""
    costs, measured = timed
    monkeypatch.setattr(packing, "_packs", lambda dtype: dtype == torch.float32)
    costs.update({(torch.float32, True): 0.05, (torch.float32, False): 0.06, (torch.bfloat16, False): 0.04})
    target, note = step_config.choose_dtype(load, log=lambda line: None)
    assert (target.dtype, target.packed) == (torch.bfloat16, False)
    assert sorted(measured, key=str) == sorted(costs, key=str) and "prepacked" not in note


def test_capture_takes_a_float32_copy_only_where_its_long_pass_is_faster(tmp_path):
    """bfloat16 can win the 1-token step where the CPU emulates bf16 dot products and lose a long pass there."""
    from draftsmith.stages.step_config import bulk_pass_time, choose_bulk_dtype

    path = save_tiny_target(tmp_path / "t")
    bf16 = load_target(str(path), dtype=torch.bfloat16)
    loads = []

    def load(dt):
        loads.append(dt)
        return load_target(str(path), dtype=dt)

    slow_bf16 = choose_bulk_dtype(bf16, load, lambda t: 1.0 if t.dtype == torch.bfloat16 else 0.5, log=print)
    assert slow_bf16.dtype == torch.float32 and slow_bf16 is not bf16 and loads == [torch.float32]
    fast_bf16 = choose_bulk_dtype(bf16, load, lambda t: 0.5 if t.dtype == torch.bfloat16 else 1.0, log=print)
    assert fast_bf16 is bf16
    fp32 = load_target(str(path), dtype=torch.float32)
    assert choose_bulk_dtype(fp32, load, lambda t: 1 / 0) is fp32  # nothing to choose: no probe, no copy
    assert bulk_pass_time(fp32, tokens=8) > 0
