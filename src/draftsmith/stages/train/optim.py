"""The trainer's optimizer: AdamW, or Muon for the hidden weight matrices with AdamW for the rest.

Muon orthogonalises each update (Newton-Schulz), which only means something for a 2-D matrix that maps hidden
states to hidden states. Embeddings, output heads (lm_head, the Markov head's table and projection), norms,
biases and degenerate ``[1, N]`` matrices stay with AdamW: the split speculators (v0.7+) and Keller Jordan's
Muon use. Both halves live in one ``torch.optim.Optimizer`` whose ``param_groups`` are the two inner
optimizers' own groups, so one LambdaLR schedules both and one ``state_dict`` checkpoints both.
"""

from __future__ import annotations

import torch

# 2-D weights that are lookup tables or output heads, not hidden-to-hidden maps: AdamW's, as in speculators.
ADAMW_NAMES = ("embed", "lm_head", "markov_w1", "markov_w2")
MUON_LR_SCALE = 10.0  # speculators: --muon-lr defaults to 10 * --lr
MUON_WEIGHT_DECAY = 0.1
MUON_MOMENTUM = 0.95
ADAMW_BETAS = (0.9, 0.95)


def split_for_muon(named: list[tuple[str, torch.nn.Parameter]]) -> tuple[list, list]:
    """(Muon's, AdamW's) named parameters: Muon takes the trainable 2-D matrices, both sides > 1, that are not
    embeddings or heads."""
    muon, adamw = [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAMES)
        (muon if hidden_matrix else adamw).append((name, p))
    return muon, adamw


class MuonAdamW(torch.optim.Optimizer):
    """Muon over the hidden matrices and AdamW over the rest, stepped together.

    ``param_groups`` holds the inner optimizers' group dicts themselves (Muon's first), so a scheduler that
    scales each group's lr from its ``initial_lr`` drives both; the state dict nests the two optimizers' own.
    """

    def __init__(self, muon_params: list, adamw_params: list, *, lr: float, muon_lr: float, weight_decay: float,
                 muon_weight_decay: float, fused: bool = False):
        if not muon_params:
            raise ValueError("--optimizer muon: the drafter has no hidden 2-D matrix for Muon")
        self.muon = torch.optim.Muon(muon_params, lr=muon_lr, weight_decay=muon_weight_decay,
                                     momentum=MUON_MOMENTUM, nesterov=True, adjust_lr_fn="match_rms_adamw")
        self.adamw = (torch.optim.AdamW(adamw_params, lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay,
                                        **({"fused": True} if fused else {})) if adamw_params else None)
        self._ready = False  # the base class builds (and checks) groups of its own first
        super().__init__([p for o in self._inner for g in o.param_groups for p in g["params"]], {"lr": lr})
        self._ready = True

    @property
    def _inner(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizers' live groups: ``load_state_dict`` replaces an optimizer's group dicts, so a list
        taken once would leave the scheduler setting the lr of groups nobody steps."""
        return [g for o in self._inner for g in o.param_groups] if self._ready else self._own_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self._own_groups = groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self._inner:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self._inner:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": None if self.adamw is None else self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or "muon" not in state_dict:
            raise ValueError("not the state of a Muon + AdamW optimizer (was the run trained with --optimizer adamw?)")
        self.muon.load_state_dict(state_dict["muon"])
        if self.adamw is not None:
            self.adamw.load_state_dict(state_dict["adamw"])


def build_optimizer(cfg, drafter: torch.nn.Module, fused_adamw: bool) -> torch.optim.Optimizer:
    """``cfg.optimizer``'s optimizer over the drafter's trainable parameters (run._setup_optimizer's)."""
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW([p for _, p in named], lr=cfg.lr, betas=ADAMW_BETAS, weight_decay=cfg.weight_decay,
                                 **({"fused": True} if fused_adamw else {}))
    muon, adamw = split_for_muon(named)
    return MuonAdamW([p for _, p in muon], [p for _, p in adamw], lr=cfg.lr,
                     muon_lr=cfg.muon_lr if cfg.muon_lr is not None else MUON_LR_SCALE * cfg.lr,
                     weight_decay=cfg.weight_decay,
                     muon_weight_decay=MUON_WEIGHT_DECAY if cfg.muon_weight_decay is None else cfg.muon_weight_decay,
                     fused=fused_adamw)
