"""Loading local Hugging Face checkpoints (config + safetensors + tokenizer).

Nothing is downloaded: ``model_dir`` must be a directory on disk. Supported model types
are Qwen3.5 (dense and MoE, text-only or the multimodal checkpoint, whose language
model is loaded) and Qwen3-Next.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


#: ``--model`` names of the checkpoints shipped inside the package (package data, see
#: ``replayssm/models/README.md``) -> their directory under ``replayssm/models``: the
#: trained default model (with its MTP head) and the smaller draft model that shares its
#: tokenizer.
EMBEDDED_MODELS = {"embedded": "default", "embedded-draft": "draft"}
EMBEDDED = "embedded"
#: How each shipped checkpoint is made (``replayssm train`` on a GPU; see BENCHMARKS.md).
_TRAIN_COMMANDS = {
    "default": "replayssm train --size default --minutes 4 --out {path}",
    "draft": "replayssm train --size small --tokenizer {default} --minutes 1.5 --out {path}",
}


def embedded_model_dir(name: str = EMBEDDED) -> Path:
    """The directory of the shipped checkpoint ``name`` (``"embedded"``: the default
    model, ``"embedded-draft"``: its draft model). The directory may lack a checkpoint
    in a source tree where none has been trained yet."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"name must be one of {sorted(EMBEDDED_MODELS)}, got {name!r}")
    return Path(__file__).resolve().parent.parent / "models" / EMBEDDED_MODELS[name]


def shipped_model_name(path: str | os.PathLike) -> str:
    """The name (``"embedded"``, ``"embedded-draft"``) of the shipped checkpoint at
    ``path``, or ``path`` as given when it is another directory."""
    here = Path(path).resolve()
    for name in EMBEDDED_MODELS:
        if embedded_model_dir(name).resolve() == here:
            return name
    return os.fspath(path)


def resolve_model_path(name: str | os.PathLike) -> str:
    """A ``--model`` value as a directory: ``"embedded"`` and ``"embedded-draft"`` are
    the shipped checkpoints (``ValueError`` naming the command that creates one when it
    is missing); anything else is returned as given (write ``./embedded`` for a local
    directory of that name)."""
    key = os.fspath(name)
    if key not in EMBEDDED_MODELS:
        return key
    path = embedded_model_dir(key)
    if not (path / "config.json").is_file():
        cmd = _TRAIN_COMMANDS[EMBEDDED_MODELS[key]].format(path=os.fspath(path),
                                                           default=os.fspath(embedded_model_dir(EMBEDDED)))
        raise ValueError(f"the {key} checkpoint is missing: {os.fspath(path)!r} holds no config.json; "
                         f"create it with `{cmd}`")
    return os.fspath(path)


def model_label(path: str | os.PathLike) -> str:
    """How reports name a checkpoint: ``"embedded"`` / ``"embedded-draft"`` for the
    shipped ones (not where the package happens to be installed), else ``path`` as given."""
    resolved = Path(path).resolve()
    return next((name for name in EMBEDDED_MODELS if embedded_model_dir(name) == resolved), os.fspath(path))


def resolve_device(device: str | None) -> torch.device:
    """``None`` / ``"auto"``: CUDA when available, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` / ``"auto"``: bfloat16 on CUDA, float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


#: Files of which a checkpoint must hold at least one: its weights.
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
#: Files of which a checkpoint must hold at least one: its tokenizer's vocabulary
#: (fast tokenizers, SentencePiece models, byte-level BPE vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_device(name: str) -> torch.device:
    """``torch.device(name)``, or a ``ValueError`` saying why it cannot be used here
    (not a device name; CUDA without a CUDA device)."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {name!r} is not a torch device: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but CUDA is not available")
    return dev


def _check_dir(model_dir) -> str:
    model_dir = os.fspath(model_dir)
    if os.path.isfile(model_dir):
        raise ValueError(f"{model_dir!r} is a file; a checkpoint is a directory (config.json, weights, tokenizer files)")
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist (only local checkpoints are supported)")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir!r} has no config.json")
    return model_dir


def read_config(model_dir) -> dict:
    """The checkpoint's ``config.json`` as a dict; ``ValueError`` naming the file when
    it cannot be read or is not a JSON object."""
    path = os.path.join(_check_dir(model_dir), "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def text_config(config: dict) -> dict:
    """The language model's fields of a ``config.json`` dict (multimodal checkpoints
    keep them under ``text_config``)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def attention_geometry(config: dict) -> tuple[int, int, int]:
    """``(full-attention layers, KV heads, head dim)`` of a ``config.json`` dict: the
    dimensions of the model's KV cache, known before any weight is loaded."""
    c = text_config(config)
    layers = c.get("num_hidden_layers", 0)
    types = c.get("layer_types")
    if isinstance(types, list):
        count = types.count("full_attention")
    else:  # released configs without the list: every ``full_attention_interval``-th layer
        every = c.get("full_attention_interval", 4)
        count = sum((i + 1) % every == 0 for i in range(layers))
    heads = c.get("num_attention_heads", 1)
    head_dim = c.get("head_dim") or c.get("hidden_size", heads) // heads
    return count, c.get("num_key_value_heads", heads), head_dim


def model_type(model_dir) -> str:
    return read_config(model_dir).get("model_type", "")


def weight_files(model_dir) -> list[str]:
    """The weight files of a checkpoint directory (names, sorted)."""
    root = Path(model_dir)
    return sorted({p.name for pattern in WEIGHT_GLOBS for p in root.glob(pattern)})


def check_model_dir(model_dir, *, tokenizer: bool = True) -> str:
    """Check what a checkpoint directory must hold before anything is loaded, and
    return it: a readable ``config.json`` of a supported model type, weight files
    and (with ``tokenizer``) tokenizer files whose vocabulary fits the model's.
    ``ValueError`` says what is missing or wrong; nothing is loaded but the tokenizer."""
    config = read_config(model_dir)
    model_dir = os.fspath(model_dir)
    mtype = config.get("model_type", "")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{model_dir!r} holds a {mtype!r} model; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if not weight_files(model_dir):
        raise ValueError(f"{model_dir!r} holds no weights (no {' or '.join(WEIGHT_GLOBS)} file)")
    if tokenizer:
        check_tokenizer(model_dir, config)
    return model_dir


def check_tokenizer(model_dir, config: dict | None = None):
    """The checkpoint's tokenizer, after checking that its files are there and that
    every id it produces indexes the model's embedding (``len(tokenizer) <=
    vocab_size``); ``ValueError`` otherwise."""
    model_dir = os.fspath(model_dir)
    if not any(os.path.isfile(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{model_dir!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)})")
    tok = load_tokenizer(model_dir)
    vocab = text_config(config if config is not None else read_config(model_dir)).get("vocab_size")
    if isinstance(vocab, int) and len(tok) > vocab:
        raise ValueError(f"the tokenizer of {model_dir!r} has {len(tok)} tokens, more than the model's vocabulary "
                         f"of {vocab} (config.json vocab_size): ids from {vocab} on have no embedding")
    return tok


@contextlib.contextmanager
def _transformers_errors_only():
    """transformers logs errors only inside the block."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def has_mtp_weights(model_dir) -> bool:
    """Whether the checkpoint's safetensors hold ``mtp.*`` tensors (keys only: nothing
    is read into memory)."""
    from safetensors import safe_open

    model_dir = os.fspath(model_dir)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            return any(k.startswith("mtp.") for k in json.load(fh).get("weight_map", {}))
    for name in sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")):
        with safe_open(os.path.join(model_dir, name), framework="pt") as fh:
            if any(k.startswith("mtp.") for k in fh.keys()):
                return True
    return False


def load_model(model_dir, *, dtype: str | torch.dtype | None = "auto", device: str | None = "auto"):
    """A Qwen3.5 / Qwen3-Next causal LM from a local directory (or ``"embedded"`` /
    ``"embedded-draft"``, the shipped checkpoints), in eval mode on ``device``.
    ``mtp.*`` weights are left out by transformers; see
    :func:`replayssm.engine.drafters.load_mtp_head`. ``ValueError`` (before any weight
    is read) for a directory :func:`check_model_dir` refuses."""
    from transformers import AutoModelForCausalLM

    model_dir = check_model_dir(resolve_model_path(model_dir), tokenizer=False)
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, dev))
    return model.to(dev).eval()


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer (``"embedded"`` names the shipped checkpoint).

    transformers reads the model's config to load it; that config's warnings (an
    end-of-sequence id past a small vocabulary, say) are left to the model's own load,
    so that a check of the tokenizer that fails says one line (the CLI's errors)."""
    from transformers import AutoTokenizer

    with _transformers_errors_only():
        return AutoTokenizer.from_pretrained(_check_dir(resolve_model_path(model_dir)))


def eos_token_ids(model_dir, tokenizer=None) -> list[int]:
    """End-of-sequence ids: ``generation_config.json``, else ``config.json``, else the
    tokenizer's."""
    model_dir = _check_dir(resolve_model_path(model_dir))
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as fh:
                cfg = json.load(fh)
            value = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))
            if value is not None:
                ids = [value] if isinstance(value, int) else list(value)
                break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return [int(i) for i in ids]
