"""How many CPU threads the training step runs on: measured while the run goes, since the load can change.

Every parallel op of a step (a matmul, a norm, a cast; several hundred a step) ends when its slowest thread ends.
On a machine that other work shares, the scheduler parks one of the step's threads behind another process and the
op waits for it: on the 2-core Xeon at load 12, the default preset's step ran 5x faster on one thread than on two.
On the same machine quiet, two threads are the faster. Neither choice is right for both, and the load of a shared
machine changes during a run, so ``ThreadTuner`` times the candidates against each other on real steps,
alternated (A, B, B, A: a load that drifts meanwhile falls on both alike), keeps the faster, and asks again after
a period that doubles while the answer holds. A candidate that loses by far on its first step is dropped from that
comparison there, and one that wins by far ends it, so asking costs one slow step where the answer is plain.

What it changes is where the work runs, not what is computed: the loss and updates are the same functions; only
the order of some float sums inside parallel kernels follows the thread count (differences in the last bits).
``OMP_NUM_THREADS`` set by the user fixes the count, which also keeps a rerun bitwise the same.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

#: Steps each candidate is timed for in one comparison (alternated A, B, B, A, ...).
PROBE_STEPS = 2
#: Steps between the first comparisons; doubled while the answer holds, up to ``MAX_PERIOD``.
FIRST_PERIOD = 16
MAX_PERIOD = 256
#: A candidate whose step took this many times the current count's (per token) is out of that comparison at once:
#: on a busy machine the losing count costs several steps' worth per step, and one step already says so.
CLEAR_LOSS = 2.0


def thread_choices(device: torch.device, world: int) -> list[int]:
    """The thread counts to choose between, most first; one entry when there is nothing to choose.

    Only a CPU run in one process chooses: under torchrun the ranks share the cores (torchrun sets
    ``OMP_NUM_THREADS``), on CUDA the step does not run on CPU threads, and a user's ``OMP_NUM_THREADS`` is kept.
    """
    n = torch.get_num_threads()
    if device.type != "cpu" or world > 1 or os.environ.get("OMP_NUM_THREADS") or n <= 1:
        return [n]
    return sorted({n, max(1, n // 2), 1}, reverse=True)


class ThreadTuner:
    """Sets the thread count before each step (``before_step``) and learns from its time (``after_step``)."""

    def __init__(self, choices: list[int], set_threads: Callable[[int], None] = torch.set_num_threads,
                 probe_steps: int = PROBE_STEPS, first_period: int = FIRST_PERIOD, max_period: int = MAX_PERIOD):
        self.choices, self.set_threads = list(choices), set_threads
        self.probe_steps, self.first_period, self.max_period = probe_steps, first_period, max_period
        self.current = self.choices[0]
        self.period = first_period
        self.until_probe = 1  # the first step warms caches and allocator up: compare from the second on
        self.plan: list[int] = []  # the probe's remaining steps, one thread count each
        self.timed: dict[int, list[float]] = {}  # per candidate: [seconds, tokens] of its probe steps
        self.switches: list[tuple[int, int]] = []  # (step, threads) of each change, for the run's log
        self._step_threads = self.current
        self._steps = 0

    @property
    def active(self) -> bool:
        return len(self.choices) > 1

    def before_step(self) -> int:
        """The thread count for the coming step, set in torch."""
        if self.active and not self.plan and self.until_probe <= 0:
            others = [c for c in self.choices if c != self.current]
            order: list[int] = []
            for r in range(self.probe_steps):  # A B B A ... per pair of candidates
                for other in others:
                    order += [self.current, other] if r % 2 == 0 else [other, self.current]
            self.plan, self.timed = order, {c: [0.0, 0.0] for c in self.choices}
        threads = self.plan[0] if self.plan else self.current
        if threads != torch.get_num_threads():
            self.set_threads(threads)
        self._step_threads = threads
        return threads

    def after_step(self, seconds: float, tokens: int) -> None:
        """Record the step just run (its seconds less any one-time work, its tokens)."""
        self._steps += 1
        if not self.active:
            return
        if not self.plan:
            self.until_probe -= 1
            return
        self.plan.pop(0)
        t = self._step_threads
        self.timed[t][0] += seconds
        self.timed[t][1] += tokens
        if t != self.current and self.timed[self.current][1]:
            if self._per_token(t) > CLEAR_LOSS * self._per_token(self.current):  # t lost by far: drop it
                self.plan = [c for c in self.plan if c != t]
                if all(c == self.current for c in self.plan):
                    self.plan = []
            elif self._per_token(self.current) > CLEAR_LOSS * self._per_token(t):  # t won by far: answered
                self.plan = []
        if self.plan:
            return
        best = min((c for c in self.timed if self.timed[c][1]), key=self._per_token)
        if best == self.current:
            self.period = min(self.period * 2, self.max_period)
        else:
            self.current, self.period = best, self.first_period
            self.switches.append((self._steps, best))
        self.until_probe = self.period

    def _per_token(self, threads: int) -> float:
        seconds, tokens = self.timed[threads]
        return seconds / max(tokens, 1.0)
