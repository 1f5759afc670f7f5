"""The model being trained: a Qwen3.5-architecture causal LM (GDN and full-attention
layers at 3:1) plus its multi-token-prediction head, in training form.

Sizes (:data:`SIZES`) are chosen for what they ship as: ``default`` fits the issue's
16 MB budget in bf16 with the MTP head and a 4096-token tokenizer (the test
``test_default_size_fits_budget`` checks it), ``small`` is a draft model for the
draft-model drafter (same tokenizer), ``tiny`` is for tests and quick CPU checks.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch.nn import functional as F

# Per preset: the fields of ``tiny_config`` that differ from its defaults. GDN heads keep
# Qwen3.5's ratio (two value heads per key head, K = V).
SIZES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16),
    "small": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=32, linear_value_head_dim=32),
    "default": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=64, linear_value_head_dim=64),
}
#: The issue's budget for the shipped default checkpoint (safetensors + tokenizer files).
DEFAULT_BUDGET_BYTES = 16 * 10**6


def train_config(size: str, vocab_size: int, eos_token_id: int, *, max_position_embeddings: int = 8192):
    """The ``Qwen3_5TextConfig`` of preset ``size``: every fourth layer full attention
    (``tiny_config``'s layer pattern), tied input and output embeddings (at these
    sizes an untied LM head would be a fifth of the parameters), SDPA attention (its
    causal path needs no mask tensor, which the MTP head's training forward relies on)."""
    from ..engine.random_model import tiny_config

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    cfg = tiny_config("qwen3_5", vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=None,
                      tie_word_embeddings=True, initializer_range=0.02,
                      max_position_embeddings=max_position_embeddings, **SIZES[size])
    cfg._attn_implementation = "sdpa"
    return cfg


def gdn_kernel_path(device: torch.device) -> str:
    """Which GDN kernel the HF layers run in training, in words.

    transformers binds ``chunk_gated_delta_rule`` when its modeling module is imported:
    to fla-core's chunked Triton kernel when ``fla`` is importable, else to its own
    reference PyTorch code. The Triton kernel needs CUDA, so fla on a CPU run is an
    error rather than a silent fallback (raises ``ValueError``).
    """
    has_fla = importlib.util.find_spec("fla") is not None
    if has_fla:
        if device.type != "cuda":
            raise ValueError("fla (flash-linear-attention) is importable, so transformers routes the GDN layers to "
                             "its Triton kernels, which need CUDA; train on a CUDA device or uninstall fla")
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("fla-core")
        except PackageNotFoundError:
            ver = "unknown version"
        refusal = fla_backward_refusal(device)
        if refusal:
            raise ValueError(f"fla-core {ver} cannot train here: {refusal}; uninstall fla to train on "
                             "transformers' reference path (what the shipped model was trained with)")
        return f"fla-core chunk_gated_delta_rule ({ver})"
    return "transformers' reference PyTorch chunk_gated_delta_rule (fla not importable)"


def fla_backward_refusal(device: torch.device) -> str | None:
    """Why fla-core's chunked GDN backward will refuse to run on ``device``, or ``None``.

    fla-core 0.6 raises inside the first backward pass on Hopper GPUs with Triton
    >= 3.4, < 3.7.1 (its gated ``chunk_bwd_dqkwg`` computes wrong gradients there, fla
    issue #640). Asking fla's own flags up front turns a crash after data preparation
    into an error before it.
    """
    if importlib.util.find_spec("tilelang") is not None:  # fla then runs that backward through TileLang
        return None
    try:
        from fla.utils import env, hardware
    except ImportError:  # an fla without these modules predates the check
        return None
    hopper = getattr(hardware, "IS_NVIDIA_HOPPER", False)
    bad_triton = getattr(env, "TRITON_ABOVE_3_4_0", False) and not getattr(env, "TRITON_ABOVE_3_7_1", True)
    if device.type == "cuda" and hopper and bad_triton:
        import triton

        return (f"its GDN backward refuses Hopper GPUs under Triton {triton.__version__} (wrong gradients "
                "with Triton >= 3.4, < 3.7.1, fla issue #640)")
    return None


def build_model(size: str, vocab_size: int, eos_token_id: int, *, seed: int):
    """A freshly initialised ``Qwen3_5ForCausalLM`` and its MTP head (float32, CPU,
    train mode). ``seed`` alone decides the weights; the global RNG is left as it was."""
    from transformers import Qwen3_5ForCausalLM

    from ..engine.drafters import MTPHead

    config = train_config(size, vocab_size, eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config)
        text = model.model
        head = MTPHead(text.config, type(text.layers[0]), type(text.norm), moe=False)
        # The head is a plain nn.Module: give its projections the model's init (HF's
        # normal(0, initializer_range)); its (1 + w) norms start at zero like the model's.
        for name, p in head.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.zero_()
                elif p.ndim >= 2:
                    p.normal_(0.0, config.initializer_range)
    return model.train(), head.train()


def mtp_forward(model, head, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The MTP head over a batch, in training form: what
    :meth:`~replayssm.engine.drafters.MTPHead.forward_layer` computes at inference, with
    HF's causal attention instead of the engine's KV cache.

    Args:
        model: the ``Qwen3_5ForCausalLM`` (embedding, rotary embedding and LM head are
            shared with the head).
        head: the :class:`~replayssm.engine.drafters.MTPHead`.
        hidden: ``[B, T, hidden]`` the model's final-norm hidden states ``h_t``.
        next_tokens: ``[B, T]`` the tokens ``x_{t+1}``.

    Returns:
        ``[B, T, vocab]`` logits for the tokens ``x_{t+2}``; the pair
        ``(h_t, x_{t+1})`` sits at rotary position ``t``, as in the engine.
    """
    text = model.model
    e = head.pre_fc_norm_embedding(text.embed_tokens(next_tokens))
    x = head.fc(torch.cat([e, head.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1))
    b, t = next_tokens.shape
    positions = torch.arange(t, device=x.device)[None].expand(b, t)
    # Qwen3.5's rotary embedding is multimodal: transformers 5.17 wants one position
    # grid per section ([3, B, T]); text tokens sit at the same position on each.
    grids = positions[None].expand(3, b, t) if hasattr(text.rotary_emb, "mrope_section") else positions
    cos_sin = text.rotary_emb(x, grids)
    x = head.layers[0](x, position_embeddings=cos_sin, attention_mask=None, position_ids=positions)
    return model.lm_head(head.norm(x))


def losses(model, head, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token and MTP cross-entropy (nats per token) of ``window [B, T + 1]``
    (int64): the model reads ``window[:, :T]`` and predicts ``window[:, 1:]``; the head
    reads ``(h_t, x_{t+1})`` for ``t < T - 1`` and predicts ``x_{t+2}``."""
    x = window[:, :-1]
    h = model.model(input_ids=x).last_hidden_state  # [B, T, hidden], after the final norm
    logits = model.lm_head(h)
    main = F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
    mtp_logits = mtp_forward(model, head, h[:, :-1], window[:, 1:-1])
    mtp = F.cross_entropy(mtp_logits.flatten(0, 1).float(), window[:, 2:].flatten())
    return main, mtp


def mtp_checkpoint_state(head: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's weights in the Qwen3.5 checkpoint layout: ``mtp.`` + the head's
    parameter names (dense MLP: no expert splitting), in ``dtype``, on the CPU."""
    return {f"mtp.{k}": v.detach().to("cpu", dtype).contiguous() for k, v in head.state_dict().items()}


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters (a tied embedding counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
