"""The training loop's thread count: chosen by timing real steps, kept only where nobody else fixed it."""

from __future__ import annotations

import torch
from test_train import _cfg, workspace  # noqa: F401  (the module's fixture, reused)

from draftsmith.stages.train import loop
from draftsmith.stages.train.logs import read_metrics
from draftsmith.stages.train.run import train
from draftsmith.stages.train.threads import ThreadTuner, thread_choices


def _drive(tuner: ThreadTuner, steps: int, cost) -> list[int]:
    """Run ``steps`` steps of 100 tokens whose seconds per token is ``cost(step, threads)``; the counts used."""
    used = []
    for s in range(steps):
        t = tuner.before_step()
        used.append(t)
        tuner.after_step(cost(s, t) * 100, 100)
    return used


def test_the_tuner_moves_to_the_faster_count_and_back_when_the_load_goes():
    seen: list[int] = []
    tuner = ThreadTuner([2, 1], set_threads=seen.append)
    busy = lambda s, t: {2: 5.0, 1: 1.0}[t] if s < 60 else {2: 0.6, 1: 1.0}[t]  # noqa: E731  other work until 60
    used = _drive(tuner, 200, busy)
    assert used[0] == 2  # torch's own count until something was measured
    assert used[10:60].count(1) >= 45  # one thread won the first comparison and kept the busy phase
    assert tuner.current == 2 and used[-40:].count(2) >= 36  # the load went: a later comparison went back to two
    assert [t for _, t in tuner.switches] == [1, 2]
    assert seen and seen[-1] == 2


def test_a_count_that_keeps_winning_is_asked_about_less_and_less():
    tuner = ThreadTuner([2, 1], set_threads=lambda n: None)
    used = _drive(tuner, 600, lambda s, t: {2: 1.0, 1: 1.8}[t])
    probes = [s for s in range(1, 600) if used[s] == 1 and used[s - 1] == 2 and (s < 2 or used[s - 2] == 2)]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert tuner.current == 2 and not tuner.switches
    assert gaps == sorted(gaps) and gaps[-1] > 4 * gaps[0]  # the period doubles while the answer holds
    assert used.count(1) <= 2 * (len(probes) + 1)  # the slower count only ran its probe steps


def test_only_a_cpu_run_in_one_process_with_no_thread_setting_chooses(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    cpu = torch.device("cpu")
    assert thread_choices(cpu, 1) == [4, 2, 1]
    assert thread_choices(torch.device("cuda"), 1) == [4]
    assert thread_choices(cpu, 2) == [4]  # torchrun ranks share the cores
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert thread_choices(cpu, 1) == [4]  # the user's count is kept
    assert not ThreadTuner([4]).active


def test_a_run_logs_its_thread_count_and_gives_the_process_its_count_back(workspace, tmp_path, monkeypatch):  # noqa: F811
    before = torch.get_num_threads()
    calls: list[int] = []

    class Recording(ThreadTuner):
        def __init__(self, choices, **kw):
            super().__init__([before + 1, 1], set_threads=lambda n: (calls.append(n), torch.set_num_threads(n)),
                             first_period=2)

    monkeypatch.setattr(loop, "ThreadTuner", Recording)
    train(_cfg(workspace, tmp_path / "t", log_every=1))
    rows = [r for r in read_metrics(tmp_path / "t") if "loss" in r and not r.get("eval")]
    assert {r["threads"] for r in rows} <= {before + 1, 1} and len(rows) == 12
    assert 1 in calls and before + 1 in calls  # both counts were tried on real steps
    assert torch.get_num_threads() == before


def test_a_count_that_loses_by_far_is_dropped_after_one_step():
    tuner = ThreadTuner([2, 1], set_threads=lambda n: None)
    used = _drive(tuner, 300, lambda s, t: {2: 6.0, 1: 1.0}[t])  # a busy machine: two threads lose 6x
    assert tuner.current == 1
    after = used[6:]  # the first comparison started on two threads (the current count then) and switched
    slow_runs = [i for i in range(len(after)) if after[i] == 2]
    assert slow_runs and all(b - a > 1 for a, b in zip(slow_runs, slow_runs[1:], strict=False))  # one step each


def test_a_count_that_wins_by_far_ends_the_first_comparison_at_once():
    tuner = ThreadTuner([2, 1], set_threads=lambda n: None)
    used = _drive(tuner, 40, lambda s, t: {2: 6.0, 1: 1.0}[t])
    assert used[:4] == [2, 2, 1, 1]  # the warm-up step, then A (two threads), B (one): answered, no second A
    assert tuner.switches[0] == (3, 1)
