"""What several commands share: checking a ``--model`` option, the request checks that
must come before a model is loaded, the memory line and the ``--json``/``--plot``
outputs."""

from __future__ import annotations


def check_model(option: str, value: str, *, tokenizer: bool = True) -> str:
    """The checkpoint directory that ``--option value`` names (``embedded`` and
    ``embedded-draft`` are the shipped ones), after
    :func:`replayssm.engine.loading.check_model_dir`; ``ValueError`` naming the option."""
    from ..engine.loading import check_model_dir, resolve_model_path

    try:
        return check_model_dir(resolve_model_path(value), tokenizer=tokenizer)
    except ValueError as e:
        raise ValueError(f"{option}: {e}") from None


def check_same_tokenizer(option: str, draft_dir: str, model_dir: str) -> None:
    """``ValueError`` unless the draft model's tokenizer is the target's."""
    from ..engine.loading import load_tokenizer

    if load_tokenizer(draft_dir).get_vocab() != load_tokenizer(model_dir).get_vocab():
        raise ValueError(f"{option} {draft_dir!r} does not share the target's tokenizer")


def check_mtp(option: str, model_dir: str) -> None:
    from ..engine.loading import has_mtp_weights

    if not has_mtp_weights(model_dir):
        raise ValueError(f"{option}: {model_dir!r} has no mtp.* weights (this checkpoint carries no MTP head)")


def check_lengths(model_dir: str, prompts: list[list[int]], max_new_tokens: int, *, num_draft: int, dtype: str,
                  device: str, option: str = "--max-new-tokens") -> int:
    """Check requests against the model before it is loaded: the longest prompt plus
    ``max_new_tokens`` within the model's ``max_position_embeddings``, and the KV cache
    the engine will allocate for them within the device's free memory. Returns the
    engine's ``max_len``; ``ValueError`` naming ``option``."""
    from ..engine.factory import engine_max_len
    from ..engine.kv_cache import check_kv_cache_fits
    from ..engine.loading import attention_geometry, read_config, resolve_device, resolve_dtype, text_config

    config = read_config(model_dir)
    longest = max(len(p) for p in prompts)
    limit = text_config(config).get("max_position_embeddings")
    if isinstance(limit, int) and longest + max_new_tokens > limit:
        raise ValueError(f"{option} {max_new_tokens}: the longest prompt ({longest} tokens) + {max_new_tokens} new "
                         f"tokens exceed the model's max_position_embeddings {limit}")
    max_len = engine_max_len(longest, max_new_tokens, num_draft)
    dev = resolve_device(device)
    layers, kv_heads, head_dim = attention_geometry(config)
    try:
        check_kv_cache_fits(layers, len(prompts), kv_heads, head_dim, max_len, resolve_dtype(dtype, dev), dev)
    except ValueError as e:
        raise ValueError(f"{option} {max_new_tokens}: {e}") from None
    return max_len


def check_plot(path) -> None:
    """``--plot`` needs matplotlib: say so before the run rather than after it."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'replayssm[plot]')") from None


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def describe_memory(engine) -> str:
    """One line: the GDN state pool by part and the KV cache of ``engine``."""
    nb = engine.state_nbytes()
    pool = nb["total"]
    scratch = pool - nb["checkpoints"] - nb["conv_state"]
    return (f"GDN state pool {_mib(pool)} (checkpoints {_mib(nb['checkpoints'])}, conv {_mib(nb['conv_state'])}, "
            f"{engine.strategy_name} buffers {_mib(scratch)}) for {engine.pool.num_slots} slot(s); "
            f"KV cache {_mib(nb['kv_cache'])}")


def write_outputs(result: dict, json_path, plot_path, plot: str) -> None:
    """The ``--json`` / ``--plot`` outputs of a command: ``result`` as JSON, and a PNG
    drawn by ``replayssm.bench.plotting.<plot>(result, path)``; each path is printed."""
    from ..progress import write_json

    if json_path is not None:
        write_json(json_path, result)
        print(f"wrote {json_path}")
    if plot_path is not None:
        from ..bench import plotting

        getattr(plotting, plot)(result, plot_path)
        print(f"wrote {plot_path}")


def config_from(cls, args, **values):
    """A dataclass ``cls`` from the parsed options of the same names (``values``
    replace or add fields)."""
    from dataclasses import fields

    names = {f.name for f in fields(cls)}
    return cls(**{**{n: getattr(args, n) for n in names if hasattr(args, n)}, **values})


def check_triton_window(option: str, window: int, *, backend: str, device, strategies) -> None:
    """``ValueError`` when ``circular`` would run on the Triton backend with a window
    longer than its window kernel takes, found here rather than at the first verify."""
    import torch

    from ..ops.chunked import MAX_WINDOW_TRITON
    from ..ops.dispatch import resolve

    if "circular" in strategies and window > MAX_WINDOW_TRITON and resolve(backend, torch.device(device)) == "triton":
        raise ValueError(f"{option} {window}: circular's Triton window kernel takes windows of at most "
                         f"{MAX_WINDOW_TRITON} tokens (use --backend reference, or leave circular out)")


def add_model_options(parser, *, draft_use: str) -> None:
    """``--model`` (default the shipped checkpoint) and ``--draft-model`` (default its
    shipped draft model), ``draft_use`` saying what the draft model is for."""
    parser.add_argument("--model", default="embedded",
                        help="checkpoint directory, or 'embedded' (the trained model in the package; default)")
    parser.add_argument("--draft-model", default="embedded-draft",
                        help=f"draft model for {draft_use} (default 'embedded-draft', shipped beside the model)")
