"""The run: load the backend, feed it the jobs, write and count how every input line ends."""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.core.errors import one_line
from draftsmith.data.chat import Conversation, EmptyConversation
from draftsmith.data.prompts import EvaluationPromptDropped, drop_evaluation_prompts, evaluation_keys
from draftsmith.data.records import read_records
from draftsmith.stages.generate.backends import LocalBackend, VllmBackend, _Backend, _Sampling, _TokenBackend
from draftsmith.stages.generate.config import GenerateConfig, GenerateError, GenerateSummary, errors_path
from draftsmith.stages.generate.jobs import _Job, _Outcome, plan_turns
from draftsmith.stages.generate.openai import OpenAIBackend
from draftsmith.stages.generate.output import _count_lines, _Finished, _Progress, _read_finished, _Writer
from draftsmith.stages.generate.self_prompt import _self_prompt_jobs


def _load_backend(cfg: GenerateConfig, target: Any | None) -> _Backend:
    """The backend `cfg.backend` names, built from the options (or around a caller's loaded `target`)."""
    if cfg.backend == "local":
        if target is None:
            import torch

            from draftsmith.model.target import load_target

            dtype = getattr(torch, cfg.dtype) if cfg.dtype else None
            target = load_target(cfg.target, device=cfg.device, dtype=dtype)
        return LocalBackend(target, batch_size=cfg.batch_size, max_input_length=cfg.max_input_length)
    if cfg.backend == "vllm":
        from draftsmith.model.sources import resolve_model_path

        model_dir, gguf = resolve_model_path(cfg.target)
        if gguf is not None:
            raise GenerateError(f"{cfg.target}: --backend vllm needs a model directory (Hugging Face layout), "
                                "not a GGUF file")
        return VllmBackend(model_dir, cfg.vllm_python, batch_size=cfg.batch_size,  # type: ignore[arg-type]
                           max_input_length=cfg.max_input_length, dtype=cfg.dtype,
                           max_num_seqs=cfg.vllm_max_num_seqs, kv_cache_gib=cfg.vllm_kv_cache_gib, seed=cfg.seed,
                           tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                           gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                           log_path=Path(cfg.out).with_name(Path(cfg.out).name + ".vllm.log"))
    tokenizer = None
    if cfg.tokenizer is not None:
        from transformers import AutoTokenizer

        path = Path(cfg.tokenizer)
        if not path.exists():
            raise FileNotFoundError(f"{cfg.tokenizer}: no such tokenizer directory")
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise GenerateError(f"{cfg.tokenizer}: cannot load a tokenizer ({exc})") from None
    elif target is not None:
        tokenizer = target.tokenizer
    if tokenizer is None and (cfg.self_prompt is not None or cfg.max_input_length is not None):
        raise GenerateError("--self-prompt and --max-input-length with --backend openai need --tokenizer DIR "
                            "(the served model's tokenizer, for its chat template and token counts)")
    api_key = cfg.api_key or os.environ.get("OPENAI_API_KEY") or None
    return OpenAIBackend(cfg.server_urls, model=cfg.served_model_name, tokenizer=tokenizer, api_key=api_key,
                         concurrency=cfg.concurrency, timeout=cfg.timeout, retries=cfg.retries,
                         retry_backoff=cfg.retry_backoff, max_input_length=cfg.max_input_length)


def _setup_resume(out: Path) -> _Finished:
    """What an earlier run into `out` finished, warning about lines that cannot be read back."""
    finished = _read_finished(out)
    if finished.unreadable:
        print(f"draftsmith: warning: {finished.unreadable} unreadable line(s) in {out} are ignored; their "
              "conversations are generated again", file=sys.stderr)
    return finished


def _setup_backend(cfg: GenerateConfig, target: Any | None) -> _Backend:
    """The loaded backend, its chat template checked wherever this process renders prompts."""
    backend = _load_backend(cfg, target)
    if cfg.self_prompt is not None or cfg.backend == "local":
        from draftsmith.data.chat import chat_format

        chat_format(backend.tokenizer)  # fail fast, naming the tokenizer, when its template is unusable
    return backend


class _Tally:
    """Where each input line ends (a record, a line of the errors file, a count) and the bar that shows it."""

    def __init__(self, cfg: GenerateConfig, out: Path) -> None:
        self.summary = GenerateSummary(out=out)
        self.err_file = errors_path(out)
        self.writer = _Writer(out, cfg.fsync_every)
        self.errors = _Writer(self.err_file, cfg.fsync_every, mode="w")  # this run's failures only; they are retried
        total = cfg.self_prompt if cfg.self_prompt is not None else _count_input(cfg)
        self.progress = _Progress(total, cfg.progress)

    def fail(self, line: int | None, cid: str | None, reason: str, *, worked: bool = True) -> None:
        self.summary.error += 1
        self.errors.write({"line": line, "id": cid, "reason": reason})
        self.progress.step(False, worked=worked)

    def skip(self, reason: str) -> None:
        self.summary.skipped += 1
        self.summary.skip_reasons[reason] += 1
        self.progress.step(False, worked=False)

    def already(self) -> None:
        self.summary.already += 1
        self.progress.step(False, worked=False)

    def close(self) -> None:
        self.writer.close()
        self.errors.close()
        self.progress.close()


def _classify(item: Conversation | Exception, seen: set[str], finished: _Finished, system: str | None,
              max_turns: int | None = None) -> tuple[str, str | list[list[dict[str, str]]]]:
    """How one input line ends: ("job", segments), ("already", id), ("skip", reason) or ("error", reason)."""
    if isinstance(item, EmptyConversation):
        return "skip", "empty conversation"
    if isinstance(item, EvaluationPromptDropped):
        return "skip", "evaluation prompt"
    if isinstance(item, Exception):
        return "error", str(item)
    if item.id in seen:
        return "skip", "duplicate id"
    seen.add(item.id)
    if item.id in finished.ids:
        return "already", item.id
    segments = plan_turns(item.messages, system)[:max_turns]
    if not segments:
        return "skip", "no user turn"
    return "job", segments


def _input_jobs(cfg: GenerateConfig, finished: _Finished, tally: _Tally) -> Iterator[_Job]:
    """Jobs for the input file's lines still to do; every other line is counted as it is read."""
    seen: set[str] = set()
    for line, item in _input_records(cfg):
        tally.summary.total += 1
        kind, what = _classify(item, seen, finished, cfg.system, cfg.max_turns)
        if kind == "skip":
            tally.skip(what)  # type: ignore[arg-type]
        elif kind == "error":
            tally.fail(line, None, what, worked=False)  # type: ignore[arg-type]
        elif kind == "already":
            tally.already()
        else:
            yield _Job(item.id, line, what)  # type: ignore[union-attr, arg-type]


_SHOWN_BAD_LINES = 3


def _input_records(cfg: GenerateConfig) -> Iterator[tuple[int, Conversation | Exception]]:
    """The input's conversations, evaluation prompts dropped (never train on them), the first --limit."""
    path = cfg.input_path()
    records = drop_evaluation_prompts(read_records(path), evaluation_keys())
    return itertools.islice(records, cfg.limit) if cfg.limit is not None else records


def _count_input(cfg: GenerateConfig) -> int:
    """The progress bar's total: records of a JSON array, non-blank lines of JSONL, at most --limit."""
    path = cfg.input_path()
    n = sum(1 for _ in read_records(path)) if path.suffix == ".json" else _count_lines(path)
    return min(n, cfg.limit) if cfg.limit is not None else n


def _check_usable_input(cfg: GenerateConfig, finished: _Finished) -> None:
    """Refuse an input with no conversation to generate or already generated, before the backend loads.

    Reads only up to the first usable line, so a good input costs next to nothing. The error names the
    number of lines and why the first few are unusable, on one line.
    """
    seen: set[str] = set()
    path = str(cfg.input_path())
    lines, bad = 0, []
    for line, item in _input_records(cfg):
        lines += 1
        kind, what = _classify(item, seen, finished, cfg.system, cfg.max_turns)
        if kind in ("job", "already"):
            return
        if len(bad) <= _SHOWN_BAD_LINES:
            reason = one_line(item) if isinstance(item, Exception) else what
            for prefix in (f"{path}: ", f"line {line}: "):  # already said around it
                reason = reason.removeprefix(prefix)  # type: ignore[union-attr]
            bad.append(f"line {line}: {reason}")
    detail = ""
    if bad:
        more = ", ..." if len(bad) > _SHOWN_BAD_LINES else ""
        detail = f" ({', '.join(bad[:_SHOWN_BAD_LINES])}{more})"
    raise GenerateError(f"{path}: no usable conversation in {lines} line{'' if lines == 1 else 's'}{detail}")


def _self_jobs(cfg: GenerateConfig, finished: _Finished, backend: _Backend, tally: _Tally) -> Iterator[_Job]:
    """Jobs answering the self-prompted questions an earlier run did not finish."""
    n = cfg.self_prompt or 0
    tally.summary.total = n
    known = set(finished.questions)
    pending = []
    for i in range(n):
        if f"self-{cfg.seed}-{i}" in finished.ids:
            tally.already()
        else:
            pending.append(i)
    yield from _self_prompt_jobs(backend, cfg, pending, known, lambda i, sid, why: tally.fail(None, sid, why))


def _write_outcomes(outcomes: Iterator[_Outcome], backend: _Backend, tally: _Tally) -> None:
    """The loop: each finished conversation becomes one output record (or one line of the errors file)."""
    summary = tally.summary
    for outcome in outcomes:
        job = outcome.job
        if outcome.messages is None:
            tally.fail(job.line, job.id, outcome.error or "unknown error")
            continue
        record: dict[str, Any] = {"id": job.id, "messages": outcome.messages, "source_line": job.line,
                                  "backend": backend.name, "model": backend.model_name}
        if outcome.num_tokens is not None:
            record["num_generated_tokens"] = outcome.num_tokens
            summary.generated_tokens += outcome.num_tokens
        record["finish_reasons"] = outcome.finish_reasons
        if outcome.truncated:
            record["truncated"] = True
        tally.writer.write(record)
        summary.new += 1
        tally.progress.step(True, outcome.num_tokens)


def generate(config: GenerateConfig, *, target: Any | None = None) -> GenerateSummary:
    """Run one generation pass (resuming an earlier one) and return how every input line ended.

    `target` lets a caller reuse a loaded `draftsmith.model.target.Target` for the local backend. Raises
    GenerateError/FileNotFoundError for unusable options or inputs before generating anything.
    """
    cfg = config
    cfg.validate()
    out = Path(cfg.out)
    if out.exists() and not out.is_file():
        raise GenerateError(f"{out}: output path exists and is not a file")
    lock = _lock_out(out)
    try:
        return _generate(cfg, out, target)
    finally:
        lock.release(remove=True)  # a lock file left beside --out after the run only puzzles


def _lock_out(out: Path):
    """Hold ``.OUT.lock`` beside ``--out`` for the run: two runs appending to one file would each write every id."""
    from draftsmith.core.io import ExclusiveLock, LockHeld

    path = out.with_name(f".{out.name}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # as the writer would
    except (FileExistsError, NotADirectoryError) as e:
        raise GenerateError(f"--out {out}: {path.parent} is not a directory") from e
    try:
        return ExclusiveLock(path, "this output file")
    except LockHeld as e:
        raise GenerateError(f"another generate run is writing {out} ({path} is locked); wait for it to finish "
                            "or choose another --out") from e


def _generate(cfg: GenerateConfig, out: Path, target: Any | None) -> GenerateSummary:
    t0 = time.monotonic()
    finished = _setup_resume(out)
    if cfg.self_prompt is None:
        _check_usable_input(cfg, finished)
    backend = _setup_backend(cfg, target)
    tally = _Tally(cfg, out)
    if cfg.self_prompt is not None:
        jobs = _self_jobs(cfg, finished, backend, tally)
    else:
        jobs = _input_jobs(cfg, finished, tally)
    sampling = _Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p)
    try:
        _write_outcomes(backend.run(jobs, sampling, cfg.seed), backend, tally)
    finally:
        tally.close()
        if isinstance(backend, _TokenBackend):
            backend.close()
    summary = tally.summary
    if summary.error == 0:
        tally.err_file.unlink(missing_ok=True)
    else:
        summary.errors_file = tally.err_file
    summary.seconds = time.monotonic() - t0
    return summary
