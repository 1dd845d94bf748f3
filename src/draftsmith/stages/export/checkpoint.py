"""The canonical in-memory drafter checkpoint every layout is read into and written from, and the layouts' names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from draftsmith.core import vocab as vocab_mod
from draftsmith.core.conventions import ConventionError
from draftsmith.core.layouts import (  # noqa: F401 (re-exported)
    EXPORT_FORMATS,
    IMPORT_FORMATS,
    LLAMA_EAGLE3_ARCHITECTURES,
    MANIFEST_FILE,
    SGLANG_ARCHITECTURE,
    SPECULATORS_ARCHITECTURE,
    VLLM_ARCHITECTURE,
)
from draftsmith.model.drafter import DrafterConfig, Eagle3Drafter

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Config switches of EAGLE-3 variants whose computation draftsmith's drafter does not implement. (The EAGLE-3.1
# norms, core.conventions.NORM_SWITCHES, it does.)
_UNSUPPORTED_SWITCHES = ("attention_bias", "mlp_bias", "bias")


# Export and import fail with the conventions module's error: converting between layouts is its concern.
ExportError = ConventionError


# --- the canonical in-memory checkpoint -----------------------------------------------------------------

def check_finite(state: dict, source) -> None:
    """Weights holding NaN or infinities (a diverged run, a damaged file) load in every engine and draft garbage,
    silently: refused before anything is written."""
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ExportError(f"{source}: {name} holds NaN or infinite values (a run that diverged, or a damaged "
                              "file): export a checkpoint from before it")

@dataclass
class DrafterCheckpoint:
    """A drafter as plain data: config plus tensors under draftsmith's names (``layers.0.*``, ``d2t``, ``t2d``).

    ``aux_known`` is False for checkpoints that never said which target layers they read (the reference
    EAGLE-3 releases): engines then use the target's default (2, N//2, N-3), and so does ``load_drafter``.
    """

    config: DrafterConfig
    state: dict[str, torch.Tensor]
    aux_known: bool = True
    source: str = "<in memory>"
    source_format: str = "draftsmith"
    warnings: list[str] = field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return self.state["fc.weight"].dtype

    @property
    def has_own_embedding(self) -> bool:
        return "embed_tokens.weight" in self.state

    @property
    def n_aux(self) -> int:
        return self.state["fc.weight"].shape[1] // self.config.target_hidden_size

    @classmethod
    def from_drafter(cls, drafter: Eagle3Drafter) -> DrafterCheckpoint:
        state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
        return cls(config=dataclasses.replace(drafter.config), state=state)

    def build(self) -> Eagle3Drafter:
        """An ``Eagle3Drafter`` holding exactly these tensors (strict load: every shape is checked)."""
        cfg = self.config
        if not self.aux_known:  # fc's width needs a count; the ids themselves stay unknown
            cfg = dataclasses.replace(cfg, aux_layer_ids=tuple(range(self.n_aux)))
        check_finite(self.state, self.source)
        n = (cfg.target or {}).get("num_layers")
        if self.aux_known and isinstance(n, int) and any(not 0 <= i < n for i in cfg.aux_layer_ids):
            raise ExportError(f"{self.source}: aux layer ids {list(cfg.aux_layer_ids)} fall outside the {n} layers of "
                              f"the target its fingerprint names (valid 0..{n - 1}): every engine would refuse it or "
                              "read other states")
        dv = vocab_mod.DraftVocab(d2t=self.state["d2t"], t2d=self.state["t2d"])
        drafter = Eagle3Drafter(cfg, draft_vocab=dv, own_embedding=self.has_own_embedding).to(self.dtype)
        try:
            drafter.load_state_dict(self.state, strict=True)
        except RuntimeError as e:
            raise ExportError(f"{self.source}/config.json: its sizes disagree with the tensors: "
                              f"{' '.join(str(e).split())}") from e
        return drafter.eval()
