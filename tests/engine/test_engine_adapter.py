"""The model adapter against Hugging Face's own forward, and its step protocol.

Our plain path (prompt prefill + one token at a time through the exact recurrence and
our KV cache) must give the logits of transformers' full-sequence forward (its chunked
GDN and causal attention, no cache) to fp32 tolerance, and verify windows must give the
same logits as the plain path, for both model families.
"""

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.random_model import build_tiny_model
from replayssm.testing.chunk_kernel import chunk_kernel_on_cpu as fake_chunk_kernel

FAMILIES = ("qwen3_5", "qwen3_next")
TOL = 2e-5  # logits are O(1); fp32 with different summation orders


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_path_matches_hf_forward(family, rng, seed):
    model = build_tiny_model(family, seed=seed)
    ids = torch.randint(0, 256, (40,), generator=rng).tolist()
    ref = hf_logits(model, ids)
    assert ref.abs().max() > 0.1  # logits with some spread, not a degenerate model

    eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=64)
    s = eng.alloc()
    out = eng.extend([s], [ids[:17]], all_logits=True, prompt=True)
    torch.testing.assert_close(out.logits, ref[:17], atol=TOL, rtol=0)
    for t in range(17, 40):
        out = eng.extend([s], [[ids[t]]])
        torch.testing.assert_close(out.logits[0], ref[t], atol=TOL, rtol=0)
    assert eng.length(s) == 40


@pytest.mark.parametrize("lengths", [(12, 12, 12), (12, 5, 9)])
def test_prompt_pass_of_several_requests_matches_hf(lengths, rng, seed):
    """Fresh requests in one prompt pass attend each within its own window: prompts of
    one length (the packed tokens taken as the padded layout) and of several (scattered
    into it) give HF's logits of each prompt alone."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in lengths]
    eng = HybridEngine(model, strategy="fold", num_slots=3, window=2, max_len=32, prompt_graphs=False)
    out = eng.extend([eng.alloc() for _ in prompts], prompts, all_logits=True, prompt=True)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(out.logits[out.offsets[i] : out.offsets[i + 1]], hf_logits(model, p), atol=TOL,
                                   rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ["snapshot", "fold", "circular"])
def test_verify_windows_match_hf_forward(family, strategy, rng, seed):
    """Batched verify windows with per-request accepted lengths: the logits of every
    window position equal the full-sequence forward over the accepted stream."""
    model = build_tiny_model(family, seed=seed)
    eng = HybridEngine(model, strategy=strategy, num_slots=3, window=4, max_len=96)
    streams = [torch.randint(0, 256, (60,), generator=rng).tolist() for _ in range(2)]
    refs = [hf_logits(model, s) for s in streams]
    slots = [eng.alloc(), eng.alloc()]
    pos = [7, 11]  # different prompt lengths
    eng.extend(slots, [streams[i][: pos[i]] for i in range(2)], prompt=True)
    for _ in range(12):
        lens = torch.randint(1, 5, (2,), generator=rng).tolist()
        out = eng.verify(slots, [streams[i][pos[i] : pos[i] + lens[i]] for i in range(2)])
        for i in range(2):
            torch.testing.assert_close(out.window_logits(i), refs[i][pos[i] : pos[i] + lens[i]], atol=TOL, rtol=0)
        acc = [int(torch.randint(1, n + 1, (1,), generator=rng)) for n in lens]
        eng.commit(acc)
        pos = [p + a for p, a in zip(pos, acc)]
        assert [eng.length(s) for s in slots] == pos


def test_verify_then_commit_equals_plain_decoding_to_fp32_rounding(rng, seed):
    """fold's verify runs the same recurrence as plain decoding: after any accepted
    prefix, every window position's logits equal the plain path's to fp32 rounding.
    Not bit for bit: the CPU GEMM blocks a 4-row product differently from a 1-row one
    (measured: differences of a few ulp of the logits' scale); greedy token equality
    over long runs is checked by the generator tests."""
    model = build_tiny_model("qwen3_5", seed=seed)
    stream = torch.randint(0, 256, (50,), generator=rng).tolist()
    plain = HybridEngine(model, strategy="fold", num_slots=1, window=1, max_len=64)
    ps = plain.alloc()
    plain_logits = [plain.extend([ps], [stream[:5]]).logits[0]]
    for t in range(5, 50):
        plain_logits.append(plain.extend([ps], [[stream[t]]]).logits[0])
    eng = HybridEngine(model, strategy="fold", num_slots=1, window=4, max_len=64)
    s = eng.alloc()
    eng.extend([s], [stream[:5]])
    pos = 5
    while pos + 4 <= 50:
        out = eng.verify([s], [stream[pos : pos + 4]])
        for j in range(4):
            ref = plain_logits[pos - 4 + j]
            scale = float(ref.abs().max())
            torch.testing.assert_close(out.logits[j], ref, rtol=0, atol=1e-5 * scale)
        a = int(torch.randint(1, 5, (1,), generator=rng))
        eng.commit([a])
        pos += a


def test_step_protocol_and_validation(seed):
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="circular", num_slots=2, window=3, max_len=20)
    s = eng.alloc()
    eng.extend([s], [[1, 2, 3]])
    with pytest.raises(RuntimeError, match="commit without a verify"):
        eng.commit([1])
    with pytest.raises(ValueError, match="not a token id"):
        eng.verify([s], [[1, 999]])
    with pytest.raises(ValueError, match="not a token id"):
        eng.verify([s], [[True]])
    with pytest.raises(ValueError, match="empty"):
        eng.verify([s], [[]])
    with pytest.raises(ValueError, match="window"):
        eng.verify([s], [[1, 2, 3, 4]])  # longer than the window
    with pytest.raises(ValueError, match="not allocated"):
        eng.verify([1], [[1]])
    with pytest.raises(ValueError, match="max_len"):
        eng.extend([s], [list(range(18))])
    assert eng.length(s) == 3  # nothing above touched the request
    eng.verify([s], [[4, 5]])
    with pytest.raises(RuntimeError, match="pending"):
        eng.verify([s], [[4, 5]])
    with pytest.raises(ValueError, match=r"accepted\[0\] = 3"):
        eng.commit([3])
    with pytest.raises(ValueError, match="entries"):
        eng.commit([1, 1])
    eng.commit([2])
    assert eng.length(s) == 5
    with pytest.raises(ValueError, match="prefill"):
        HybridEngine(model, prefill="fast")
    if _no_fla():  # an explicit chunked prefill without a kernel is an error, not a fallback
        with pytest.raises(ValueError, match="fla-core"):
            HybridEngine(model, prefill="chunk")


def _no_fla() -> bool:
    from replayssm.engine.adapter import load_chunk_kernel

    return load_chunk_kernel() is None


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prompt_prefill_plumbing(family, rng, seed):
    """The chunk-kernel path (layouts, shared key heads, final states into the checkpoints)
    agrees with the recurrence path, for the prompt and for the decoding after it."""
    model = build_tiny_model(family, seed=seed)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (23, 9)]
    tail = [torch.randint(0, 256, (6,), generator=rng).tolist() for _ in prompts]
    results = []
    for mode in ("recurrence", "chunk"):
        eng = HybridEngine(model, strategy="fold", num_slots=2, window=4, max_len=64, prefill=mode,
                           chunk_kernel=fake_chunk_kernel if mode == "chunk" else None)
        slots = [eng.alloc(), eng.alloc()]
        first = eng.extend(slots, prompts, all_logits=True, prompt=True).logits
        out = eng.verify(slots, [t[:4] for t in tail])
        results.append((first, out.logits))
    assert results[1][0].shape == results[0][0].shape
    torch.testing.assert_close(results[1][0], results[0][0], atol=TOL, rtol=0)
    torch.testing.assert_close(results[1][1], results[0][1], atol=TOL, rtol=0)


@pytest.mark.parametrize("strategy", ["snapshot", "fold", "circular"])
def test_chunked_kernel_continues_prompts_prefilled_in_parts(strategy, rng, seed):
    """A prompt prefilled in parts through the chunk kernel (each part after the first
    starts from the committed state: the kernel's initial state) gives the logits of
    the recurrence over the whole prompt at once, and the decoding after it agrees."""
    model = build_tiny_model("qwen3_5", seed=seed)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (21, 13)]
    tail = [torch.randint(0, 256, (3,), generator=rng).tolist() for _ in prompts]
    cut = [int(torch.randint(1, len(p), (1,), generator=rng)) for p in prompts]
    whole = HybridEngine(model, strategy=strategy, num_slots=2, window=4, max_len=64, prefill="recurrence")
    slots = [whole.alloc(), whole.alloc()]
    ref_first = whole.extend(slots, prompts, prompt=True).logits
    ref_next = whole.verify(slots, tail).logits
    calls = []

    def kernel(*args, initial_state, **kwargs):
        calls.append(initial_state is not None)
        return fake_chunk_kernel(*args, initial_state=initial_state, **kwargs)

    parts = HybridEngine(model, strategy=strategy, num_slots=2, window=4, max_len=64, prefill="chunk",
                         chunk_kernel=kernel)
    slots = [parts.alloc(), parts.alloc()]
    parts.extend(slots[:1], [prompts[0][: cut[0]]], prompt=True)  # request 0 alone, then both together
    assert not any(calls)
    first = parts.extend(slots, [prompts[0][cut[0]:], prompts[1]], prompt=True).logits
    assert all(calls[len(calls) // 2:]) and parts.length(slots[0]) == len(prompts[0])
    torch.testing.assert_close(first, ref_first, atol=TOL, rtol=0)
    torch.testing.assert_close(parts.verify(slots, tail).logits, ref_next, atol=TOL, rtol=0)


def test_prompt_kernel_gets_one_offsets_tensor_per_pass(seed, rng):
    """Every GDN layer of a prompt pass hands the kernel the same ``cu_seqlens`` tensor
    (fla-core caches what it derives from it, through a host read, by identity), and a
    kernel that takes ``cu_seqlens_cpu`` gets the host copy."""
    model = build_tiny_model("qwen3_5", seed=seed)
    seen = []

    def kernel(*args, cu_seqlens, cu_seqlens_cpu=None, **kwargs):
        seen.append((cu_seqlens, cu_seqlens_cpu))
        return fake_chunk_kernel(*args, cu_seqlens=cu_seqlens, **kwargs)

    eng = HybridEngine(model, strategy="fold", num_slots=3, window=2, max_len=64, prefill="chunk", chunk_kernel=kernel)
    lengths = [int(x) for x in torch.randint(1, 20, (3,), generator=rng)]
    eng.extend([eng.alloc() for _ in lengths], [list(range(n)) for n in lengths], prompt=True)
    gdn_layers = sum(kind == "gdn" for kind in eng.kinds)
    assert len(seen) == gdn_layers > 1
    assert all(cu is seen[0][0] for cu, _ in seen)
    cu = [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert seen[0][0].tolist() == cu and seen[0][1].device.type == "cpu" and seen[0][1].tolist() == cu


def test_save_and_restore_state(rng, seed):
    """Scratch decoding undone by restore_state leaves no trace (the draft model's
    rollback)."""
    model = build_tiny_model("qwen3_next", seed=seed)
    eng = HybridEngine(model, strategy="snapshot", num_slots=2, window=1, max_len=64)
    a, b = eng.alloc(), eng.alloc()
    eng.extend([a, b], [torch.randint(0, 256, (9,), generator=rng).tolist(), [5, 6]])
    probe = torch.randint(0, 256, (3,), generator=rng).tolist()
    buffers = {k: v.clone() for k, v in eng.pool.buffers.items()}
    saved = eng.save_state([a])
    for t in probe:
        eng.extend([a], [[t]])
    assert not torch.equal(eng.pool.buffers["checkpoints"], buffers["checkpoints"])
    eng.restore_state(saved)
    for k, v in buffers.items():
        assert torch.equal(eng.pool.buffers[k].nan_to_num(7.0), v.nan_to_num(7.0)), k
    assert eng.length(a) == 9
    # circular keeps history in its ring: save/restore covers ring and cursors too
    circ = HybridEngine(model, strategy="circular", num_slots=1, window=2, max_len=32)
    c = circ.alloc()
    circ.extend([c], [probe])
    circ.verify([c], [[1, 2]])
    circ.commit([2])
    def committed():  # the logical state: checkpoint + history, conv state, cursors (not scratch)
        layers = range(circ.pool.num_layers)
        return ([circ.strategy.committed_state(j, [c]) for j in layers],
                circ.pool.buffers["conv_state"].clone(), circ.pool.buffers["write_pos"].clone())

    before = committed()
    saved = circ.save_state([c])
    circ.verify([c], [[3, 4]])
    circ.commit([2])
    assert not torch.equal(committed()[0][0], before[0][0])
    circ.restore_state(saved)
    after = committed()
    assert all(torch.equal(x, y) for x, y in zip(after[0], before[0]))
    assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])
    assert circ.length(c) == 5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ["snapshot", "fold"])
def test_fixed_shapes_make_plain_and_verify_logits_bitwise_equal(family, strategy, rng, seed):
    """With ``fixed_shape`` every token-wise matmul and the attention run on the same
    shapes whatever the step holds, so an exact strategy's verify logits equal plain
    decoding's bit for bit (what the GPU bf16 exactness tests rely on)."""
    model = build_tiny_model(family, seed=seed)
    streams = [torch.randint(0, 256, (40,), generator=rng).tolist() for _ in range(2)]
    fixed = (2 * 4, 4)
    plain = HybridEngine(model, strategy=strategy, num_slots=2, window=1, max_len=64, fixed_shape=fixed)
    ps = [plain.alloc(), plain.alloc()]
    plain.extend(ps, [s[:6] for s in streams])
    ref = [[None] * 6 for _ in streams]
    for t in range(6, 40):
        out = plain.extend(ps, [[s[t]] for s in streams])
        for i in range(2):
            ref[i].append(out.logits[i])
    eng = HybridEngine(model, strategy=strategy, num_slots=2, window=4, max_len=64, fixed_shape=fixed)
    slots = [eng.alloc(), eng.alloc()]
    eng.extend(slots, [s[:6] for s in streams])
    pos = [6, 6]
    while max(pos) + 4 <= 40:
        lens = torch.randint(1, 5, (2,), generator=rng).tolist()
        out = eng.verify(slots, [streams[i][pos[i] : pos[i] + lens[i]] for i in range(2)])
        for i in range(2):
            for j in range(lens[i]):
                assert torch.equal(out.window_logits(i)[j], ref[i][pos[i] + j]), (i, pos[i] + j)
        acc = [int(torch.randint(1, n + 1, (1,), generator=rng)) for n in lens]
        eng.commit(acc)
        pos = [p + a for p, a in zip(pos, acc)]
    # and the fixed shapes change no value beyond rounding
    free = HybridEngine(model, strategy=strategy, num_slots=1, window=1, max_len=64)
    s = free.alloc()
    out = free.extend([s], [streams[0][:10]], all_logits=True)
    torch.testing.assert_close(out.logits[-1], ref[0][9], atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="fixed_shape"):
        HybridEngine(model, fixed_shape=(4,))


def test_free_many_resets_the_kv_lengths_of_every_slot(rng, seed):
    """Slots freed several at a time: every freed slot's KV length is 0 on the
    host and on the device, the others keep theirs; a free list with a slot named twice
    frees nothing (lengths and pool as they were)."""
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=4, window=2, max_len=32)
    slots = [eng.alloc() for _ in range(3)]
    lens = [3, 5, 2]
    with torch.inference_mode():
        eng.extend(slots, [torch.randint(0, 64, (n,), generator=rng).tolist() for n in lens], prompt=True)
    assert eng.kv.device_lengths[:3].tolist() == lens
    with pytest.raises(ValueError, match="double free"):
        eng.free_many([slots[0], slots[0]])
    assert [eng.length(s) for s in slots] == lens and eng.pool.num_free == 1
    eng.free_many([slots[2], slots[0]])
    assert [eng.length(s) for s in slots] == [0, 5, 0]
    assert eng.kv.device_lengths[:3].tolist() == [0, 5, 0]
    assert eng.pool.live_slots == [1] and [eng.alloc() for _ in range(3)] == [3, 2, 0]


def test_alloc_many_empties_the_kv_lengths_of_the_slots_it_takes(rng, seed):
    """Slots taken several at a time come with empty KV lengths on the host and the
    device, whatever their last request left; the others keep theirs."""
    model = build_tiny_model("qwen3_5", seed=seed)
    eng = HybridEngine(model, strategy="fold", num_slots=4, window=2, max_len=32)
    slots = eng.alloc_many(3)
    lens = [3, 5, 2]
    with torch.inference_mode():
        eng.extend(slots, [torch.randint(0, 64, (n,), generator=rng).tolist() for n in lens], prompt=True)
    eng.pool.free_many([slots[0], slots[2]])  # the pool's free only: the KV lengths stay behind
    assert eng.kv.device_lengths[:3].tolist() == lens
    assert eng.alloc_many(3) == [3, slots[0], slots[2]]
    assert [eng.length(s) for s in range(4)] == [0, 5, 0, 0]
    assert eng.kv.device_lengths.tolist()[:4] == [0, 5, 0, 0]
