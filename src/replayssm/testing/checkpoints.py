"""Checkpoint directories of random-weight models, for tests and examples.

:func:`save_tiny_checkpoint` writes what :func:`replayssm.engine.loading.load_model`
reads (config, safetensors, a byte-level tokenizer, generation config; optionally
``mtp.*`` weights), with the weights of
:func:`replayssm.engine.random_model.build_tiny_model`.
"""

from __future__ import annotations

import os

from ..engine.random_model import CHAT_TEMPLATE, build_tiny_model, random_mtp_state

#: The byte-level tokenizer's end of text (id 256, the random configs' ``eos_token_id``).
EOS_TOKEN = "<|endoftext|>"


def tiny_tokenizer():
    """A byte-level tokenizer: ids 0..255 are bytes, 256 is ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def save_tiny_checkpoint(path: str | os.PathLike, family: str = "qwen3_5", *, seed: int = 0,
                         with_mtp: bool = False, **overrides):
    """Write a local checkpoint directory (config, safetensors, tokenizer, generation
    config; ``mtp.*`` tensors added to the weights file when ``with_mtp``). Returns the
    model it saved."""
    from safetensors.torch import load_file, save_file

    path = os.fspath(path)
    model = build_tiny_model(family, seed=seed, **overrides)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    if with_mtp:
        weights = os.path.join(path, "model.safetensors")
        index = os.path.join(path, "model.safetensors.index.json")
        if not os.path.exists(weights) or os.path.exists(index):
            raise RuntimeError("expected a single model.safetensors file")
        state = load_file(weights)
        state.update(random_mtp_state(model, seed=seed + 7))
        save_file(state, weights, metadata={"format": "pt"})
    return model
