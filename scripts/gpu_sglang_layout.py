"""replayssm's fold strategy on SGLang 0.5.23's GDN state tensors, beside SGLang's own fold.

One run on a CUDA GPU. The tensors are laid out as SGLang's MambaPool lays them out
(``ssm_states [layers, slots, HV, V, K]``, the fold-every-commit records
``replayssm_rawk [layers, slots, H, T, K]``, ``replayssm_rawv [layers, slots, HV, T, V]``,
``replayssm_g`` / ``replayssm_beta [layers, slots, HV, T]``), in two identical copies:

* ours: a ``StatePool(strategy="fold", buffers=...)`` over one copy, the rings handed in
  as ``.transpose(2, 3)`` views (no copies), driven through ``verify`` / ``commit``;
* theirs: SGLang's fold path on the other copy, its kernels loaded from the peer folder
  given by ``--sglang``: ``fused_sigmoid_gating_delta_rule_update(cache_ring=True)``
  per layer, then ``commit_gdn_replayssm_fold_all_layers``.

Both get the same post-conv inputs (bf16) and accepted counts, step after step. The
reference is plain decoding of the accepted tokens with replayssm's fp32 recurrence on a
packed copy ("plain"), itself checked against a float64 run of the recurrence. Checks:
ours equals plain bit for bit (committed states and verify outputs); plain and theirs
within tolerance of float64 (relative error of the states: 1e-4 for fp32 states, whose
inputs are exact bf16 values, 2**-6 for bf16 states, rounded at every commit; of the
outputs: 1e-2, which are bf16); our records are bit for bit where SGLang's verify writes
its own; and SGLang's fold kernel run on the records our verify wrote lands within the
state tolerance of ours. Prints a table, writes JSON, exits 1 if a check fails.

    python3 scripts/gpu_sglang_layout.py --sglang .peer/sglang_0523 --out results/sglang_layout.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from replayssm.ops import gdn_recurrence, gdn_recurrence_reference  # noqa: E402
from replayssm.state import GDNShape, StatePool  # noqa: E402

STATE_TOL = {"float32": 1e-4, "bfloat16": 1.6e-2}
OUT_TOL = 1e-2


def load_peer(folder: str):
    sys.path.insert(0, folder)
    linear = "sglang.kernels.ops.attention.linear."
    recur = importlib.import_module(linear + "fused_sigmoid_gating_recurrent").fused_sigmoid_gating_delta_rule_update
    fold_all = importlib.import_module(linear + "gdn_replayssm_spec_fold").commit_gdn_replayssm_fold_all_layers
    return recur, fold_all


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def maxabs(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.double() - y.double()).abs().max().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang", required=True, help="peer folder holding the sglang package tree (0.5.23 kernels)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="requests per step (plus one padding row)")
    ap.add_argument("--T", type=int, default=4, help="verify window (drafts + bonus)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--hv", type=int, default=32)
    ap.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--head-dim", type=int, default=128, help="K = V")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1 (small shapes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()

    recur, fold_all = load_peer(args.sglang)
    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    H, HV, K, V, NL, T, B = args.h, args.hv, args.head_dim, args.head_dim, args.layers, args.T, args.rows
    device_name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton interpreter)"
    sdt, adt = getattr(torch, args.state_dtype), torch.bfloat16
    slots_n = B + 2  # SGLang sizes its pool size + 1; one more slot stays untouched
    rows = torch.randperm(slots_n)[: B + 1].tolist()
    rows[B // 2] = -1  # a padding row in the middle
    live = [s for s in rows if s >= 0]
    untouched = [s for s in range(slots_n) if s not in live]
    shape = GDNShape(H, HV, K, V)

    def sglang_pool():
        return dict(
            temporal=(torch.randn(NL, slots_n, HV, V, K, generator=gen, device=dev) * 0.05).to(sdt),
            rawv=torch.zeros(NL, slots_n, HV, T, V, device=dev, dtype=adt),
            rawk=torch.zeros(NL, slots_n, H, T, K, device=dev, dtype=adt),
            g=torch.zeros(NL, slots_n, HV, T, device=dev),
            beta=torch.zeros(NL, slots_n, HV, T, device=dev),
        )

    gen = torch.Generator(device=dev).manual_seed(args.seed)
    ours = sglang_pool()
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    theirs = sglang_pool()
    assert torch.equal(ours["temporal"], theirs["temporal"])
    start_untouched = ours["temporal"][:, untouched].clone()
    plain = ours["temporal"].clone()  # packed copy for plain decoding (fp32 recurrence)
    exact64 = ours["temporal"].double()

    pool = StatePool(shape, NL, slots_n, strategy="fold", window=T, state_dtype=sdt, act_dtype=adt, device=dev,
                     backend="triton", buffers={
                         "checkpoints": ours["temporal"],
                         "ring_k": ours["rawk"].transpose(2, 3), "ring_v": ours["rawv"].transpose(2, 3),
                         "ring_g": ours["g"].transpose(2, 3), "ring_beta": ours["beta"].transpose(2, 3),
                     })
    A_log = [torch.rand(HV, device=dev) * 2 - 4 for _ in range(NL)]
    dt_bias = [torch.randn(HV, device=dev) * 0.5 for _ in range(NL)]
    for layer in range(NL):
        pool.set_layer_params(layer, A_log=A_log[layer], dt_bias=dt_bias[layer],
                              conv_weight=torch.randn(shape.conv_dim, shape.conv_kernel))
    for s in live:
        pool.alloc(s, keep_state=True)  # the states SGLang's pool holds

    idx = torch.tensor(rows, dtype=torch.int32, device=dev)
    n_tok = (B + 1) * T
    qsl = torch.arange(0, n_tok + 1, T, dtype=torch.int32, device=dev)
    live_rows = [i for i, s in enumerate(rows) if s >= 0]
    live_tok = torch.tensor([i * T + t for i in live_rows for t in range(T)], device=dev)
    live_idx = torch.tensor(live, device=dev)
    table, failures = [], []
    state_tol = STATE_TOL[args.state_dtype]
    print(f"device {device_name} torch {torch.__version__}; H={H} HV={HV} K=V={K} "
          f"{args.state_dtype} states, bf16 inputs, {NL} layers, {B} requests + 1 padding row, T={T}", flush=True)
    for step in range(args.steps):
        accepted = torch.randint(1, T + 1, (B + 1,), device=dev, dtype=torch.int32)
        acc_host = accepted.tolist()
        keep = torch.tensor([i * T + t for i in range(B + 1) for t in range(acc_host[i])], device=dev)
        cu_acc = torch.tensor([0] + torch.tensor(acc_host).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        batch = pool.batch(rows, T)
        row = {"step": step, "out_ours_vs_plain_maxabs": 0.0, "out_ours_rel64": 0.0, "out_theirs_rel64": 0.0,
               "out_plain_rel64": 0.0, "records_equal": True}
        for layer in range(NL):
            q = torch.randn(n_tok, H, K, device=dev).to(adt)
            k = torch.randn(n_tok, H, K, device=dev).to(adt)
            v = torch.randn(n_tok, HV, V, device=dev).to(adt)
            a = torch.randn(n_tok, HV, device=dev).to(adt)
            b = torch.randn(n_tok, HV, device=dev).to(adt)
            gates = (A_log[layer], dt_bias[layer])
            o_ours = pool.strategy.verify(layer, q, k, v, a, b, batch)
            o_theirs = recur(
                A_log=A_log[layer], a=a, dt_bias=dt_bias[layer], softplus_beta=1.0, softplus_threshold=20.0,
                q=q[None], k=k[None], v=v[None], b=b, initial_state_source=theirs["temporal"][layer],
                initial_state_indices=idx, cu_seqlens=qsl, use_qk_l2norm_in_kernel=True, disable_state_update=True,
                cache_ring=True, replayssm_rawv=theirs["rawv"][layer], replayssm_rawk=theirs["rawk"][layer],
                replayssm_g=theirs["g"][layer], replayssm_beta=theirs["beta"][layer],
            ).reshape(n_tok, HV, V)
            o_plain = gdn_recurrence(q, k, v, a, b, *gates, plain[layer], idx, qsl, max_len=T, backend="triton")
            o64 = gdn_recurrence_reference(q.double(), k.double(), v.double(), a.double(), b.double(),
                                           *(x.double() for x in gates), exact64[layer], idx, qsl)
            o64 = o64[live_tok]
            row["out_ours_vs_plain_maxabs"] = max(row["out_ours_vs_plain_maxabs"], maxabs(o_ours, o_plain))
            row["out_ours_rel64"] = max(row["out_ours_rel64"], rel(o_ours[live_tok], o64))
            row["out_plain_rel64"] = max(row["out_plain_rel64"], rel(o_plain[live_tok], o64))
            row["out_theirs_rel64"] = max(row["out_theirs_rel64"], rel(o_theirs[live_tok], o64))
            for name in ("rawk", "rawv"):  # the raw records: bit for bit where SGLang writes its own
                row["records_equal"] &= torch.equal(ours[name][layer, live_idx], theirs[name][layer, live_idx])
            # plain decoding of the accepted tokens: fp32 (Triton) and float64 (reference)
            gdn_recurrence(q[keep], k[keep], v[keep], a[keep], b[keep], *gates, plain[layer], idx, cu_acc,
                           max_len=T, update_state=True, backend="triton")
            gdn_recurrence_reference(q[keep].double(), k[keep].double(), v[keep].double(), a[keep].double(),
                                     b[keep].double(), *(x.double() for x in gates), exact64[layer], idx, cu_acc,
                                     update_state=True)
        # SGLang's fold kernel on the records our verify wrote, from our pre-commit states
        cross = ours["temporal"].clone()
        fold_all(checkpoint_state=cross, rawv_cache=ours["rawv"], rawk_cache=ours["rawk"], g_cache=ours["g"],
                 beta_cache=ours["beta"], ssm_state_indices=idx, accept_lens=accepted, max_cache_len=T,
                 num_k_heads=H, null_block_id=-1)
        pool.strategy.commit(batch, accepted)
        fold_all(checkpoint_state=theirs["temporal"], rawv_cache=theirs["rawv"], rawk_cache=theirs["rawk"],
                 g_cache=theirs["g"], beta_cache=theirs["beta"], ssm_state_indices=idx, accept_lens=accepted,
                 max_cache_len=T, num_k_heads=H, null_block_id=-1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        pool.check_errors()
        s_ours, s_theirs = ours["temporal"][:, live_idx], theirs["temporal"][:, live_idx]
        s_plain, s64 = plain[:, live_idx], exact64[:, live_idx]
        row.update(
            state_ours_vs_plain_maxabs=maxabs(s_ours, s_plain),
            state_ours_rel64=rel(s_ours, s64),
            state_plain_rel64=rel(s_plain, s64),
            state_theirs_rel64=rel(s_theirs, s64),
            state_theirs_vs_ours_maxabs=maxabs(s_theirs, s_ours),
            state_sglang_fold_on_our_records_rel=rel(cross[:, live_idx], s_ours),
            untouched_unchanged=torch.equal(ours["temporal"][:, untouched], start_untouched),
        )
        table.append(row)
        checks = {
            "ours == plain (states, bit for bit)": row["state_ours_vs_plain_maxabs"] == 0.0,
            "ours == plain (outputs, bit for bit)": row["out_ours_vs_plain_maxabs"] == 0.0,
            "plain within tolerance of float64 (states)": row["state_plain_rel64"] <= state_tol,
            "plain within tolerance of float64 (outputs)": row["out_plain_rel64"] <= OUT_TOL,
            "theirs within tolerance of float64 (states)": row["state_theirs_rel64"] <= state_tol,
            "theirs within tolerance of float64 (outputs)": row["out_theirs_rel64"] <= OUT_TOL,
            "our records where SGLang writes its own": row["records_equal"],
            "SGLang's fold on our records within tolerance": row["state_sglang_fold_on_our_records_rel"] <= state_tol,
            "untouched slots unchanged": row["untouched_unchanged"],
        }
        failures += [f"step {step}: {name}" for name, ok in checks.items() if not ok]

    print(f"\n{'step':>4} {'ours-plain':>10} {'ours/f64':>9} {'plain/f64':>9} {'theirs/f64':>10} "
          f"{'theirs-ours':>11} {'out ours':>9} {'out theirs':>10} {'records':>7}")
    for r in table:
        print(f"{r['step']:>4} {r['state_ours_vs_plain_maxabs']:>10.1e} {r['state_ours_rel64']:>9.1e} "
              f"{r['state_plain_rel64']:>9.1e} {r['state_theirs_rel64']:>10.1e} "
              f"{r['state_theirs_vs_ours_maxabs']:>11.1e} {r['out_ours_rel64']:>9.1e} "
              f"{r['out_theirs_rel64']:>10.1e} {'same' if r['records_equal'] else 'DIFFER':>7}")
    print("(states: max |diff| or relative error against float64 over the live slots; outputs: worst layer)")
    print("FAIL:\n  " + "\n  ".join(failures) if failures else "all checks passed")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "args": vars(args),
                       "tolerance": {"state_rel": state_tol, "out_rel": OUT_TOL}, "rows": table,
                       "failures": failures}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
