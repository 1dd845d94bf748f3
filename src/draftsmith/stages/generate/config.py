"""What one run is told (GenerateConfig), what it reports (GenerateSummary) and how it fails."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from draftsmith.core.errors import DraftsmithError
from draftsmith.data.prompts import conversation_source

BackendName = Literal["local", "vllm", "openai"]


class GenerateError(DraftsmithError, ValueError):
    """A run that cannot start: bad options, an unusable target or tokenizer, an unreachable server."""


class ServerError(DraftsmithError, RuntimeError):
    """One request failed for good: rejected by the server (4xx) or still failing after the retries."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _TurnTooLong(ValueError):
    """A turn's prompt exceeds --max-input-length (or the local model's context)."""


@dataclass
class GenerateConfig:
    """Everything one run needs; the CLI builds it from flags, tests and the demo build it directly."""

    out: str | Path
    input: str | Path | None = None  # JSONL / JSON-array conversations, or 'sharegpt'; or None with self_prompt
    limit: int | None = None  # the first N conversations of the input (after evaluation prompts are dropped)
    max_turns: int | None = None  # answer only the first N user turns of each input conversation
    self_prompt: int | None = None  # N questions written by the target itself (Magpie)
    backend: BackendName = "local"
    # local backend
    target: str | Path = "smollm2"
    device: str = "cpu"
    dtype: str | None = None  # "float32" | "bfloat16" | "float16"; None: the target's default
    batch_size: int | None = None  # conversations per round (local and vllm); None: the backend's default
    # vllm backend: vLLM's offline engine in a child process run by this Python (a venv with vLLM)
    vllm_python: str | Path | None = None
    vllm_max_num_seqs: int = 128
    vllm_kv_cache_gib: float = 2.0  # vLLM on CPU; on GPUs vllm_gpu_memory_utilization applies
    vllm_tensor_parallel_size: int = 1
    vllm_gpu_memory_utilization: float | None = None  # None: vLLM's default
    # openai backend
    server_urls: Sequence[str] = ()
    served_model_name: str | None = None
    tokenizer: str | Path | None = None  # for --self-prompt / --max-input-length against a server
    api_key: str | None = None
    concurrency: int = 16
    timeout: float = 600.0
    retries: int = 5
    retry_backoff: float = 1.0  # seconds before the first retry; doubles per retry
    # generation
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    system: str | None = None
    max_input_length: int | None = None
    # self-prompting (the question; the answer uses the options above)
    question_temperature: float = 1.0
    question_top_p: float = 0.95
    # 0: off. top-k needs no sort of the vocabulary: vLLM's CPU sampler writes questions ~3x faster with
    # top_k 50 than with top_p 0.95 (SmolLM2, 128 in flight, 2 cores).
    question_top_k: int = 0
    question_max_new_tokens: int = 128
    question_min_chars: int = 10
    question_attempts: int = 8
    question_allow_unfinished: bool = False  # keep questions cut by the token limit (random tiny targets)
    progress: bool = True
    fsync_every: float = 5.0  # seconds between fsyncs of the output

    def input_path(self) -> Path:
        """The input file: a path, or ShareGPT's file inside its PyPI package for 'sharegpt'."""
        return conversation_source(self.input)  # type: ignore[arg-type]

    def validate(self) -> None:
        """Reject bad option values before anything is loaded (one-line errors at the CLI)."""
        if (self.input is None) == (self.self_prompt is None):
            raise GenerateError("give exactly one of an input file (--input) or --self-prompt N")
        if self.self_prompt is not None and self.self_prompt < 1:
            raise GenerateError(f"--self-prompt must be >= 1, got {self.self_prompt}")
        if self.input is not None and not self.input_path().is_file():
            raise FileNotFoundError(f"{self.input}: no such input file")
        if self.limit is not None and self.limit < 1:
            raise GenerateError(f"--limit must be >= 1, got {self.limit}")
        if self.max_turns is not None and self.max_turns < 1:
            raise GenerateError(f"--max-turns must be >= 1, got {self.max_turns}")
        if self.backend not in ("local", "vllm", "openai"):
            raise GenerateError(f"unknown backend {self.backend!r}; expected local, vllm or openai")
        if self.backend == "vllm":
            if self.vllm_python is None:
                raise GenerateError("--backend vllm needs --vllm-python PATH (a Python with vLLM installed; "
                                    "`make vllm-env` makes .venv-vllm/bin/python)")
            if not Path(self.vllm_python).is_file():
                raise FileNotFoundError(f"{self.vllm_python}: no such Python for --backend vllm")
            if self.vllm_max_num_seqs < 1 or self.vllm_tensor_parallel_size < 1 or not self.vllm_kv_cache_gib > 0:
                raise GenerateError("--max-num-seqs and --tensor-parallel-size must be >= 1 and --kv-cache-gib > 0")
        if self.backend == "openai" and not self.server_urls:
            raise GenerateError("--backend openai needs --server-url URL (repeatable)")
        for name in ("batch_size", "concurrency", "max_new_tokens", "question_max_new_tokens", "question_attempts"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise GenerateError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_input_length is not None and self.max_input_length < 1:
            raise GenerateError(f"--max-input-length must be >= 1, got {self.max_input_length}")
        for name in ("temperature", "question_temperature"):
            if not 0 <= getattr(self, name) < float("inf"):  # NaN fails too
                raise GenerateError(f"{name.replace('_', '-')} must be >= 0 and finite, got {getattr(self, name)}")
        if self.question_top_k < 0:
            raise GenerateError(f"question-top-k must be >= 0, got {self.question_top_k}")
        for name in ("top_p", "question_top_p"):
            if not 0 < getattr(self, name) <= 1:
                raise GenerateError(f"{name.replace('_', '-')} must be in (0, 1], got {getattr(self, name)}")
        if self.retries < 0 or self.timeout <= 0:
            raise GenerateError("--retries must be >= 0 and --timeout > 0")
        if self.dtype not in (None, "float32", "bfloat16", "float16", "float64"):
            raise GenerateError(f"unknown dtype {self.dtype!r}")


@dataclass
class GenerateSummary:
    """How every input line ended; done + error + skipped == total, always."""

    out: Path
    total: int = 0
    new: int = 0
    already: int = 0
    error: int = 0
    skipped: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    skip_reasons: Counter = field(default_factory=Counter)
    errors_file: Path | None = None

    @property
    def done(self) -> int:
        return self.new + self.already

    def to_dict(self) -> dict:
        """The summary as ``generate --json`` prints it."""
        return {"out": str(self.out), "done": self.done, "new": self.new, "already": self.already,
                "error": self.error, "skipped": self.skipped, "total": self.total,
                "generated_tokens": self.generated_tokens, "seconds": round(self.seconds, 3),
                "skip_reasons": dict(self.skip_reasons),
                "errors_file": None if self.errors_file is None else str(self.errors_file)}

    def __str__(self) -> str:
        return (f"done {self.done} (new {self.new}, already {self.already}) error {self.error} "
                f"skipped {self.skipped} total {self.total}")


def errors_path(out: str | Path) -> Path:
    """The sidecar listing this run's failed lines (retried by the next run)."""
    out = Path(out)
    return out.with_name(out.name + ".errors.jsonl")
