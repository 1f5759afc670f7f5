"""A teacher-forced verify -> accept -> commit lifecycle checked against the oracle.

:class:`Lifecycle` drives a :class:`~replayssm.state.StatePool` through speculative
steps on random layer inputs with random window lengths and random acceptance, and
keeps two references of the accepted token stream:

* the float64 oracle (DESIGN.md section 5): the token-by-token recurrence in float64;
* the recurrence in the pool's own dtypes, which the exact strategies must match bit
  for bit on the same device. It is :func:`design_recurrence` below, a transcription of
  DESIGN.md section 1 that shares no code with the library's ops: bit-equality with it
  shows that a strategy (reference backend) follows the design's operation order. (It
  used to be the library's own reference recurrence, which runs through the same
  ``state_update`` as the strategies and so could not disagree with them.)

After every step it reports the committed-state error against both and the output error
of the accepted positions. The tests, ``replayssm demo`` and the drift tool build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..ops.conv import causal_conv_verify_reference
from ..ops.recurrent import gdn_recurrence_reference
from ..state import StatePool


def design_recurrence(x: dict[str, torch.Tensor], A_log, dt_bias, states: torch.Tensor, rows, lengths) -> torch.Tensor:
    """DESIGN.md section 1, token by token, written out with no library op.

    Args:
        x: packed inputs ``q, k [N, H, K]``, ``v [N, HV, V]``, ``a, b [N, HV]``.
        A_log, dt_bias: ``[HV]``.
        states: ``[R, HV, V, K]``, advanced in place (row ``rows[i]`` by window ``i``).
        rows, lengths: the row and the token count of each window, in packing order.

    Returns:
        ``o [N, HV, V]`` in the dtype of ``v``. Computes in float32 (float64 if the state
        or the activations are float64) and rounds to the state dtype once per window,
        where the state is written.
    """
    q, k, v, a, b = (x[n] for n in "qkvab")
    dtype = torch.float64 if torch.float64 in (q.dtype, states.dtype) else torch.float32
    gate_dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype, A_log.dtype, dt_bias.dtype) else torch.float32
    hv, kd = v.shape[1], q.shape[2]
    group = hv // q.shape[1]
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    t0 = 0
    for row, m in zip(rows, lengths):
        S = states[row].to(dtype)
        for t in range(t0, t0 + m):
            z = a[t].to(gate_dtype) + dt_bias.to(gate_dtype)
            softplus = torch.where(z > 20.0, z, torch.log1p(torch.exp(z)))
            g = (-torch.exp(A_log.to(gate_dtype)) * softplus).to(dtype)
            beta = (1.0 / (1.0 + torch.exp(-b[t].to(gate_dtype)))).to(dtype)
            kt, qt = k[t].to(dtype), q[t].to(dtype)
            k_hat = (kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(group, 0)
            q_hat = (qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6) * kd**-0.5).repeat_interleave(group, 0)
            S = torch.exp(g)[:, None, None] * S  # S' = exp(g) S
            u = beta[:, None] * (v[t].to(dtype) - (S * k_hat[:, None, :]).sum(-1))  # u = beta (v - S' k^)
            S = S + u[:, :, None] * k_hat[:, None, :]  # S = S' + u k^T
            o[t] = (S * q_hat[:, None, :]).sum(-1).to(o.dtype)  # o = S q^
        states[row] = S.to(states.dtype)
        t0 += m
    return o


@dataclass
class StepReport:
    """What one step looked like and how far the strategy is from the references."""

    step: int
    lengths: list[int]
    accepted: list[int]
    flushed: int
    state_err: float  # max over layers/requests of ||S - S64|| / ||S64||
    out_err: float  # max over layers of ||o - o64|| / ||o64|| on accepted positions
    state_bitexact: bool  # committed state == design_recurrence, bit for bit
    out_bitexact: bool  # accepted outputs == design_recurrence, bit for bit
    conv_bitexact: bool  # conv state == sequential reference, bit for bit


@dataclass
class Lifecycle:
    """Drive ``pool`` through steps for ``num_requests`` requests (+ padding rows).

    Args:
        pool: a fresh pool; its layers get random gate and conv parameters.
        num_requests: live requests per step (must fit in the pool).
        padding_rows: extra ``-1`` rows mixed into every batch.
        varlen: draw window lengths in ``1..window`` (else always ``window``).
        generator: the random source (fresh inputs every step).
    """

    pool: StatePool
    num_requests: int = 3
    padding_rows: int = 1
    varlen: bool = True
    generator: torch.Generator = field(default_factory=torch.Generator)
    step_count: int = 0

    def __post_init__(self):
        pool, g = self.pool, self.generator
        s = pool.shape
        dev = pool.device
        for layer in range(pool.num_layers):
            pool.set_layer_params(
                layer,
                # decay rates exp(A_log) in ~[0.05, 0.7] and dt_bias near 0: g ~ -0.03..-1
                A_log=torch.empty(s.num_value_heads).uniform_(-3.0, -0.3, generator=g),
                dt_bias=torch.randn(s.num_value_heads, generator=g) * 0.5,
                conv_weight=torch.randn(s.conv_dim, s.conv_kernel, generator=g) * 0.5,
                conv_bias=torch.randn(s.conv_dim, generator=g) * 0.1,
            )
        self.slots = [pool.alloc() for _ in range(self.num_requests)]
        shp = (pool.num_layers, self.num_requests, s.num_value_heads, s.head_v_dim, s.head_k_dim)
        self.oracle = torch.zeros(shp, dtype=torch.float64, device=dev)
        self.reference = torch.zeros(shp, dtype=pool.state_dtype, device=dev)
        self.conv_reference = torch.zeros(
            (pool.num_layers, self.num_requests, s.conv_dim, s.conv_kernel - 1), dtype=pool.act_dtype, device=dev
        )
        self._local = torch.arange(self.num_requests, dtype=torch.int32, device=dev)

    def _rand(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.generator) * scale).to(self.pool.device, self.pool.act_dtype)

    def make_inputs(self, n: int) -> dict[str, torch.Tensor]:
        s = self.pool.shape
        return {
            "x": self._rand(n, s.conv_dim),
            "q": self._rand(n, s.num_heads, s.head_k_dim),
            "k": self._rand(n, s.num_heads, s.head_k_dim),
            "v": self._rand(n, s.num_value_heads, s.head_v_dim),
            "a": self._rand(n, s.num_value_heads),
            "b": self._rand(n, s.num_value_heads, scale=2.0),
        }

    def _rows(self) -> list[int]:
        """The step's rows: every request and the padding rows, in a random order."""
        rows = list(self.slots) + [-1] * self.padding_rows
        order = torch.randperm(len(rows), generator=self.generator).tolist()
        return [rows[i] for i in order]

    def step(self, tamper: Callable[[StatePool, list[int], list[int]], None] | None = None) -> StepReport:
        """One verify -> accept -> commit step; ``tamper(pool, rows, accepted)`` runs
        between the last verify and the commit (to prove that the checks have teeth)."""
        g, T = self.generator, self.pool.window
        rows = self._rows()
        lengths = [int(torch.randint(1, T + 1, (), generator=g)) if self.varlen else T for _ in rows]
        accepted = [int(torch.randint(1, m + 1, (), generator=g)) for m in lengths]
        return self._run(rows, lengths, accepted, tamper, decode=False)

    def decode_step(self, tamper: Callable[[StatePool, list[int], list[int]], None] | None = None) -> StepReport:
        """One plain decoding step through the ring (``Strategy.decode`` in every layer,
        then ``commit(batch)``): one token per request, kept. Checked against the same
        references as :meth:`step`; the two mix freely on the same requests."""
        rows = self._rows()
        return self._run(rows, [1] * len(rows), [1] * len(rows), tamper, decode=True)

    def _run(self, rows, lengths, accepted, tamper, *, decode: bool) -> StepReport:
        pool = self.pool
        batch = pool.batch(rows, lengths)
        n_tok = sum(lengths)
        flush_rows = 0
        if "is_flush" in pool.buffers:
            flush_rows = int(pool.buffers["is_flush"][[r for r in rows if r >= 0]].sum())

        inputs, outputs, conv_out = [], [], []
        for layer in range(pool.num_layers):
            x = self.make_inputs(n_tok)
            conv_out.append(pool.strategy.conv_verify(layer, x["x"], batch))
            run = pool.strategy.decode if decode else pool.strategy.verify
            outputs.append(run(layer, x["q"], x["k"], x["v"], x["a"], x["b"], batch))
            inputs.append(x)
        if tamper is not None:
            tamper(pool, rows, accepted)
        pool.strategy.commit(batch, None if decode else accepted)

        # The accepted stream of each live request, in request order.
        req_of = {s: i for i, s in enumerate(self.slots)}
        cu = [0]
        for m in lengths:
            cu.append(cu[-1] + m)
        keep, kept_rows, kept_len = [], [], []
        for i, s in enumerate(rows):
            if s >= 0:
                keep.extend(range(cu[i], cu[i] + accepted[i]))
                kept_rows.append(req_of[s])
                kept_len.append(accepted[i])
        keep_t = torch.tensor(keep, dtype=torch.long, device=pool.device)
        ref_slots = torch.tensor(kept_rows, dtype=torch.int32, device=pool.device)
        ref_cu = torch.tensor([0] + torch.tensor(kept_len).cumsum(0).tolist(), dtype=torch.int32, device=pool.device)

        state_err = out_err = 0.0
        state_exact = out_exact = conv_exact = True
        for layer in range(pool.num_layers):
            x = {k: v[keep_t] for k, v in inputs[layer].items()}
            p = pool.layer_params(layer)
            gate = (x["q"], x["k"], x["v"], x["a"], x["b"], p["A_log"], p["dt_bias"])
            o64 = gdn_recurrence_reference(
                *(t.double() for t in gate), self.oracle[layer], ref_slots, ref_cu, update_state=True
            )
            o_ref = design_recurrence(x, p["A_log"], p["dt_bias"], self.reference[layer], kept_rows, kept_len)
            o = outputs[layer][keep_t]
            out_err = max(out_err, _rel(o, o64))
            out_exact &= torch.equal(o, o_ref)
            c_ref = causal_conv_verify_reference(
                x["x"], self.conv_reference[layer], p["conv_weight"], p["conv_bias"], ref_slots, ref_cu, update_state=True
            )
            conv_exact &= torch.equal(conv_out[layer][keep_t], c_ref)
            committed = pool.strategy.committed_state(layer, self.slots)
            for r in range(self.num_requests):
                state_err = max(state_err, _rel(committed[r], self.oracle[layer, r]))
            state_exact &= torch.equal(committed, self.reference[layer])
        slots_t = torch.tensor(self.slots, dtype=torch.long, device=pool.device)
        conv_exact &= torch.equal(pool.conv_history()[:, slots_t], self.conv_reference)
        self.step_count += 1
        return StepReport(
            step=self.step_count, lengths=lengths, accepted=accepted, flushed=flush_rows,
            state_err=state_err, out_err=out_err, state_bitexact=state_exact, out_bitexact=out_exact,
            conv_bitexact=conv_exact,
        )


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    den = ref.norm().item()
    err = (x.double() - ref).norm().item()
    return err / den if den > 0 else err
