"""Model inputs of a drift run: one GDN layer of a trained model, teacher-forced over
held-out standard-library text (``--inputs model``, the default).

The layer's inputs (``q, k, v`` after the causal conv and its activation, raw gates
``a, b``) are what the model computes for real text: the engine runs the whole model
over each request's stretch of the held-out stream and its
:attr:`~replayssm.engine.adapter.HybridEngine.gdn_inputs_hook` records the chosen layer.
The drift run then drives its own copy of that layer (the strategies, the plain
recurrence, the oracle) over these inputs with random windows and acceptance.
"""

from __future__ import annotations

import json
import os
import time

import torch

from ...state import GDNShape

#: Tokens each request's stretch is recorded by per engine step: a step's memory is
#: ``requests x CHUNK`` hidden states, its host cost (the reference recurrence loops over
#: tokens in Python) the same whatever the chunk.
CHUNK = 1024
#: Longest context the model reads a stretch in. The stretch is read as consecutive
#: prompts of at most this many tokens (and at most the model's
#: ``max_position_embeddings``): positions past what the model declares are not inputs
#: it would see in use, and attention over the context costs its square. Only the model
#: restarts at a context's end; the drift run's layer goes on through the whole stretch.
MAX_CONTEXT = 8192


def _text_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as fh:
        cfg = json.load(fh)
    return cfg.get("text_config", cfg)


def gdn_layer_count(model_dir: str) -> int | None:
    """GDN (``linear_attention``) layers of the checkpoint at ``model_dir``, from its
    ``config.json``'s ``layer_types`` (``None`` when the config does not list them)."""
    types = _text_config(model_dir).get("layer_types")
    return None if types is None else sum(t == "linear_attention" for t in types)


class ModelInputStream:
    """The inputs of GDN layer ``layer`` of the model at ``model_dir`` over held-out text,
    served in windows of ``B = requests`` requests.

    ``layer`` counts among the GDN layers (``None``: the last, the one that reads the
    output of every layer below it). Request ``i`` reads its own contiguous stretch of ``stream`` (default
    :func:`replayssm.corpus.heldout_stream`), from token ``i * len(stream) // B`` on, wrapping around at
    the end, in contexts of at most :data:`MAX_CONTEXT` tokens. The model runs in
    float32 (on ``device``, the reference ops on the CPU), whatever ``act_dtype``; the
    layer's inputs are recorded once per token, rounded to ``act_dtype``, up to a
    :data:`CHUNK` ahead of where a request's window needs them (so memory stays at a
    chunk per request however long the run; ``stream`` and ``chunk`` / ``max_context``
    are for tests).

    Each request has a cursor (its committed tokens): :meth:`window_inputs` returns the
    ``T`` tokens from every cursor, :meth:`accept` moves each cursor past the tokens its
    request accepted, so the rejected ones open the next window again, as in
    speculative decoding.

    Attributes:
        shape: the layer's :class:`GDNShape`.
        params: the layer's ``A_log``, ``dt_bias`` ``[HV]``, ``conv_weight [C, W]``
            (float32, on the CPU) for :meth:`StatePool.set_layer_params`.
        info: what the inputs are, for the report (the model as given, the layer, the
            text, the stretches' starts and the context length).
    """

    def __init__(self, model_dir: str, layer: int | None, requests: int, window: int, act_dtype, device, *,
                 model_name: str | None = None, stream: torch.Tensor | None = None, chunk: int = CHUNK,
                 max_context: int = MAX_CONTEXT):
        from ...engine.adapter import HybridEngine
        from ...engine.loading import load_model, load_tokenizer
        from ...corpus import heldout_stream

        self.device = torch.device(device)
        self.B, self.T, self.act_dtype, self.chunk = requests, window, act_dtype, chunk
        model = load_model(model_dir, dtype=torch.float32, device=str(self.device))
        self.context = min(max_context, int(getattr(model.config, "max_position_embeddings", max_context)))
        text = "held-out standard-library files (5%), joined by end-of-text"
        if stream is None:
            stream = heldout_stream(load_tokenizer(model_dir))
        else:
            text = "the given token stream"
        if stream.ndim != 1 or stream.numel() < 2:
            raise ValueError(f"stream must be a 1-D token tensor of at least 2 tokens, got shape {tuple(stream.shape)}")
        self.stream = stream.long().cpu()
        # Window 1: the engine only ever prefills (plain decoding of known text).
        self.engine = HybridEngine(model, strategy="fold", num_slots=requests, window=1, max_len=self.context,
                                   prefill="recurrence")
        gdn = len(self.engine.mixers)
        if layer is None:
            layer = gdn - 1
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < gdn:
            raise ValueError(f"layer must be a GDN layer index in [0, {gdn}), got {layer!r}")
        self.layer = layer
        self.engine.gdn_inputs_hook = self._record
        self.shape: GDNShape = self.engine.shape
        mod = self.engine.mixers[layer].module
        self.params = {"A_log": mod.A_log.detach().float().cpu(), "dt_bias": mod.dt_bias.detach().float().cpu(),
                       "conv_weight": mod.conv1d.weight.detach().float().reshape(self.shape.conv_dim, -1).cpu()}

        n = self.stream.numel()
        self.starts = [i * n // requests for i in range(requests)]
        self.read = [0] * requests  # tokens of each stretch the model has read
        self.slots = [self.engine.alloc() for _ in range(requests)]
        s = self.shape
        self._sizes = [s.num_heads * s.head_k_dim] * 2 + [s.num_value_heads * s.head_v_dim] + [s.num_value_heads] * 2
        # Per request, the recorded inputs packed as [tokens, q | k | v | a | b], from its
        # stretch's token base[i] on (what lies behind the cursor is dropped).
        self.recorded = [torch.empty(0, sum(self._sizes), dtype=act_dtype, device=self.device) for _ in range(requests)]
        self.base = [0] * requests
        self.cursor = [0] * requests
        self._pending: list[torch.Tensor] | None = None
        self.read_s = 0.0  # seconds spent running the model
        decoder = [i for i, kind in enumerate(self.engine.kinds) if kind == "gdn"][layer]
        self.info = {"kind": "model", "model": model_name if model_name is not None else model_dir, "layer": layer,
                     "decoder_layer": decoder, "gdn_layers": gdn, "text": text, "stream_tokens": n,
                     "stretch_starts": list(self.starts), "context": self.context, "model_dtype": "float32"}

    def _record(self, j, q, k, v, a, b) -> None:
        if j == self.layer:
            self._pending = [t.reshape(t.shape[0], -1).to(self.act_dtype) for t in (q, k, v, a, b)]

    def _read_more(self, rows: list[int]) -> None:
        """The model reads the next tokens of requests ``rows`` (up to a chunk, to the end
        of the current context), in one engine step; their inputs are appended."""
        t0 = time.perf_counter()
        windows = []
        for i in rows:
            pos = self.read[i] % self.context
            if pos == 0 and self.read[i]:  # a new context: fresh state and KV cache
                self.engine.free(self.slots[i])
                self.slots[i] = self.engine.alloc()
            m = min(self.chunk, self.context - pos)
            idx = (self.starts[i] + self.read[i] + torch.arange(m)) % self.stream.numel()
            windows.append(self.stream[idx].tolist())
        self.engine.extend([self.slots[i] for i in rows], windows)
        packed = torch.cat(self._pending, dim=1)  # [sum m, D]; created outside inference mode
        self._pending = None
        off = 0
        for i, w in zip(rows, windows):
            kept = self.recorded[i][self.cursor[i] - self.base[i] :]
            self.recorded[i] = torch.cat([kept, packed[off : off + len(w)]])
            self.base[i] = self.cursor[i]
            self.read[i] += len(w)
            off += len(w)
        self.read_s += time.perf_counter() - t0

    def window_inputs(self) -> dict[str, torch.Tensor]:
        """The layer's inputs of the ``T`` tokens from each request's cursor, in the
        activation dtype: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``a, b [B, T, HV]``."""
        while True:
            short = [i for i in range(self.B) if self.read[i] < self.cursor[i] + self.T]
            if not short:
                break
            self._read_more(short)
        rows = torch.stack([self.recorded[i][c - self.base[i] : c - self.base[i] + self.T]
                            for i, c in enumerate(self.cursor)])
        s, B, T = self.shape, self.B, self.T
        q, k, v, a, b = torch.split(rows, self._sizes, dim=-1)
        return {"q": q.reshape(B, T, s.num_heads, s.head_k_dim), "k": k.reshape(B, T, s.num_heads, s.head_k_dim),
                "v": v.reshape(B, T, s.num_value_heads, s.head_v_dim), "a": a.contiguous(), "b": b.contiguous()}

    def accept(self, k: torch.Tensor, accepted: torch.Tensor) -> None:
        """Move each request's cursor past its ``accepted [B]`` tokens (``k``, the
        window's keys, is unused: the signature of :class:`InputStream`'s)."""
        self.cursor = [c + int(n) for c, n in zip(self.cursor, accepted.tolist())]
