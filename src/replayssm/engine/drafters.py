"""Drafters: who proposes the tokens a verify step checks.

Every drafter follows the same protocol, driven by :class:`SpeculativeGenerator`:

* ``add(rid, tokens, hidden)`` after the target's prompt prefill: ``tokens`` is the
  prompt plus the first generated token, ``hidden`` the target's final-norm hidden
  states of the prompt tokens ``[P, hidden]``.
* ``propose(rids, counts, sampling, generator)`` before a verify: up to ``counts[i]``
  draft tokens per request, with their draft probabilities when drafts are sampled.
* ``observe(rid, new_tokens, hidden)`` after a commit: the tokens the step emitted
  (accepted drafts + the correction or bonus token) and the target's hidden states at
  the window positions that produced them (one per new token).
* ``remove(rid)`` when a request ends.

Three drafters: :class:`NgramDrafter` (prompt lookup), :class:`MTPDrafter` (the
multi-token-prediction head that Qwen3.5 / Qwen3-Next checkpoints carry as ``mtp.*``)
and :class:`ModelDrafter` (a separate small model sharing the tokenizer).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from .adapter import HybridEngine, attention_forward, mlp_forward
from .kv_cache import KVCache, WindowLayout
from .sampling import SamplingParams, warp_probs


@dataclass
class Draft:
    """Draft tokens for one request; ``q`` is ``[len(tokens), V]`` draft probabilities
    when the tokens were sampled, ``None`` when they are deterministic."""

    tokens: list[int]
    q: torch.Tensor | None = None


def _choose(logits: torch.Tensor, sampling: SamplingParams, generator) -> tuple[list[int], torch.Tensor | None]:
    """Draft tokens from ``[R, V]`` logits: argmax when greedy, else sampled (with q)."""
    if sampling.greedy:
        return logits.argmax(-1).tolist(), None
    q = warp_probs(logits, sampling)
    return torch.multinomial(q, 1, generator=generator)[:, 0].tolist(), q


def _fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary (padding ids never drafted)."""
    v = logits.shape[-1]
    if v == vocab:
        return logits
    if v > vocab:
        return logits[..., :vocab]
    pad = logits.new_full(logits.shape[:-1] + (vocab - v,), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class Drafter:
    """Base class (see the module docstring for the protocol)."""

    name = ""
    #: whether ``add`` / ``observe`` need the target's hidden states
    needs_hidden = False

    def add(self, rid, tokens: list[int], hidden: torch.Tensor | None) -> None:
        raise NotImplementedError

    def propose(self, rids: Sequence, counts: Sequence[int], sampling: SamplingParams, generator) -> list[Draft]:
        raise NotImplementedError

    def observe(self, rid, new_tokens: list[int], hidden: torch.Tensor | None) -> None:
        raise NotImplementedError

    def remove(self, rid) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------- n-gram lookup
class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last ``n``
    tokens (``n`` from ``max_ngram`` down to ``min_ngram``) and propose what followed it.

    The continuation may run into the tokens it proposes itself, so a loop shorter than
    the draft length still fills every draft slot. Drafts are deterministic (``q`` is
    one-hot), which rejection sampling handles.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not isinstance(min_ngram, int) or min_ngram < 1:
            raise ValueError(f"min_ngram must be an int >= 1, got {min_ngram!r}")
        if not isinstance(max_ngram, int) or max_ngram < min_ngram:
            raise ValueError(f"max_ngram must be an int >= min_ngram ({min_ngram}), got {max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: dict = {}

    def add(self, rid, tokens, hidden=None):
        self.history[rid] = list(tokens)

    def observe(self, rid, new_tokens, hidden=None):
        self.history[rid].extend(new_tokens)

    def remove(self, rid):
        self.history.pop(rid, None)

    def lookup(self, seq: list[int], count: int) -> list[int]:
        """Up to ``count`` continuation tokens of ``seq``'s suffix, or ``[]``."""
        n_tok = len(seq)
        if count <= 0:
            return []
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            pattern = seq[n_tok - n :]
            for i in range(n_tok - n - 1, -1, -1):  # latest match first
                if seq[i : i + n] == pattern:
                    out: list[int] = []
                    for j in range(count):
                        idx = i + n + j
                        out.append(seq[idx] if idx < n_tok else out[idx - n_tok])
                    return out
        return []

    def propose(self, rids, counts, sampling, generator):
        return [Draft(self.lookup(self.history[r], c)) for r, c in zip(rids, counts)]


# ---------------------------------------------------------------------- MTP head
class MTPHead(nn.Module):
    """Qwen3.5 / Qwen3-Next multi-token-prediction head.

    ``x = fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))``,
    one full-attention decoder layer of the model's family, then ``norm``; the target's
    LM head turns the result into logits for token ``t + 2``. ``h_t`` is the target's
    final-norm hidden state at position ``t`` (what its LM head reads), and the pair
    ``(h_t, x_{t+1})`` sits at rotary position ``t``. Embedding and LM head are shared
    with the target.
    """

    def __init__(self, config, layer_cls: type, norm_cls: type, *, moe: bool | None = None):
        super().__init__()
        cfg = copy.deepcopy(config)
        hidden = cfg.hidden_size
        cfg.num_hidden_layers = 1
        cfg.layer_types = ["full_attention"]
        if hasattr(cfg, "mlp_only_layers") and moe is not None:
            cfg.mlp_only_layers = [] if moe else [0]
        eps = cfg.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList([layer_cls(cfg, 0)])
        self.norm = norm_cls(hidden, eps=eps)

    @classmethod
    def for_engine(cls, engine: HybridEngine, *, moe: bool | None = None) -> "MTPHead":
        """An (uninitialised) head matching ``engine``'s model family and sizes."""
        head = cls(engine.config, type(engine.layers[0]), type(engine.norm), moe=moe)
        return head.to(device=engine.device, dtype=engine.dtype)

    def pair_input(self, engine: HybridEngine, tokens: torch.Tensor, hidden: torch.Tensor, norm=None) -> torch.Tensor:
        """The layer's input for pairs ``(h_t, x_{t+1})``: ``fc(concat(norm(embed(x)),
        norm(h)))``, ``tokens [N]``, ``hidden [N, H]`` -> ``[N, H]``. ``norm(module, x)``
        replaces the norm modules' calls (default: the modules)."""
        norm = norm or (lambda module, x: module(x))
        e = norm(self.pre_fc_norm_embedding, engine.embed(tokens))
        return self.fc(torch.cat([e, norm(self.pre_fc_norm_hidden, hidden.to(e.dtype))], dim=-1))

    def forward_layer(self, engine: HybridEngine, cache: KVCache, layout: WindowLayout, tokens: torch.Tensor,
                      hidden: torch.Tensor, norm=None) -> torch.Tensor:
        """``[N]`` next tokens and ``[N, hidden]`` previous hidden states -> ``[N, hidden]``
        normed outputs. Writes the window into ``cache`` (lengths unchanged).
        ``norm(module, x)`` replaces the norm modules' calls (default: the modules;
        :meth:`HybridEngine.static_norm` runs each in one fused kernel on CUDA)."""
        norm = norm or (lambda module, x: module(x))
        x = self.pair_input(engine, tokens, hidden, norm)
        cos, sin = engine.rotary_cos_sin(x, layout.positions)
        layer = self.layers[0]
        r = x
        x = r + attention_forward(layer.self_attn, norm(layer.input_layernorm, x), cos, sin, cache, 0, layout, norm)
        x = x + mlp_forward(layer.mlp, norm(layer.post_attention_layernorm, x))
        return norm(self.norm, x)


def _fuse_experts(state: dict, prefix: str) -> dict:
    """Checkpoint MoE experts (``experts.{e}.gate_proj/up_proj/down_proj.weight``) into
    the fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` of
    transformers 5 (gate rows first)."""
    pat = prefix + "experts."
    ids = sorted({int(k[len(pat):].split(".")[0]) for k in state if k.startswith(pat) and k[len(pat)].isdigit()})
    if not ids:
        return state
    out = {k: v for k, v in state.items() if not (k.startswith(pat) and k[len(pat)].isdigit())}
    gate_up, down = [], []
    for e in ids:
        base = f"{pat}{e}."
        gate_up.append(torch.cat([state[base + "gate_proj.weight"], state[base + "up_proj.weight"]], 0))
        down.append(state[base + "down_proj.weight"])
    out[pat + "gate_up_proj"] = torch.stack(gate_up)
    out[pat + "down_proj"] = torch.stack(down)
    return out


def read_mtp_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every ``mtp.*`` tensor of the checkpoint's safetensors files (transformers drops
    them when it loads the model), keyed without the ``mtp.`` prefix."""
    from safetensors import safe_open

    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"model_dir {model_dir!r} is not a directory")
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            weight_map = json.load(fh).get("weight_map", {})
        files = sorted({f for k, f in weight_map.items() if k.startswith("mtp.")}) or files
    out = {}
    for name in files:
        with safe_open(os.path.join(model_dir, name), framework="pt") as fh:
            for key in fh.keys():
                if key.startswith("mtp."):
                    out[key[len("mtp."):]] = fh.get_tensor(key)
    return out


def load_mtp_head(engine: HybridEngine, model_dir: str | os.PathLike) -> MTPHead:
    """Build the MTP head of ``engine``'s model and load ``mtp.*`` weights from
    ``model_dir``; raises ``ValueError`` when the checkpoint has none or they do not fit."""
    weights = read_mtp_weights(model_dir)
    if not weights:
        raise ValueError(f"{os.fspath(model_dir)!r} has no mtp.* weights (this checkpoint carries no MTP head)")
    return build_mtp_head(engine, weights)


def build_mtp_head(engine: HybridEngine, weights: dict[str, torch.Tensor]) -> MTPHead:
    """An :class:`MTPHead` for ``engine`` from checkpoint-layout weights keyed without
    the ``mtp.`` prefix; raises ``ValueError`` when they do not fit."""
    layer_ids = {int(k.split(".")[1]) for k in weights if k.startswith("layers.")}
    if layer_ids != {0}:
        raise ValueError(f"MTP heads with layers {sorted(layer_ids)} are not supported (expected exactly layer 0)")
    moe = any(k.startswith("layers.0.mlp.experts") or k.startswith("layers.0.mlp.gate.") for k in weights)
    head = MTPHead.for_engine(engine, moe=moe)
    state = _fuse_experts(weights, "layers.0.mlp.")
    want = head.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"mtp.* weights do not fit the MTP head: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for k, v in state.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise ValueError(f"mtp.{k} has shape {list(v.shape)}, the head expects {list(want[k].shape)}")
    head.load_state_dict({k: v.to(engine.dtype) for k, v in state.items()})
    return head.eval()


class MTPDrafter(Drafter):
    """Drafts with the model's MTP head, ``k`` tokens by applying it recursively.

    The head's attention layer has its own :class:`KVCache`. Pairs ``(h_t, x_{t+1})``
    of committed tokens are appended for good; the recursive pairs of a draft (the
    head's own output as ``h``, its own draft as the token) are written tentatively and
    dropped by truncating the cache length.

    Args:
        engine: the target engine (embedding, rotary and LM head are shared).
        head: the :class:`MTPHead` (see :func:`load_mtp_head`).
        num_slots, max_len: cache geometry; default the engine's.
    """

    name = "mtp"
    needs_hidden = True

    def __init__(self, engine: HybridEngine, head: MTPHead, *, num_slots: int | None = None,
                 max_len: int | None = None):
        self.engine = engine
        self.head = head
        attn = head.layers[0].self_attn
        self.cache = KVCache(1, num_slots or engine.pool.num_slots, attn.k_proj.out_features // attn.head_dim,
                             attn.head_dim, max_len or engine.max_len, dtype=engine.dtype, device=engine.device)
        self.free_slots = list(range(self.cache.num_slots))
        self.slot: dict = {}
        self.pending: dict = {}  # rid -> (hidden [m, H], tokens list)

    def add(self, rid, tokens, hidden):
        if hidden is None or hidden.shape[0] != len(tokens) - 1:
            raise ValueError("MTPDrafter.add needs the target's hidden state of every prompt token")
        if not self.free_slots:
            raise ValueError("MTPDrafter has no free cache slot")
        s = self.free_slots.pop(0)
        self.cache.reset(s)
        self.slot[rid] = s
        self.pending[rid] = (hidden, list(tokens[1:]))

    def observe(self, rid, new_tokens, hidden):
        if hidden is None or hidden.shape[0] != len(new_tokens):
            raise ValueError("MTPDrafter.observe needs one hidden state per new token")
        h, t = self.pending[rid]
        self.pending[rid] = (torch.cat([h, hidden]), t + list(new_tokens))

    def remove(self, rid):
        s = self.slot.pop(rid, None)
        self.pending.pop(rid, None)
        if s is not None:
            self.free_slots.append(s)

    @torch.inference_mode()
    def _run(self, slots, hiddens, tokens):
        starts = [self.cache.lengths[s] for s in slots]
        lengths = [len(t) for t in tokens]
        self.cache.check_room(slots, lengths)
        layout = WindowLayout(slots, starts, lengths, self.engine.device)
        ids = torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=self.engine.device)
        out = self.head.forward_layer(self.engine, self.cache, layout, ids, torch.cat(list(hiddens)))
        ends, acc = [], 0
        for n in lengths:
            acc += n
            ends.append(acc - 1)
        h_last = out[torch.tensor(ends, dtype=torch.long, device=self.engine.device)]
        return h_last, self.engine.lm_head(h_last).float()

    @torch.inference_mode()
    def propose(self, rids, counts, sampling, generator):
        slots = [self.slot[r] for r in rids]
        h, logits = self._run(slots, [self.pending[r][0] for r in rids], [self.pending[r][1] for r in rids])
        self.cache.advance(slots, [len(self.pending[r][1]) for r in rids])  # committed pairs
        for r in rids:
            self.pending[r] = (self.pending[r][0][:0], [])
        committed = [self.cache.lengths[s] for s in slots]
        toks, q = _choose(_fit_vocab(logits, self.engine.vocab_size), sampling, generator)
        drafts = [Draft([t], None if q is None else q[i : i + 1]) for i, t in enumerate(toks)]
        live = [i for i, c in enumerate(counts) if c > 1]
        step = 1
        while live:
            ls = [slots[i] for i in live]
            h_next, logits = self._run(ls, [h[i : i + 1] for i in live], [[drafts[i].tokens[-1]] for i in live])
            self.cache.advance(ls, [1] * len(live))  # tentative; truncated below
            toks, q = _choose(_fit_vocab(logits, self.engine.vocab_size), sampling, generator)
            for j, i in enumerate(live):
                drafts[i].tokens.append(toks[j])
                if q is not None:
                    drafts[i].q = torch.cat([drafts[i].q, q[j : j + 1]])
            h = h.clone()
            h[live] = h_next
            step += 1
            live = [i for i in live if counts[i] > step]
        self.cache.truncate(slots, committed)
        return [Draft(d.tokens[:c], None if d.q is None else d.q[:c]) for d, c in zip(drafts, counts)]


# ---------------------------------------------------------------------- draft model
class ModelDrafter(Drafter):
    """A separate small Qwen3.5 / Qwen3-Next model sharing the target's tokenizer, run
    by its own :class:`HybridEngine`.

    Per round the draft engine first consumes the tokens the target emitted since the
    last round (plain decoding, committed), which yields draft 1; drafts 2..k are
    decoded on top and then undone with :meth:`HybridEngine.save_state` /
    :meth:`~HybridEngine.restore_state` (a copy of the small model's checkpoints and
    conv states; its KV cache rolls back by length).

    Args:
        engine: the draft model's engine (strategy ``snapshot`` or ``fold``).
        vocab_size: the target's vocabulary (draft logits are cut or padded to it).
    """

    name = "model"

    def __init__(self, engine: HybridEngine, vocab_size: int):
        self.engine = engine
        self.vocab_size = vocab_size
        self.slot: dict = {}
        self.pending: dict = {}

    def add(self, rid, tokens, hidden=None):
        self.slot[rid] = self.engine.alloc()
        self.pending[rid] = list(tokens)

    def observe(self, rid, new_tokens, hidden=None):
        self.pending[rid].extend(new_tokens)

    def remove(self, rid):
        s = self.slot.pop(rid, None)
        self.pending.pop(rid, None)
        if s is not None:
            self.engine.free(s)

    @torch.inference_mode()
    def propose(self, rids, counts, sampling, generator):
        eng = self.engine
        slots = [self.slot[r] for r in rids]
        fresh = all(eng.length(s) == 0 for s in slots)
        out = eng.extend(slots, [self.pending[r] for r in rids], prompt=fresh)
        for r in rids:
            self.pending[r] = []
        toks, q = _choose(_fit_vocab(out.logits, self.vocab_size), sampling, generator)
        drafts = [Draft([t], None if q is None else q[i : i + 1]) for i, t in enumerate(toks)]
        live = [i for i, c in enumerate(counts) if c > 1]
        if live:
            saved = eng.save_state([slots[i] for i in live])
            step = 1
            while live:
                out = eng.extend([slots[i] for i in live], [[drafts[i].tokens[-1]] for i in live])
                toks, q = _choose(_fit_vocab(out.logits, self.vocab_size), sampling, generator)
                for j, i in enumerate(live):
                    drafts[i].tokens.append(toks[j])
                    if q is not None:
                        drafts[i].q = torch.cat([drafts[i].q, q[j : j + 1]])
                step += 1
                live = [i for i in live if counts[i] > step]
            eng.restore_state(saved)
        return [Draft(d.tokens[:c], None if d.q is None else d.q[:c]) for d, c in zip(drafts, counts)]
