"""Prompt prefill on a CUDA GPU.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_prefill_gpu.py

Claims checked:

* A prompt pass synchronises the host a fixed number of times, whatever the number of
  layers (no host read or blocking copy inside a layer): with the recurrence, with
  fla-core's chunked kernel (its chunk indices derived once per pass), and with MoE
  blocks (through the grouped GEMM, not the HF block's per-expert loop).
* fla-core's kernel continues a prompt prefilled in parts from the committed state
  (its ``initial_state``): the logits agree with the recurrence over the whole prompt.
* Chunked prefill interleaved with graphed decode steps keeps the greedy tokens (fp32)
  and places the joiner's passes between the running requests' steps.
* A prompt pass at a static shape (a CUDA-graph replay) gives the eager pass's logits
  and states, and synchronises the host not at all: with the recurrence, and with
  fla-core's kernel for one request (one sequence) and for several (sequences of the
  packed tokens with a fixed-length chunk list), 16 prompts of 2048 tokens included.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch

from replayssm.engine.adapter import HybridEngine, load_chunk_kernel
from replayssm.engine.generator import StepGenerator
from replayssm.engine.random_model import build_tiny_model

pytestmark = pytest.mark.gpu

HEADS = dict(linear_key_head_dim=128, linear_value_head_dim=128)  # fla-core's kernels want real head sizes


def _prompts(seed: int, lengths) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _fla_engines(seed: int, **kw):
    """A bf16 tiny model and two fold engines on it through fla-core's chunked kernel,
    their prompt passes eager and static (skips where fla-core does not import)."""
    if load_chunk_kernel() is None:
        pytest.skip("fla-core is not importable here")
    model = build_tiny_model("qwen3_5", seed=seed, dtype=torch.bfloat16, device="cuda", **HEADS)
    common = dict(strategy="fold", window=4, prefill="chunk", **kw)
    return model, HybridEngine(model, prompt_graphs=False, **common), HybridEngine(model, prompt_graphs=True, **common)


def _fresh_passes(engines, seed: int, lengths) -> list[tuple[torch.Tensor, ...]]:
    """Each engine's prompt pass of fresh requests of ``lengths`` (the same prompts):
    its logits, GDN checkpoints and conv states, fp32; the slots are freed after."""
    prompts = _prompts(seed, lengths)
    outs = []
    for eng in engines:
        slots = [eng.alloc() for _ in prompts]
        out = eng.extend(slots, prompts, prompt=True)
        outs.append((out.logits.float(), eng.pool.checkpoints[:, slots].float(), eng.pool.conv_state[:, slots].float()))
        eng.free_many(slots)
    return outs


def _syncs_of_a_prompt_pass(model, prefill: str, prompt_graphs: bool = False) -> int:
    """Host synchronisations (torch's sync debug mode, as warnings) of one prompt pass
    of three requests, the engine and its first pass already warmed up."""
    eng = HybridEngine(model, strategy="fold", num_slots=3, window=4, max_len=256, prefill=prefill,
                       prompt_graphs=prompt_graphs)
    prompts = _prompts(3, (100, 37, 64))
    def counted_pass() -> list:
        slots = [eng.alloc() for _ in prompts]
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                eng.extend(slots, prompts, prompt=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for s in slots:
            eng.free(s)
        return caught

    with torch.inference_mode():
        # The warm-up pass: Triton compiles, cuBLAS picks its kernels, and the first pass
        # of the process under the sync debug mode pays a one-time host read in torch.cuda
        # (measured: one, whatever the pass), uncounted, so that no count depends on the
        # order the tests run in.
        counted_pass()
        caught = counted_pass()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    # where each one came from (the warning's frame is the Python line that called the
    # op), so a failing count names its lines
    for where, n in collections.Counter(f"{w.filename}:{w.lineno}" for w in syncs).most_common():
        print(f"    {n} x {where}")
    return len(syncs)


@pytest.mark.parametrize("family,prefill", [("qwen3_5", "recurrence"), ("qwen3_5", "chunk"), ("qwen3_next", "recurrence")])
def test_prompt_pass_syncs_do_not_grow_with_the_layers(family, prefill):
    if prefill == "chunk" and load_chunk_kernel() is None:
        pytest.skip("fla-core is not importable here")
    counts = []
    for layers in (2, 4, 8):
        model = build_tiny_model(family, seed=2, dtype=torch.bfloat16, device="cuda", num_hidden_layers=layers,
                                 **HEADS)
        counts.append(_syncs_of_a_prompt_pass(model, prefill))
    # the pass's own copies of host indices to the device (layout, token ids, lengths)
    # synchronise too, once per pass; a layer adds none
    print(f"\n  {family}/{prefill}: {counts[0]} synchronisations per prompt pass at 2, 4 and 8 layers")
    assert counts[0] == counts[1] == counts[2], counts


def test_moe_prompt_pass_matches_hf():
    """The grouped-GEMM MoE of prompt passes gives HF's logits (bf16 rounding)."""
    model = build_tiny_model("qwen3_next", seed=6, dtype=torch.bfloat16, device="cuda")
    eng = HybridEngine(model, strategy="fold", num_slots=1, window=2, max_len=128, prefill="recurrence")
    if eng.moe_kernel != "grouped_mm":
        pytest.skip(f"the MoE blocks run {eng.moe_kernel!r} here")
    prompt = _prompts(4, (57,))[0]
    with torch.inference_mode():
        ours = eng.extend([eng.alloc()], [prompt], all_logits=True, prompt=True).logits
        ref = model(torch.tensor([prompt], device="cuda"), use_cache=False).logits[0].float()
    err = (ours - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), err


def test_fla_continues_a_prompt_prefilled_in_parts():
    if load_chunk_kernel() is None:
        pytest.skip("fla-core is not importable here")
    model = build_tiny_model("qwen3_5", seed=4, dtype=torch.bfloat16, device="cuda", **HEADS)
    prompts = _prompts(9, (300, 130))
    whole = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=512, prefill="recurrence")
    parts = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=512, prefill="chunk",
                         prompt_graphs=False)
    with torch.inference_mode():
        ref = whole.extend([whole.alloc(), whole.alloc()], prompts, prompt=True).logits.float()
        slots = [parts.alloc(), parts.alloc()]
        parts.extend(slots[:1], [prompts[0][:170]], prompt=True)
        got = parts.extend(slots, [prompts[0][170:], prompts[1]], prompt=True).logits.float()
    err = (got - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), err


def test_graphed_decode_with_chunked_prefill_keeps_the_tokens():
    model = build_tiny_model("qwen3_5", seed=8, dtype=torch.float32, device="cuda")
    prompts = _prompts(12, (20, 9, 150))
    budgets = [80, 5, 20]
    runs = []
    for chunk in (None, 32):
        eng = HybridEngine(model, strategy="fold", num_slots=2, window=1, max_len=256)
        runs.append(StepGenerator(eng, prefill_chunk=chunk).generate(prompts, budgets))
    assert runs[1].tokens == runs[0].tokens
    joiner = [p for p in runs[1].stats.prefills if 2 in p.requests]
    assert len(joiner) == 5 and all(b.after_step == a.after_step + 1 for a, b in zip(joiner, joiner[1:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_prompt_pass_replays_the_eager_pass(dtype):
    """Two passes through one captured shape (so the second replays with other
    requests): last-token logits and GDN states as the eager recurrence pass's (the
    same kernels; the token-wise layers on 512 rows instead of the pass's), and no
    host synchronisation in a replayed pass."""
    model = build_tiny_model("qwen3_5", seed=5, dtype=dtype, device="cuda", **HEADS)
    common = dict(strategy="fold", num_slots=3, window=4, max_len=512, prefill="recurrence")
    eager = HybridEngine(model, prompt_graphs=False, **common)
    static = HybridEngine(model, prompt_graphs=True, **common)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    with torch.inference_mode():
        for lengths in ((300, 37, 64), (5, 250, 190)):
            prompts = _prompts(sum(lengths), lengths)
            outs = []
            for eng in (eager, static):
                slots = [eng.alloc() for _ in prompts]
                outs.append((eng.extend(slots, prompts, prompt=True).logits.float(),
                             eng.pool.checkpoints[:, slots].float()))
                for s in slots:
                    eng.free(s)
            (le, se), (ls, ss) = outs
            assert (ls - le).abs().max().item() < tol * le.abs().max().item()
            assert (ss - se).abs().max().item() < tol * se.abs().max().item()
    assert static.prompt_passes == {"static": 2, "eager": 0}
    assert _syncs_of_a_prompt_pass(model, "recurrence", prompt_graphs=True) == 0


def test_static_prompt_pass_of_one_request_through_fla():
    """One request's shape runs fla-core's kernel in the graph (every token one
    sequence, the padding's gates zero; a request that fills its shape has none):
    logits and states as the eager chunked pass's."""
    _, eager, static = _fla_engines(7, num_slots=1, max_len=2304)
    with torch.inference_mode():
        for n in (1500, 2000, 2048):  # one shape (2048), replayed with another prompt; then 2048 tokens: no padding
            want, got = _fresh_passes((eager, static), n, (n,))
            for g, w in zip(got, want):
                assert (g - w).abs().max().item() < 0.05 * w.abs().max().item(), n
    assert static.prompt_passes == {"static": 3, "eager": 0}
    assert static.prompt_graphs.prepare(1, 2000).chunk_kernel is not None
    assert not static.prompt_graphs.prepare(1, 2048).padded


def test_static_prompt_pass_of_several_requests_through_fla():
    """A shape of several requests runs fla-core's kernel on the packed tokens in the
    graph (the requests, the padding request and an empty sequence, with the pass's
    chunk list, whose spare entries name the empty sequence): logits, GDN and conv
    states as the eager pass's (fla's varlen call), through one captured shape twice
    (the second pass replays it with other requests and lengths) and through the shape
    of 16 prompts of 2048 tokens; a replayed pass synchronises the host not at all."""
    model, eager, static = _fla_engines(11, num_slots=16, max_len=2052)
    with torch.inference_mode():
        # 4885 and 5000 tokens: one shape (N = 5120, C = 2048); then 16 x 2048 (N = 33024)
        for lengths in ((2048, 1000, 37, 1800), (1900, 1000, 2000, 100), (2048,) * 16):
            want, got = _fresh_passes((eager, static), sum(lengths), lengths)
            for g, w in zip(got, want):  # bf16: the token-wise layers on N rows instead of n
                assert (g - w).abs().max().item() < 0.05 * w.abs().max().item(), lengths
    assert static.prompt_passes == {"static": 3, "eager": 0}
    assert set(static.prompt_graphs._shapes) == {(4, 5120, 2048, True), (16, 33024, 2048, True)}
    assert all(g.graph is not None for g in static.prompt_graphs._shapes.values())
    # three requests of 100, 37 and 64 tokens: the shape (3, 256, 128) through fla-core
    assert _syncs_of_a_prompt_pass(model, "chunk", prompt_graphs=True) == 0


def test_prompt_ops_on_the_card_and_in_a_graph():
    """prompt_gates' kernel on bf16 projections (the model's) against the reference, and
    write_checkpoints replayed from a graph captured with slot -1 (which wrote nothing)
    after the slot is rewritten on the device: the slot's checkpoint is the state, the
    others are untouched."""
    from replayssm.ops.checkpoints import write_checkpoints
    from replayssm.ops.prompt_gates import prompt_gates

    g = torch.Generator(device="cuda").manual_seed(3)
    n, hv = 3000, 32
    a = torch.randn(n, 2 * hv, generator=g, device="cuda").mul(6).bfloat16()[:, :hv]
    b = torch.randn(n, hv, generator=g, device="cuda").mul(3).bfloat16()
    A_log, dt_bias = torch.rand(hv, generator=g, device="cuda") * 3 - 1, torch.randn(hv, generator=g, device="cuda")
    real = torch.tensor([2100], device="cuda", dtype=torch.int32)
    ref = prompt_gates(a, b, A_log, dt_bias, real, beta_dtype=torch.bfloat16, backend="reference")
    got = prompt_gates(a, b, A_log, dt_bias, real, beta_dtype=torch.bfloat16, backend="triton")
    # softplus far below zero: the kernels' log(1 + exp(x)) resolves 1 + exp(x) to one fp32
    # ulp of 1, so there its g is off by up to ulp(1) * exp(A_log) (a decay exp(g) that fp32
    # cannot tell from 1 either); elsewhere a few ulps of the value
    floor = 2.0**-23 * A_log.exp()
    assert ((got[0] - ref[0]).abs() <= 1e-6 * ref[0].abs() + floor).all() and torch.equal(got[0][2100:], ref[0][2100:])
    assert ((got[1].float() - ref[1].float()).abs() <= 2**-8 * ref[1].float().abs()).all()

    ck = torch.randn(2, 5, 4, 128, 128, generator=g, device="cuda").bfloat16()
    before = ck.clone()
    states = torch.randn(1, 4, 128, 128, generator=g, device="cuda")
    slots = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    write_checkpoints(ck[1], slots, states)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_checkpoints(ck[1], slots, states)
    torch.cuda.synchronize()
    assert torch.equal(ck, before)
    slots.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ck[1, 3], states[0].bfloat16())
    assert torch.equal(ck[0], before[0]) and torch.equal(ck[1, [0, 1, 2, 4]], before[1, [0, 1, 2, 4]])


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("packed", [True, False])
def test_fresh_attention_takes_grouped_keys_as_they_are(packed, backend):
    """A prompt pass's attention of 16 query heads over 2 key/value heads (Qwen3.5's,
    head dim 256, bf16) hands SDPA the grouped keys and values (the GQA of its flash
    and cuDNN kernels, the layout's backend, each asked for alone) instead of repeating
    them per query head: against SDPA on the repeated keys and values, to one bf16
    rounding of the outputs' scale, over a layout of one row per request (``packed``)
    and over requests of 700 and 300 tokens and their padding."""
    from torch.nn.attention import SDPBackend

    from replayssm.engine.kv_cache import PromptLayout, _fresh_attention

    if backend == "cudnn" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuDNN's attention is taken on sm_90 cards only")

    g = torch.Generator(device="cuda").manual_seed(4)
    lengths = [512, 512] if packed else [700, 300, 24]
    n, heads, kv_heads, d = sum(lengths), 16, 2, 256
    q = torch.randn(n, heads, d, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(n, kv_heads, d, generator=g, device="cuda").bfloat16() for _ in range(2))
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).cuda()
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1].cuda()
    col = torch.arange(n, device="cuda") - starts[row]
    layout = PromptLayout(len(lengths), max(lengths), torch.stack([row, col, col, row]))
    layout.uniform = packed
    layout.attention_backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    got = _fresh_attention(layout, q, k, v, d**-0.5)
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[s : s + m].transpose(0, 1)[None], k[s : s + m].repeat_interleave(8, 1).transpose(0, 1)[None],
        v[s : s + m].repeat_interleave(8, 1).transpose(0, 1)[None], is_causal=True, scale=d**-0.5)[0].transpose(0, 1)
        for s, m in zip(starts.tolist(), lengths)])
    assert (got.float() - want.float()).abs().max() <= 2.0**-8 * want.float().abs().max()
