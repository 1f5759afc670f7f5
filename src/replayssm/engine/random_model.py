"""Random-weight Qwen3.5 / Qwen3-Next models, built in process.

They are the shape benchmarks' models (``bench e2e --random``, ``closed-loop --model
tiny``: timing and rounding need real geometry, not trained weights) and the base
config of ``replayssm train``'s size presets. The trained default model is another
thing: a checkpoint shipped in the package (:data:`replayssm.engine.loading.EMBEDDED`).
Checkpoint directories of random models, with a byte-level tokenizer, are test
fixtures: :mod:`replayssm.testing.checkpoints`.

Random models under greedy decoding fall into short loops after a few dozen tokens,
which is what lets prompt lookup (n-gram drafting) hit on them.
"""

from __future__ import annotations

import torch

FAMILIES = ("qwen3_5", "qwen3_next")
# A plain-text chat template, so that ``generate --chat`` works on tiny checkpoints.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def tiny_config(family: str = "qwen3_5", **overrides):
    """A small config of ``family``: 4 layers (3 GDN + 1 full attention), hidden 64,
    GDN heads ``H=2, HV=4, K=V=16``, vocabulary 260 (bytes + end of text + padding).
    ``overrides`` replace any field (e.g. the GPU benchmark's realistic head shapes)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    kw = dict(
        vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=8192,
        initializer_range=0.05, eos_token_id=256, tie_word_embeddings=False,
    )
    if family == "qwen3_next":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    kw.update(overrides)
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**kw)
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**kw)


def _randomize_gates(model, generator: torch.Generator) -> None:
    """Spread the GDN gate parameters the way trained checkpoints do (HF's init sets
    ``dt_bias = 1``), so decay and write strength vary across heads."""
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
            with torch.no_grad():
                module.dt_bias.copy_(torch.randn(module.dt_bias.shape, generator=generator))


def build_tiny_model(family: str = "qwen3_5", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", embed_std: float | None = 0.4, **overrides):
    """A random-weight ``Qwen3_5ForCausalLM`` / ``Qwen3NextForCausalLM`` in eval mode.

    The global RNG is left untouched; ``seed`` alone decides the weights.
    ``embed_std`` redraws the token embedding with that standard deviation (``None``
    keeps transformers' init). At 0.4, eight times the other weights, the current
    token's embedding outweighs what the layers add to the residual stream, so greedy
    decoding settles into loops within a few dozen tokens (n-gram drafting then hits)
    while the GDN and attention layers still shape every logit.
    """
    config = tiny_config(family, **overrides)
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM as cls
    else:
        from transformers import Qwen3NextForCausalLM as cls
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        g = torch.Generator().manual_seed(seed + 1)
        _randomize_gates(model, g)
        if embed_std is not None:
            emb = model.get_input_embeddings().weight
            with torch.no_grad():
                emb.copy_(embed_std * torch.randn(emb.shape, generator=g))
    return model.to(device=device, dtype=dtype).eval()


def random_mtp_state(model, *, seed: int = 0, moe: bool | None = None) -> dict[str, torch.Tensor]:
    """Random ``mtp.*`` weights for ``model`` in checkpoint layout (MoE experts one by
    one, as released checkpoints store them), keys with the ``mtp.`` prefix."""
    from .adapter import _text_model
    from .drafters import MTPHead

    text = _text_model(model)
    if moe is None:
        moe = getattr(text.config, "num_experts", 0) > 0
    head = MTPHead(text.config, type(text.layers[0]), type(text.norm), moe=moe)
    std = text.config.initializer_range
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in head.state_dict().items():
        if name.endswith("norm.weight"):  # (1 + w) norms: small offsets around 1
            state[name] = 0.1 * torch.randn(p.shape, generator=g)
        else:
            state[name] = std * torch.randn(p.shape, generator=g)
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"mtp.{base}{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"mtp.{base}{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"mtp.{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[f"mtp.{name}"] = t.contiguous()
    return {k: v.to(model.dtype) for k, v in out.items()}
