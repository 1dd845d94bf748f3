"""A wall-clock budget for training: how many steps fit, planned from the steps already timed.

``max_minutes`` bounds a run by time instead of by steps: machines differ several-fold in seconds per step, and
a recipe that must fit N minutes everywhere cannot fix its step count. The count is planned early (after the
warm-up, whose learning rates do not depend on it) and planned again at each evaluation from the steps timed
since, so an early estimate that missed the steady cost is corrected while the run can still act on it. The
cosine decays to its floor at the planned end as it would at ``max_steps``; a checkpoint keeps the plan and the
time spent, so a resumed run goes on with both.

The first epoch costs more per step than the rest: the teacher's full-vocabulary argmax of each stored sample
is computed on its first visit and cached (``loop.Teacher``). The estimate therefore splits the timed steps
into their steady cost and that one-time cost per token still to visit.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Planning waits for at least this many timed steps (fewer are too noisy to extrapolate).
MIN_TIMED_STEPS = 5
#: Seconds kept for the end of a run: the final evaluation's extras, saves, the plot.
END_S = 5.0
#: The planned run aims to end this far inside the budget (step times wander by a few percent).
MARGIN = 0.03


@dataclass(frozen=True)
class Timing:
    """What the run measured up to the planning step."""

    elapsed_s: float  # since the run started, setup included
    step: int  # steps done
    step_s: float  # seconds of one step, without first visits' argmax and without evaluations
    argmax_s_per_token: float  # a first visit's teacher argmax, per token
    uncached_tokens: int  # training tokens whose argmax is still to be computed (first epoch)
    steps_per_epoch: int
    eval_s: float  # one evaluation (0 when the run has no held-out split)
    eval_every: int


def plan_steps(budget_s: float, max_steps: int, t: Timing) -> int:
    """The most steps (at most ``max_steps``, at least one more than done) whose estimated end is in budget."""
    left = budget_s * (1 - MARGIN) - t.elapsed_s - END_S
    first_epoch_left = max(0, t.steps_per_epoch - t.step)
    best = t.step + 1
    for n in range(t.step + 1, max_steps + 1):
        visited = min(1.0, (n - t.step) / first_epoch_left) if first_epoch_left else 1.0
        evals = n // max(1, t.eval_every) - t.step // max(1, t.eval_every) + (n % max(1, t.eval_every) != 0)
        cost = (n - t.step) * t.step_s + visited * t.uncached_tokens * t.argmax_s_per_token + evals * t.eval_s
        if cost > left:
            break
        best = n
    return min(best, max_steps)


def describe(planned: int, max_steps: int, budget_s: float, t: Timing) -> str:
    why = (f"{t.step_s:.2f} s a step, {t.elapsed_s / 60:.1f} of {budget_s / 60:.1f} min spent by step {t.step}")
    if planned >= max_steps:
        return f"all {max_steps} steps fit the {budget_s / 60:.1f}-minute budget ({why})"
    return f"planned {planned} of {max_steps} steps to fit the {budget_s / 60:.1f}-minute budget ({why})"
