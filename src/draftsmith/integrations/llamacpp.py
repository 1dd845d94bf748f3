"""llama.cpp in-process through PyPI ``xllamacpp`` (a prebuilt CPU wheel): plain, EAGLE-3, DFlash, DSpark and
n-gram decoding.

``xllamacpp.Server(CommonParams)`` runs llama-server's request loop without HTTP; ``handle_completions(dict)``
answers like ``/v1/completions``. Prompts are token-id lists, so every mode sees the same tokens. The engine's own
counters come back in ``timings``: ``predicted_n``/``predicted_ms`` (decode), ``prompt_ms`` (prefill) and, when a
drafter ran, ``draft_n``/``draft_n_accepted``. Imports core only (nothing of draftsmith's models).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

MODES = ("plain", "eagle3", "dflash", "dspark", "ngram")
# Drafter modes -> xllamacpp's common_speculative_type member: each needs a drafter GGUF of that kind.
DRAFT_TYPES = {"eagle3": "COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3", "dflash": "COMMON_SPECULATIVE_TYPE_DRAFT_DFLASH",
               "dspark": "COMMON_SPECULATIVE_TYPE_DRAFT_DSPARK"}
NGRAM_KEY = 3  # tokens of context an n-gram lookup matches on


def drafter_mode(gguf: str | Path) -> str:
    """The mode a drafter GGUF is served in: ``eagle3``, or for arch ``dflash`` ``dspark`` when it carries a Markov
    head (``markov_w1``) and ``dflash`` otherwise."""
    from draftsmith.core.gguf_file import open_gguf

    reader = open_gguf(gguf)
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch != "dflash":
        return "eagle3"
    return "dspark" if any(t.name == "markov_w1.weight" for t in reader.tensors) else "dflash"


def available() -> bool:
    return importlib.util.find_spec("xllamacpp") is not None


@dataclass
class EngineRun:
    """One greedy completion as llama.cpp reports it."""

    text: str
    completion_tokens: int
    predicted_ms: float
    prompt_ms: float
    draft_n: int = 0
    draft_n_accepted: int = 0
    k: int = 0  # the most tokens a round drafts (0: plain)

    @property
    def verify_passes(self) -> int:
        """Target passes after prefill: each emits its accepted drafts plus one token (the first comes from prefill).

        llama.cpp also counts drafts accepted past a stop token, which are never emitted; a round drafts at most
        ``k``, so ``draft_n / k`` bounds the passes from below where that count would come out short."""
        return max(verify_passes(self.completion_tokens, self.draft_n, self.draft_n_accepted, self.k), 1)

    @property
    def acceptance_length(self) -> float:
        """Tokens per verify pass (draftsmith's and vLLM's tau), from the engine's own counters."""
        return 1.0 + self.accepted_emitted / self.verify_passes

    @property
    def accepted_emitted(self) -> int:
        """Accepted drafts that were emitted (``draft_n_accepted`` less those past a stop token)."""
        return max(min(self.draft_n_accepted, self.completion_tokens - 1 - self.verify_passes), 0)

    @property
    def tokens_per_second(self) -> float:
        return 1000.0 * self.completion_tokens / self.predicted_ms if self.predicted_ms > 0 else 0.0


def verify_passes(completion_tokens: int, draft_n: int, draft_n_accepted: int, k: int) -> int:
    """A request's verify passes from llama.cpp's counters (see ``EngineRun.verify_passes``)."""
    emitted = completion_tokens - 1 - draft_n_accepted
    return max(emitted, -(-draft_n // k)) if k > 0 and draft_n > 0 else emitted


class LlamaCppEngine:
    """A llama.cpp server in this process for one target and one drafting mode (plain, eagle3, dflash, dspark,
    ngram). A block drafter (dflash, dspark) drafts ``k`` tokens a round; llama.cpp clamps k to its trained block."""

    def __init__(self, model: str | Path, mode: str = "plain", *, drafter: str | Path | None = None, k: int = 3,
                 threads: int = 1, n_ctx: int = 2048, verbose: bool = False):
        import xllamacpp as x

        if mode not in MODES:
            raise ValueError(f"unknown llama.cpp mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode in DRAFT_TYPES and drafter is None:
            raise ValueError(f"{mode} mode needs a drafter GGUF")
        p = x.CommonParams()
        p.model.path = str(model)
        p.n_ctx, p.n_parallel, p.warmup = n_ctx, 1, False
        p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads
        if not verbose:  # llama.cpp logs model loading and every request at its default (3); 0 keeps its errors
            p.verbosity = 0
        spec = p.speculative
        if mode in DRAFT_TYPES:
            spec.types = [getattr(x.common_speculative_type, DRAFT_TYPES[mode])]
            spec.draft.mparams.path = str(drafter)
            spec.draft.n_max, spec.draft.n_min, spec.draft.p_min = k, 0, 0.0
            spec.draft.cpuparams.n_threads = spec.draft.cpuparams_batch.n_threads = threads
        elif mode == "ngram":  # llama.cpp's prompt lookup: match the last n tokens earlier in the context
            spec.types = [x.common_speculative_type.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
            # Its default 12-token key almost never recurs in chat; 3 is draftsmith's lookup's longest n-gram.
            spec.ngram_simple.size_n, spec.ngram_simple.size_m, spec.ngram_simple.min_hits = NGRAM_KEY, k, 1
        self.mode, self.k = mode, k
        self.server = x.Server(p)

    def complete(self, prompt_ids: list[int], n_predict: int) -> EngineRun:
        """Greedy completion of ``prompt_ids`` (no prompt cache: every run pays its prefill)."""
        r = self.server.handle_completions({"prompt": list(map(int, prompt_ids)), "n_predict": int(n_predict),
                                            "temperature": 0.0, "top_k": 1, "cache_prompt": False})
        if "choices" not in r:
            raise RuntimeError(f"llama.cpp refused the request: {r.get('message') or r}")
        t = r.get("timings", {})
        return EngineRun(text=r["choices"][0]["text"], completion_tokens=int(r["usage"]["completion_tokens"]),
                         predicted_ms=float(t.get("predicted_ms", 0.0)), prompt_ms=float(t.get("prompt_ms", 0.0)),
                         draft_n=int(t.get("draft_n", 0)), draft_n_accepted=int(t.get("draft_n_accepted", 0)),
                         k=0 if self.mode == "plain" else self.k)
