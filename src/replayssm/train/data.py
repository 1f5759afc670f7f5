"""Training text for ``replayssm train``: the standard library's training side
(:mod:`replayssm.corpus`) and a tokenizer trained on it.
"""

from __future__ import annotations

from ..corpus import EOS_TOKEN, SourceFile

#: Special tokens of the trained tokenizer, in id order (ids 0, 1).
SPECIAL_TOKENS = (EOS_TOKEN, "<|pad|>")


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer with ``vocab_size`` tokens trained on ``texts``, as a
    ``PreTrainedTokenizerFast`` (ids 0 and 1: ``<|endoftext|>`` and ``<|pad|>``; then
    the 256 bytes; then the merges). Byte-level, so any text encodes (no unknown
    token), and the merges spend the vocabulary on what code repeats: indentation runs,
    keywords, ``self.``, common identifiers.

    Deterministic for the same texts and vocabulary size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ..engine.random_model import CHAT_TEMPLATE

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # No regex split on spaces beyond GPT-2's: runs of indentation become tokens of
    # their own, which is most of what Python's whitespace costs.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=SPECIAL_TOKENS[1])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def bytes_per_token(tokenizer, files: list[SourceFile]) -> float:
    """UTF-8 bytes of ``files`` per token (end-of-text tokens not counted)."""
    n_bytes = sum(len(f.text.encode()) for f in files)
    n_tok = sum(len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch([f.text for f in files],
                                                                             add_special_tokens=False))
    return n_bytes / max(1, n_tok)
