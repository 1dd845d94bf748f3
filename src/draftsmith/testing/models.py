"""Tiny random targets and a corpus they learn in a minute: fixtures for tests, imported by nothing else.

Every architecture the project claims to support has a tiny random instance here, small enough that the
whole pipeline runs on one in seconds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# --- tiny random targets for tests and the tiny demo preset -----------------------------------------
_TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_ARCHITECTURES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "deepseek_v3", "mixtral",
    "gemma3_wrapper", "kimi_k25_wrapper",
)

#: Targets that keep a recurrent state in most layers (gated delta-net, Mamba-2, short convolutions) and attention
#: in every fourth: the layer pattern follows ``num_hidden_layers``, so an override keeps the mix.
HYBRID_ARCHITECTURES = ("qwen3_next", "lfm2", "granitemoehybrid", "nemotron_h", "qwen3_5_text", "falcon_h1", "jamba",
                        "bamba", "kimi_linear")


def _hybrid_extra(arch: str, layers: int) -> dict:
    """The recurrent fields of a tiny ``arch``: attention at every fourth layer (the last of each four)."""
    attention = [i % 4 == 3 for i in range(layers)]
    if arch in ("qwen3_next", "qwen3_5_text"):
        extra = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4,
                     layer_types=["full_attention" if a else "linear_attention" for a in attention])
        if arch == "qwen3_next":  # gated delta-net + a sparse MoE in every layer, as the released model
            extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, decoder_sparse_step=1)
        return extra
    if arch == "lfm2":  # short convolutions
        return dict(layer_types=["full_attention" if a else "conv" for a in attention], conv_L_cache=3,
                    block_ff_dim=128, block_auto_adjust_ff_dim=False)
    mamba = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16)
    if arch == "granitemoehybrid":  # Granite-4: Mamba-2 layers, a shared MLP, no routed experts
        return dict(mamba, layer_types=["attention" if a else "mamba" for a in attention], mamba_expand=2,
                    num_local_experts=0, shared_intermediate_size=128)
    if arch == "bamba":
        return dict(mamba, attn_layer_indices=[i for i, a in enumerate(attention) if a], mamba_expand=2)
    if arch == "nemotron_h":  # Mamba-2, attention and MLP-only blocks
        pattern = "".join("*" if a else ("-" if i % 4 == 1 else "M") for i, a in enumerate(attention))
        return dict(hybrid_override_pattern=pattern, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16,
                    n_groups=1, chunk_size=16, expand=2, head_dim=16)
    if arch == "falcon_h1":  # attention and Mamba-2 side by side in every layer
        return dict(mamba, mamba_d_ssm=64, mamba_d_head=16, head_dim=16)
    if arch == "kimi_linear":  # Kimi Delta Attention (1-based layer lists), MLA attention, MoE after one dense layer
        return dict(head_dim=16, num_key_value_heads=4, linear_attn_config={
            "kda_layers": [i + 1 for i, a in enumerate(attention) if not a],
            "full_attn_layers": [i + 1 for i, a in enumerate(attention) if a], "head_dim": 16, "num_heads": 4,
            "short_conv_kernel_size": 4}, num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
            first_k_dense_replace=1, num_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, mla_use_nope=True)
    if arch == "jamba":  # Mamba-1 and attention, MoE every other layer
        return dict(attn_layer_period=4, attn_layer_offset=3, expert_layer_period=2, expert_layer_offset=1,
                    num_experts=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2)
    raise ValueError(f"unknown hybrid architecture {arch!r}; expected one of {HYBRID_ARCHITECTURES}")


def tiny_config(arch: str, **overrides):
    """A config with the real structure of ``arch`` at toy sizes (MoE, MLA, wrappers included)."""
    from transformers import AutoConfig

    common = dict(_TINY_COMMON)
    extra: dict = {}
    if arch == "qwen3":
        extra = dict(head_dim=16)
    elif arch in ("gemma2", "gemma3_text"):
        extra = dict(head_dim=16, sliding_window=64, query_pre_attn_scalar=16)
        if arch == "gemma2":
            extra.update(final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    elif arch == "phi3":
        extra = dict(num_key_value_heads=4, pad_token_id=0)
    elif arch == "mixtral":
        extra = dict(num_local_experts=4, num_experts_per_tok=2)
    elif arch == "deepseek_v3":
        extra = dict(
            num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_interleave=True,
        )
    if arch == "gemma3_wrapper":
        text = tiny_config("gemma3_text", **overrides).to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=28, patch_size=14)
        return AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=255, boi_token_index=253, eoi_token_index=254)
    if arch == "kimi_k25_wrapper":
        text = tiny_config("deepseek_v3", **overrides).to_dict()
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      patch_size=14, pos_emb_height=4, pos_emb_width=4)
        return AutoConfig.for_model("kimi_k25", text_config=text, vision_config=vision,
                                    projection_hidden_size=32, media_placeholder_token_id=255,
                                    image_token_id=255, video_token_id=254, vision_start_token_id=252,
                                    vision_end_token_id=253)
    if arch in HYBRID_ARCHITECTURES:
        extra = _hybrid_extra(arch, int(overrides.get("num_hidden_layers", common["num_hidden_layers"])))
    model_type = {"gemma3_text": "gemma3_text"}.get(arch, arch)
    common.update(extra)
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def build_tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, head_scale: float = 24.0,
                     **overrides):
    """A randomly initialised tiny model of ``arch`` (deterministic for a seed)."""
    import transformers

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    auto = "AutoModelForImageTextToText" if arch.endswith("_wrapper") else "AutoModelForCausalLM"
    cls = getattr(transformers, auto)
    kwargs = {}
    if dtype == torch.float64 and hasattr(config, "_experts_implementation"):
        # grouped_mm MoE kernels take no float64; the per-expert loop does (tests run tiny models in fp64).
        kwargs["experts_implementation"] = "eager"
    model = cls.from_config(config, dtype=dtype, **kwargs)
    # Random init gives near-uniform next-token distributions (max prob ~1%); scale the head so they are
    # peaked like a trained LM's (max prob ~0.4, entropy ~2.5 nats), which is what drafters learn from.
    head = model.get_output_embeddings()
    if head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr():  # wrappers tie by default
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        for cfg in (model.config, getattr(model.config, "text_config", None)):
            if cfg is not None:
                cfg.tie_word_embeddings = False
    with torch.no_grad():
        head.weight.mul_(head_scale)
    return model.eval()


def save_tiny_target(path: str | Path, arch: str = "llama", style: str = "chatml", *, seed: int = 0,
                     **overrides) -> Path:
    """A tiny random ``arch`` model with a real-template tokenizer, saved as a local model directory."""
    from draftsmith.testing.tokenizer import make_tokenizer

    tok = make_tokenizer(style)
    kw = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id or 0, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id or 0)
    kw.update(overrides)
    model = build_tiny_model(arch, seed=seed, **kw)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# --- the seed's case: DeepSeek-V3 / Kimi-K2 structured tiny targets ---------------------------------------
DEEPSEEK_VARIANTS = ("deepseek_v3", "kimi_k2", "kimi_k25_wrapper")

# vLLM's CPU MLA decode kernel (csrc/cpu/mla_decode.cpp) is compiled for one latent cache width only,
# kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 (the real DeepSeek-V3 / Kimi-K2 values).
VLLM_CPU_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


def tiny_deepseek_kwargs(vllm_cpu: bool = True) -> dict:
    """Config fields of a tiny DeepSeek-V3 with every structural feature of the real one.

    Routed + shared experts behind a sigmoid router with a correction bias and group-limited top-k,
    ``first_k_dense_replace`` dense layers first, MLA (``q_lora_rank``, ``kv_lora_rank``, rope/nope head
    dims, interleaved rope), YaRN rope with mscale (as in the real config, max positions = factor x original),
    and the router fields vLLM's loader reads from config.json (transformers' router ignores them: it is
    always sigmoid + correction bias). ``vllm_cpu`` sets the MLA latent sizes vLLM's CPU kernels accept.
    """
    kw = dict(
        num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, topk_method="noaux_tc", scoring_func="sigmoid",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=40 * 4096,
    )
    if vllm_cpu:
        kw.update(VLLM_CPU_MLA)
    return kw


def save_tiny_deepseek_target(path: str | Path, variant: str = "deepseek_v3", *, seed: int = 0, vllm_cpu: bool = True,
                              router_bias_std: float = 0.05, train_steps: int = 0, **overrides) -> Path:
    """A tiny DeepSeek-V3-structured target saved as a local model directory with the DeepSeek-V3 tokenizer.

    ``variant``: ``deepseek_v3`` (``DeepseekV3ForCausalLM``); ``kimi_k2`` (the same model and weights for a
    seed, config.json says ``model_type: kimi_k2`` as Kimi-K2's does; vLLM maps it to DeepSeek-V3, transformers
    does not know it); ``kimi_k25_wrapper`` (a Kimi-K2.5-style multimodal wrapper: the text model nested under
    ``text_config`` with ``model_type: kimi_k2``, a tiny vision tower, ``media_placeholder_token_id`` and no
    ``image_token_index``). The router's ``e_score_correction_bias`` is random (std ``router_bias_std``), not
    zero, so that expert selection depends on it as in the released checkpoints.

    Random weights decode greedily into one repeated token after a few steps (nothing for a drafter to
    learn); ``train_steps`` > 0 first fits the model for that many steps to ``tiny_chat_corpus``
    conversations (about 0.25 s a step on one CPU thread), after which its greedy answers vary with the prompt.
    """
    import json

    from draftsmith.testing.tokenizer import make_tokenizer

    if variant not in DEEPSEEK_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {DEEPSEEK_VARIANTS}")
    tok = make_tokenizer("deepseek_v3")
    kw = tiny_deepseek_kwargs(vllm_cpu)
    kw.update(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    kw.update(overrides)
    model = build_tiny_model("kimi_k25_wrapper" if variant == "kimi_k25_wrapper" else "deepseek_v3", seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float32) * router_bias_std)
    if train_steps > 0:
        fit_tiny_chat_model(model, tok, train_steps, seed=seed)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    if variant == "kimi_k2":
        config["model_type"] = "kimi_k2"
    elif variant == "kimi_k25_wrapper":
        config["architectures"] = ["KimiK25ForConditionalGeneration"]  # the released checkpoint's name
        config["text_config"]["model_type"] = "kimi_k2"
        config["text_config"]["architectures"] = ["DeepseekV3ForCausalLM"]
        config.pop("image_token_index", None)
        config["text_config"].pop("image_token_index", None)
        config.setdefault("media_placeholder_token_id", config.get("image_token_id"))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def as_kimi_k2(src: str | Path, dst: str | Path) -> Path:
    """A copy of a tiny DeepSeek-V3 target directory whose config.json says ``model_type: kimi_k2``, as
    Kimi-K2's does (same weights, so a drafter made for one serves the other)."""
    import json

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


# --- a corpus a tiny model learns in a minute ------------------------------------------------------------
def _chain_words() -> tuple[list[str], dict[str, list[str]]]:
    import random

    from draftsmith.testing.tokenizer import _CORPUS

    words = sorted({w.strip(".,!?;:()").lower() for s in _CORPUS for w in s.split()} - {""})
    rng = random.Random(1234)  # the chain is fixed; conversations are sampled from it with a seed
    return words, {w: rng.sample(words, 3) for w in words}


def tiny_chat_corpus(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n`` conversations from a fixed word-level Markov chain: the user turn is 2-5 words, the answer
    starts with the question's last word and follows the chain (successors weighted 0.6/0.3/0.1) for
    10-20 words. Real branching, so a model fitted to it has a genuine next-token distribution."""
    import random

    words, succ = _chain_words()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question = rng.sample(words, rng.randint(2, 5))
        answer = [question[-1]]
        for _ in range(rng.randint(10, 20) - 1):
            answer.append(rng.choices(succ[answer[-1]], weights=[0.6, 0.3, 0.1])[0])
        out.append([{"role": "user", "content": " ".join(question)},
                    {"role": "assistant", "content": " ".join(answer) + "."}])
    return out


def fit_tiny_chat_model(model, tokenizer, steps: int, *, seed: int = 0, lr: float = 2e-3, batch_size: int = 16):
    """Fit ``model`` (next-token loss on every token) to chat-templated ``tiny_chat_corpus`` conversations."""
    convs = tiny_chat_corpus(batch_size * steps, seed=10_000 + seed)
    seqs = [tokenizer(tokenizer.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]
            for c in convs]
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id or 0
    model.train()
    for step in range(steps):
        batch = seqs[step * batch_size:(step + 1) * batch_size]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), pad)
        labels = torch.full((len(batch), width), -100)
        for i, s in enumerate(batch):
            ids[i, :len(s)] = torch.tensor(s)
            labels[i, :len(s)] = torch.tensor(s)
        loss = model(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return model.eval()
