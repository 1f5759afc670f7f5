"""Training a small Qwen3.5-architecture model, with its MTP head, on the running
Python's standard library (``replayssm train``, :mod:`replayssm.cli.train`).

:func:`replayssm.train.run.run_training` of a :class:`~replayssm.train.run.TrainConfig`
writes an HF checkpoint directory that :func:`replayssm.engine.loading.load_model`,
:func:`~replayssm.engine.loading.load_tokenizer` and
:func:`replayssm.engine.drafters.load_mtp_head` read (``config.json``,
``model.safetensors`` with the ``mtp.*`` tensors, tokenizer files,
``generation_config.json``), plus ``train_log.json`` (losses, held-out losses, tokens,
wall time, device) and ``loss.png`` beside them.

The package, by role: :mod:`.data` (the tokenizer; the text and its split are :mod:`replayssm.corpus`),
:mod:`.model` (size presets, the MTP head's training forward, the losses), :mod:`.run`
(the loop, evaluation, checkpoint, plot).
"""
