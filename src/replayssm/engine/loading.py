"""Loading local Hugging Face checkpoints (config + safetensors + tokenizer).

Nothing is downloaded: ``model_dir`` must be a directory on disk. Supported model types
are Qwen3.5 (dense and MoE, text-only or the multimodal checkpoint, whose language
model is loaded) and Qwen3-Next.
"""

from __future__ import annotations

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


def _check_dir(model_dir) -> str:
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"model directory {model_dir!r} does not exist (only local checkpoints are supported)")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ValueError(f"{model_dir!r} has no config.json")
    return model_dir


def model_type(model_dir) -> str:
    with open(os.path.join(_check_dir(model_dir), "config.json")) as fh:
        return json.load(fh).get("model_type", "")


def load_model(model_dir, *, dtype: str | torch.dtype | None = "auto", device: str | None = "auto"):
    """A Qwen3.5 / Qwen3-Next causal LM from a local directory, in eval mode on
    ``device``. ``mtp.*`` weights are left out by transformers; see
    :func:`replayssm.engine.drafters.load_mtp_head`."""
    from transformers import AutoModelForCausalLM

    model_dir = _check_dir(model_dir)
    mtype = model_type(model_dir)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{model_dir!r} holds a {mtype!r} model; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    dev = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, dev))
    return model.to(dev).eval()


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_check_dir(model_dir))


def eos_token_ids(model_dir, tokenizer=None) -> list[int]:
    """End-of-sequence ids: ``generation_config.json``, else ``config.json``, else the
    tokenizer's."""
    model_dir = _check_dir(model_dir)
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
