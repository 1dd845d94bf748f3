"""oneDNN-prepacked ``nn.Linear`` for CPU inference: a cheaper decoding step and a cheaper k-token verify pass.

Speculative decoding lives on a k-token verify pass costing about what a 1-token step does. On CPUs
``F.linear`` re-lays out the weight (bf16) or goes through a GEMM that scales badly with rows (fp32) on every
call; a weight reordered once by oneDNN for ``batch_hint`` rows removes both. The math is the same GEMM:
bf16 results match ``F.linear`` bit for bit, fp32 ones differ by reduction-order rounding only.

``PackedLinear`` *is* an ``nn.Linear`` holding the very same ``weight``/``bias`` Parameters, so state_dict
keys, tied embeddings (the embedding reads the Parameter, never the packed copy) and code that reads
``lm_head.weight`` are unchanged. The packed copy is derived state: it is rebuilt whenever the weight was
modified in place, replaced or moved, and any call it cannot serve (autograd, another dtype or device) runs
plain ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# fp32 measured fastest at 16 for every pass of 1..16 tokens (a 16-row pack serves 1 row as well);
# bf16 does not depend on the hint. One packed copy per weight therefore serves every k.
DEFAULT_BATCH_HINT = 16
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available() -> bool:
    """Whether this torch build has oneDNN and the two private ops packing needs."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    try:
        return bool(torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


def dtype_packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU: its bf16 path needs AVX-512 (BW/VL/DQ) or
    AVX-NE-CONVERT and raises on an AVX2-only CPU."""
    return dtype in _PACKABLE_DTYPES and packing_available() and _packs(dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    """Pack and run a tiny weight once. Cached per process: the answer is the CPU's and the torch build's."""
    try:
        w = torch.ones(8, 8, dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype),
                                            torch.ops.mkldnn._reorder_linear_weight(w, 2), None, "none", [], "")
    except RuntimeError:
        return False
    return True


def _weight_key(w: torch.Tensor) -> tuple:
    """Changes when the weight is modified in place (version), replaced, moved or cast."""
    return (w._version, w.data_ptr(), w.device, w.dtype)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs on a oneDNN-prepacked copy of its weight (same Parameters)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = DEFAULT_BATCH_HINT):
        nn.Module.__init__(self)  # no fresh weight: share the original Parameters
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.batch_hint = int(batch_hint)
        self.__dict__["_original"] = linear  # unregistered: not a submodule, no ``.lin.`` state_dict keys
        self._packed: torch.Tensor | None = None
        self._key: tuple | None = None
        self.repack()

    @property
    def original(self) -> nn.Linear:
        return self.__dict__["_original"]

    def repack(self) -> None:
        """(Re)build the packed copy from the current weight, or drop it where packing does not apply."""
        w, b = self.weight, self.bias
        ok = w.device.type == "cpu" and dtype_packable(w.dtype) and (b is None or b.dtype == w.dtype)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.batch_hint) if ok else None
        self._key = _weight_key(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._key != _weight_key(self.weight):
            self.repack()
        p = self._packed
        if (p is None or x.dtype != self.weight.dtype or x.device.type != "cpu" or x.numel() == 0
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)  # the packed op has no autograd
        bias = None if self.bias is None else self.bias.detach()
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(x2, p, bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, batch_hint={self.batch_hint}, packed={self._packed is not None}"


def _packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    w = module.weight
    return (w.device.type == "cpu" and dtype_packable(w.dtype)
            and (module.bias is None or module.bias.dtype == w.dtype)
            and not (module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook")))


def pack_linears(model: nn.Module, batch_hint: int = DEFAULT_BATCH_HINT) -> int:
    """Swap every plain CPU fp32/bf16 ``nn.Linear`` for a ``PackedLinear``; return how many were swapped.

    Subclasses of ``nn.Linear`` (their forward may differ), hooked modules, other dtypes and devices are left
    alone, and so is everything where oneDNN is unavailable or cannot pack that dtype on this CPU (returns 0).
    A module shared by several parents gets one packed copy.
    """
    if not packing_available():
        return 0
    swapped: dict[int, PackedLinear] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _packable(child):
                continue
            if id(child) not in swapped:
                swapped[id(child)] = PackedLinear(child, batch_hint)
            setattr(parent, name, swapped[id(child)])
    return len(swapped)


def unpack_linears(model: nn.Module) -> int:
    """Put the original ``nn.Linear`` modules back (holding the current Parameters); return how many."""
    restored: set[int] = set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                original = child.original
                original.weight = child.weight
                original.bias = child.bias
                setattr(parent, name, original)
                restored.add(id(child))
    return len(restored)
