"""Guards for one-line bugs the rest of the default suite could not see (issue 43): the store's file hash past
its first chunk, the vLLM capture hook's residual stream, and SpecForge's layer-id convention at load."""

from __future__ import annotations

import hashlib
import json

import torch
from conftest import tiny_target
from safetensors.torch import load_file, save_file

from draftsmith.core.io import sha256_file
from draftsmith.model.drafter import load_drafter, new_drafter
from draftsmith.model.target import Target
from draftsmith.testing.models import build_tiny_model


# --- F1: sha256_file hashes the whole file ----------------------------------------------------------------------------
def test_sha256_file_hashes_every_chunk(tmp_path):
    """Every test shard is under the 4 MiB chunk: a hash of the first chunk alone would pass everywhere else."""
    data = torch.randint(0, 256, (4 * 1024 * 1024 + 4097,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.uint8).numpy().tobytes()
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert sha256_file(path, chunk=1000) == hashlib.sha256(data).hexdigest()  # many chunks, a short last one
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a flip in the last byte changes the hash
    assert sha256_file(path) != hashlib.sha256(data).hexdigest()


# --- C1: the vLLM capture hook stores hidden + residual ------------------------------------------------------------
class _FakeDecoderLayer(torch.nn.Module):
    """vLLM's decoder-layer call signature: (positions, hidden_states, residual)."""

    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual


def test_vllm_capture_hook_stores_the_residual_stream():
    """vLLM splits the residual stream into (hidden_states, residual) between layers; the aux state EAGLE-3 reads
    is their sum (vLLM's own aux capture adds them). Driven on a fake layer: no vLLM is imported."""
    from draftsmith.integrations.vllm import _Capturer

    capturer = _Capturer.__new__(_Capturer)  # __init__ needs vLLM's distributed state; the hook does not
    capturer.aux, capturer.positions = {}, None
    layer = _FakeDecoderLayer()
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(5)
    hidden, residual = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    handle = layer.register_forward_pre_hook(capturer._aux_hook(3), with_kwargs=True)
    for args, kwargs in [((positions, hidden, residual), {}),
                         ((), {"positions": positions, "hidden_states": hidden, "residual": residual}),
                         ((positions,), {"hidden_states": hidden, "residual": residual})]:
        capturer.aux = {}
        layer(*args, **kwargs)
        torch.testing.assert_close(capturer.aux[3], hidden + residual, atol=0, rtol=0)
    capturer.aux = {}
    layer(positions, hidden, None)  # layer 0 receives no residual yet: the hidden state is the stream
    torch.testing.assert_close(capturer.aux[3], hidden, atol=0, rtol=0)
    handle.remove()


# --- C3: a SpecForge/SGLang drafter's eagle_config ids are translated at load ----------------------------------------
def _specforge_layout(path, sglang_ids: list[int]) -> None:
    """Rewrite a saved drafter as SpecForge ships one: ids only in ``eagle_config`` (output of layer i),
    ``midlayer.*`` weight names, no draftsmith block."""
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg.pop("draftsmith")
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True}
    (path / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(path / "model.safetensors"))
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in weights.items()}, str(path / "model.safetensors"))


def test_specforge_eagle_config_ids_are_translated_at_load(tmp_path):
    """SGLang counts aux layers as 'output of layer i': SpecForge's [1, 3, 4] are the inputs of layers 2, 4, 5.
    Read literally, the load would move the target's aux layers to 1, 3, 4 without a word."""
    saved = new_drafter(tiny_target("llama"), seed=0)
    assert tuple(saved.config.aux_layer_ids) == (2, 4, 5)
    path = saved.save(tmp_path / "specforge")
    _specforge_layout(path, [1, 3, 4])
    assert tuple(load_drafter(path).config.aux_layer_ids) == (2, 4, 5)
    target = Target(build_tiny_model("llama", seed=0, dtype=torch.float64))  # its own: the load may move its layers
    loaded = load_drafter(path, target)
    assert tuple(loaded.config.aux_layer_ids) == (2, 4, 5) and tuple(target.aux_layers) == (2, 4, 5)
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, atol=0, rtol=0, msg=name)
