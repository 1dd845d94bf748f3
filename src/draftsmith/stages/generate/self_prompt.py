"""Self-prompting (Magpie): questions written by the target from its chat template's user header."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from draftsmith.data.chat import encode_rendered, end_of_turn_texts, user_turn_prefix
from draftsmith.stages.generate.backends import _Backend, _Sampling, _TokenBackend
from draftsmith.stages.generate.config import GenerateConfig, ServerError
from draftsmith.stages.generate.jobs import _derive_seed, _Job, _normalise_question, plan_turns


def _self_prompt_jobs(backend: _Backend, cfg: GenerateConfig, pending: list[int], known: set[str],
                      fail: Callable[[int, str, str], None]) -> Iterator[_Job]:
    """Questions for the pending indices, written by the target from its user header; then jobs to answer.

    Each candidate is sampled with its own seed (seed, index, attempt), so a run is reproducible; empty,
    too short, unfinished and duplicate questions are resampled with the next attempt, up to a limit.
    """
    tok = backend.tokenizer
    prefix = encode_rendered(tok, user_turn_prefix(tok, system=cfg.system))
    stops = end_of_turn_texts(tok)
    sampling = _Sampling(cfg.question_max_new_tokens, cfg.question_temperature, cfg.question_top_p,
                         cfg.question_top_k)
    chunk_size = backend.batch_size if isinstance(backend, _TokenBackend) else cfg.concurrency
    for start in range(0, len(pending), chunk_size):
        todo = {i: 0 for i in pending[start:start + chunk_size]}  # index -> attempt
        accepted: dict[int, str] = {}
        reasons: dict[int, str] = {}
        tries: Counter = Counter()
        while todo:
            # Fill the batch: an index that keeps failing gets several attempts (its next seeds) in one round,
            # so late rounds are not near-empty batches that cost a full generation each. The lowest accepted
            # attempt wins, so the result does not depend on how attempts were grouped into rounds.
            order = sorted(todo)
            slots = [(i, todo[i] + j) for j in range(cfg.question_attempts) for i in order
                     if todo[i] + j < cfg.question_attempts][:max(chunk_size, len(order))]
            slots.sort()
            seeds = [_derive_seed(cfg.seed, f"self/{i}/{attempt}") for i, attempt in slots]
            results = backend.write_questions(prefix, seeds, sampling, stops)
            for (i, attempt), res in zip(slots, results, strict=True):
                if i not in todo or attempt < todo[i]:
                    continue  # an earlier attempt of this index was accepted or failed out this round
                if isinstance(res, Exception):
                    reason = f"question: {res}"
                else:
                    text = res.content.strip()
                    key = _normalise_question(text)
                    if res.finish_reason == "length" and not cfg.question_allow_unfinished:
                        reason = "question did not end within question-max-new-tokens"
                    elif len(text) < cfg.question_min_chars:
                        reason = f"question shorter than {cfg.question_min_chars} characters"
                    elif key in known:
                        reason = "duplicate question"
                    else:
                        known.add(key)
                        accepted[i] = text
                        del todo[i]
                        continue
                reasons[i] = reason
                tries[i] += 1
                todo[i] = attempt + 1
                if todo[i] >= cfg.question_attempts or (isinstance(res, ServerError) and res.status):
                    del todo[i]
        for i in sorted(set(pending[start:start + chunk_size])):
            sid = f"self-{cfg.seed}-{i}"
            if i in accepted:
                messages = [{"role": "user", "content": accepted[i]}]
                yield _Job(sid, None, plan_turns(messages, cfg.system))
            else:
                fail(i, sid, f"no usable self-prompted question after {tries[i]} attempt(s) "
                             f"(last: {reasons.get(i, 'unknown')})")
