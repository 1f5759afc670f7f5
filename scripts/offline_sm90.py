"""Compile the state kernels for sm_90 without a GPU and report what the compiler made.

For each launch of the chosen ops at Qwen3.5 shapes (``H=16, HV=32, K=V=128``) this
prints the kernel, its tile constants, registers a thread and its stack frame (where
spilled values go; both from ``cuobjdump -res-usage``), the blocked layouts Triton gave
it, its layout conversions, its SASS instruction count (static, from ``nvdisasm``;
``--sass`` adds its histogram and each loop body's) and the instructions of each loop's
trip (a replay's per-record loop, the products' K pipeline). That is how BENCHMARKS.md's
"offline sm_90" register and instruction counts are read, and how a table row or a
kernel change can be checked for spills before device time is spent on it.

    pip install --target DIR triton==3.6.0       # the card's compiler; it ships cuobjdump, nvdisasm
    PYTHONPATH=DIR:src python3 scripts/offline_sm90.py --ops recurrence,fold [--window 8] \\
        --state-dtype bfloat16 [--batch 256] [--tune exact_read_only.block_v=128] [--sass]

How: the ops run on CPU tensors through their real launchers; each ``kernel[grid](...)``
is compiled (``JITFunction.run(warmup=True)``) against a stand-in driver that names an
sm_90 target, so the launch's own specialisation (pointer alignment, stride
divisibility) reaches the compiler, and nothing runs. Tile heights are the shape
table's at ``--batch``, without the halving that small batches get on a real GPU
(``triton_common.block_rows`` counts the card's SMs); register caps and programmatic
dependent launches apply as on an sm_90 card.

Not for timing: registers and instruction counts predict occupancy and issue, and the
device decides (BENCHMARKS.md records where they disagreed).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import inspect
import itertools
import os
import re
import struct
import subprocess
import sys
import tempfile
from collections import Counter

OPS = ("recurrence", "fold", "ring_decode", "closed_form", "tree_recurrence", "conv_prefill", "conv_verify", "norms", "rotary",
       "attention", "argmax", "step_inputs", "normed_linear", "guards")
H, HV, K, V, T, L = 16, 32, 128, 128, 4, 16
WINDOW = T  # --window's default (T and L change with each command line's window)
#: Imported by :func:`install`, once the command line is read: they take seconds, and a
#: usage error or the SASS readers below need neither.
torch = triton = None


def _tool(name: str) -> str:
    """The path of one of the CUDA tools that the Triton wheel ships."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


class _Sm90Driver:
    """Enough of a CUDA driver for ``JITFunction.run`` to compile for sm_90."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


LAUNCHES: list[tuple[str, dict, object]] = []
_run = None  # JITFunction.run as Triton defines it


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    LAUNCHES.append((self.fn.__name__, kwargs, kernel))
    return kernel


def install() -> None:
    """Import torch and Triton, route every launch to the compiler, and let the ops take
    CPU tensors. (Called again in the same process, it changes nothing more.)"""
    global torch, triton, _run
    os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be defined for compiling
    import torch
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Sm90Driver())
    if _run is None:
        _run = JITFunction.run
        JITFunction.run = _compile_only
    # Every module with kernels, imported (so its kernels and helpers are defined for
    # compiling) before the flags below are set.
    from replayssm import ops  # noqa: F401
    from replayssm.engine import attention, norms, rotary  # noqa: F401
    try:
        from replayssm.engine import argmax, step_inputs  # noqa: F401  (a tree before them has neither)
        from replayssm.engine import normed_linear  # noqa: F401
    except ImportError:
        argmax = None

    def full_height(vd, rows, device, most, least=1):
        return max(least, min(most, triton.next_power_of_2(vd)))

    def cap(max_registers, device):
        return {"maxnreg": max_registers} if max_registers else {}

    def sm90_dependent_launch(device):  # as on the card: sm_90 launches programmatic dependents
        return True

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("replayssm"):
            if hasattr(mod, "block_rows"):
                mod.block_rows = full_height
            if hasattr(mod, "register_cap"):  # the table's caps apply on CUDA only
                mod.register_cap = cap
            if hasattr(mod, "dependent_launch"):  # read off the device on CUDA
                mod.dependent_launch = sm90_dependent_launch
            # The launchers send CPU tensors to Triton only under the interpreter (each
            # module's copy of the flag); the kernels were defined for compiling (checked
            # at import, above).
            if hasattr(mod, "INTERPRETER"):
                mod.INTERPRETER = True
    # The argmax's launch splits rows into parts when programs are few: count an H100's SMs.
    for mod in (argmax,):
        if mod is not None and hasattr(mod, "sm_count"):
            mod.sm_count = lambda device: 132


#: In an nvdisasm listing (as ``cuobjdump -sass`` prints it): a SASS line's address; its
#: address and opcode (its predicate skipped); a branch's address and target.
_ADDRESS = r"/\*([0-9a-f]{4,})\*/"
_OP = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+ )?([A-Z0-9_]+)"
_BRANCH = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+ )?BRA (?:\S+, )?0x([0-9a-f]+)"


def _instructions(cubin: bytes) -> bytes:
    """A cubin's instructions: its executable sections' bytes (an ELF64's section
    headers read directly), in section order."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    size, count = struct.unpack_from("<HH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * size) for i in range(count)]
    return b"".join(cubin[offset:offset + n] for _, _, flags, _, offset, n in headers if flags & 0x4)  # SHF_EXECINSTR


def _listings(cubins: list[bytes]) -> list[str]:
    """Each cubin's SASS listing, from one disassembler run over all their instructions
    laid end to end: ``nvdisasm`` (which ``cuobjdump -sass`` runs a cubin) takes about a
    second to start, whatever it reads, and a run compiles tens of kernels. A listing's
    addresses are the concatenation's, its cubin's plus a constant; what is read off them
    (opcodes, the distance from a backward branch to its target) is the same."""
    texts = [_instructions(c) for c in cubins]
    with tempfile.TemporaryDirectory() as d:
        raw = os.path.join(d, "sass.bin")
        with open(raw, "wb") as f:
            f.write(b"".join(texts))
        # sm_90a: what Triton compiles a capability-90 target to (the driver above names one)
        dump = subprocess.run([_tool("nvdisasm"), "-b", "SM90a", "-novliw", raw],
                              capture_output=True, text=True, check=True).stdout
    ends = list(itertools.accumulate(len(t) for t in texts))
    listings = [[] for _ in texts]
    for line in dump.splitlines():
        if m := re.search(_ADDRESS, line):
            listings[bisect.bisect_right(ends, int(m.group(1), 16))].append(line)
    return ["\n".join(lines) for lines in listings]


def compiled(kernels: list) -> list[dict]:
    """Registers, stack frame (where spills go) and SASS of each compiled kernel, read off
    the cubins the compiler made (cuobjdump, nvdisasm)."""
    reports = []
    for kernel, dump in zip(kernels, _listings([k.asm["cubin"] for k in kernels])):
        with tempfile.TemporaryDirectory() as d:  # (cuobjdump reads usage without the disassembler: milliseconds)
            cubin = os.path.join(d, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(kernel.asm["cubin"])
            usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin],
                                   capture_output=True, text=True, check=True).stdout
        ops = [m.group(2) for m in re.finditer(_OP, dump)]
        ttgir = kernel.asm["ttgir"]
        reports.append(dict(registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                            stack_bytes=int(re.search(r"STACK:(\d+)", usage).group(1)),
                            layouts=sorted(set(re.findall(r"#ttg\.blocked<\{([^}]*)\}>", ttgir))),
                            conversions=ttgir.count("ttg.convert_layout"), instructions=len(ops), loops=_loops(dump),
                            histogram=Counter(ops).most_common(16),
                            loop_histograms=[h.most_common(16) for h in _loop_histograms(dump)]))
    return reports


def _backward_branches(dump: str) -> list[tuple[int, int]]:
    """``(target, branch)`` addresses of each backward branch, in order: a loop's body."""
    return [(int(target, 16), int(at, 16)) for at, target in re.findall(_BRANCH, dump) if int(target, 16) < int(at, 16)]


def _loop_histograms(dump: str) -> list[Counter]:
    """Each loop body's opcodes (:func:`_loops`' bodies), counted: where a trip's
    instructions go (a replay's state arithmetic against its key's load and norm)."""
    ops = [(int(at, 16), op) for at, op in re.findall(_OP, dump)]
    return [Counter(op for at, op in ops if lo <= at <= hi) for lo, hi in _backward_branches(dump)]


def _loops(dump: str) -> list[int]:
    """Instructions of each loop body in a cuobjdump SASS listing, in order: from a
    backward branch's target to the branch (16 bytes an instruction on sm_90). A loop's
    trip costs its body's issue, so this is what a change to a per-record or per-token
    loop moves."""
    return [(hi - lo) // 16 + 1 for lo, hi in _backward_branches(dump)]


def _acts(n, act):
    return dict(q=torch.randn(n, H, K).to(act), k=torch.randn(n, H, K).to(act), v=torch.randn(n, HV, V).to(act),
                a=torch.randn(n, HV).to(act), b=torch.randn(n, HV).to(act), A_log=-torch.rand(HV) - 0.3,
                dt_bias=torch.randn(HV) * 0.5)


def _states(*rows: int, dtype: torch.dtype) -> torch.Tensor:
    """State tiles ``(*rows, HV, V, K)``, unwritten: a launch here compiles and nothing
    reads a value, and drawing a batch of 256 states (134 M numbers) at random takes
    seconds of a run."""
    return torch.empty(*rows, HV, V, K, dtype=dtype)


def _ring_case(batch, t, sdt, act, keys):
    """Circular's buffers: random cursors, about half the rows flushing, and histories
    unwritten (as the states, :func:`_states`: tens of millions of values nothing reads);
    the ring's keys in ``keys`` (float32: normalised, as a pool keeps them; 16-bit: raw)."""
    from replayssm.ops import RawRecords

    x = _acts(batch * t, act)
    ring = RawRecords(torch.empty(batch, L, H, K, dtype=keys), torch.empty(batch, L, HV, V, dtype=act),
                      -torch.rand(batch, L, HV) - 0.02, torch.rand(batch, L, HV))
    cursors = (torch.arange(batch, dtype=torch.int32), torch.arange(0, batch * t + 1, t, dtype=torch.int32),
               torch.randint(0, L - t + 1, (batch,), dtype=torch.int32), torch.randint(0, L, (batch,), dtype=torch.int32),
               (torch.rand(batch) < 0.5).to(torch.int32))
    ckpt = _states(batch, dtype=sdt)
    return x, ckpt, ring, torch.empty(batch, L, HV, V), cursors


def _set_window(t: int) -> None:
    """The verify ops' window ``T`` and the ring they read, ``L = max(16, 4 T)`` (the
    benchmarks' rings: 16 records at T = 4, 32 at T = 8)."""
    global T, L
    T, L = t, max(16, 4 * t)


def run_op(op: str, batch: int, sdt: torch.dtype, act: torch.dtype,
           ring_keys: torch.dtype | None = None) -> list[str]:
    """Launch ``op``'s kernels once; return a label per launch. ``ring_keys``: the dtype
    of every ring's keys (``ops.records.keys_normalized``; float32 by default)."""
    from replayssm.ops import RawRecords, gdn_chunked_window, gdn_fold
    from replayssm.ops.recurrent import gdn_recurrence_triton
    from replayssm.ops.ring_decode import gdn_ring_decode

    ring_keys = torch.float32 if ring_keys is None else ring_keys

    labels = []
    if op == "recurrence":
        slots = torch.arange(batch, dtype=torch.int32)
        state = _states(batch, dtype=sdt)
        for mode in ("decode", "fold verify", "snapshot verify"):
            t = 1 if mode == "decode" else T
            x = _acts(batch * t, act)
            kw = dict(update_state=True) if mode == "decode" else {}
            if mode == "fold verify":
                kw["records"] = RawRecords(torch.empty(batch, t, H, K, dtype=ring_keys), torch.empty(batch, t, HV, V, dtype=act),
                                           torch.empty(batch, t, HV), torch.empty(batch, t, HV))
            if mode == "snapshot verify":
                kw["snapshots"] = torch.empty(batch, t, HV, V, K, dtype=sdt)
            gdn_recurrence_triton(*x.values(), state, slots, torch.arange(0, batch * t + 1, t, dtype=torch.int32),
                                  max_len=t, **kw)
            labels.append(f"{mode}, T={t}")
    elif op == "fold":
        n = 3  # records folded per slot, as a fold commit of 3 accepted tokens
        ck = _states(2, batch, dtype=sdt)
        gdn_fold(ck, torch.randn(2, batch, T, H, K).to(ring_keys), torch.randn(2, batch, T, HV, V).to(act),
                 -torch.rand(2, batch, T, HV), torch.rand(2, batch, T, HV), torch.arange(batch, dtype=torch.int32),
                 torch.zeros(batch, dtype=torch.int32), torch.full((batch,), n, dtype=torch.int32), backend="triton")
        labels.append(f"fold commit, {n} records")
    elif op == "ring_decode":
        x, ckpt, ring, ring_u, cursors = _ring_case(batch, 1, sdt, act, ring_keys)
        gdn_ring_decode(*x.values(), ckpt, ring, ring_u, *cursors, backend="triton")
        labels += [f"plain step through a ring of {L}"] * (len(LAUNCHES) - len(labels))
    elif op == "tree_recurrence":
        from replayssm.ops import DraftTrees
        from replayssm.ops.tree_ops import gdn_tree_recurrence

        trees = DraftTrees.from_branching((3, 2, 1), batch=batch)
        n = trees.batch * trees.max_nodes
        x = _acts(n, act)
        state = _states(batch, dtype=sdt)
        rec = RawRecords(torch.empty(batch, trees.max_nodes, H, K, dtype=ring_keys),
                         torch.empty(batch, trees.max_nodes, HV, V, dtype=act),
                         torch.empty(batch, trees.max_nodes, HV), torch.empty(batch, trees.max_nodes, HV))
        for method in ("stack", "paths"):
            gdn_tree_recurrence(*x.values(), state, torch.arange(batch, dtype=torch.int32), trees, records=rec,
                                method=method, backend="triton")
            labels.append(f"fold's verify of a 3,2,1 tree, {method}")
    elif op == "closed_form":
        x, ckpt, ring, ring_u, cursors = _ring_case(batch, T, sdt, act, ring_keys)
        gdn_chunked_window(*x.values(), ckpt, ring, ring_u, *cursors, max_len=T, method="closed_form", backend="triton")
        labels += [f"closed form T={T}, L={L}"] * (len(LAUNCHES) - len(labels))
    elif op == "conv_prefill":  # a prompt pass's causal conv: q|k|v channels, planar outputs, the state advanced
        from replayssm.ops.conv import causal_conv_verify_triton

        c, w, p = 2 * H * K + HV * V, 4, 2048
        rows = 3
        causal_conv_verify_triton(torch.randn(rows * p, c).to(act), torch.randn(rows, c, w - 1).to(act),
                                  torch.randn(c, w).to(act), None, torch.arange(rows, dtype=torch.int32),
                                  torch.arange(0, rows * p + 1, p, dtype=torch.int32), update_state=True, max_len=p,
                                  parts=(H * K, H * K, HV * V))
        labels.append(f"prompt conv, {rows} x {p} tokens")
    elif op == "conv_verify":  # a verify window's conv: the window buffer and commit, then the conv ring
        from replayssm.ops.conv import causal_conv_commit_triton, causal_conv_verify_triton, conv_ring_commit_triton

        c, w, rows = 2 * H * K + HV * V, 4, batch
        x, weight = torch.randn(rows * T, c).to(act), torch.randn(c, w).to(act)
        slots, cu = torch.arange(rows, dtype=torch.int32), torch.arange(0, rows * T + 1, T, dtype=torch.int32)
        state = torch.randn(rows, w - 1, c).to(act).transpose(1, 2)
        causal_conv_verify_triton(x, state, weight, None, slots, cu, window_buf=torch.randn(rows, T, c).to(act))
        causal_conv_commit_triton(state[None], torch.randn(1, rows, T, c).to(act), slots, slots)
        r = triton.next_power_of_2(T + w - 1)
        pos = torch.zeros(rows, dtype=torch.int32)
        causal_conv_verify_triton(x, torch.randn(rows, r, c).to(act).transpose(1, 2), weight, None, slots, cu,
                                  ring_pos=pos, max_len=T)
        conv_ring_commit_triton(pos, slots, slots)
        labels += [f"conv verify T={T}", "conv commit", f"conv verify T={T} on a ring of {r}", "conv ring commit"]
    elif op == "norms":  # the engine's RMS norms at the embedded model's batch-1 shapes (hidden 256, heads 4 + 2 of 64)
        from replayssm.engine import norms

        q, k, w = torch.randn(1, 4, 64).to(act), torch.randn(1, 2, 64).to(act), torch.randn(64)
        norms.rms_norm(q, w, 1e-6, "offset")
        labels.append("offset norm, 4 rows of 64")
        h = torch.randn(1, 256).to(act)
        norms.add_rms_norm(h, h.clone(), torch.randn(256), 1e-6)
        labels.append("residual add and norm, 1 row of 256")
        if hasattr(norms, "rms_norm_pair"):  # (a tree before it, in a before-and-after run, has none)
            qk = torch.empty(1, 6, 64, dtype=act)
            norms.rms_norm_pair(q, w, 1e-6, qk[:, :4], k, w, 1e-6, qk[:, 4:])
            labels.append("query and key norms in one launch, 4 + 2 rows of 64")
            pair = torch.empty(1, 512, dtype=act)
            norms.rms_norm_pair(torch.randn(4096, 256).to(act), torch.randn(256), 1e-6, pair[:, :256], h,
                                torch.randn(256), 1e-6, pair[:, 256:], rows=torch.tensor([7]))
            labels.append("an embedding row and a hidden row normed in one launch, 256 wide")
    elif op == "rotary":  # the attention layers' rotary at the embedded model's batch-1 shapes (4 + 2 heads of 64)
        from replayssm.engine import rotary

        qk, rope = torch.randn(1, 1, 6, 64).to(act), torch.randn(1, 1, 2, 16).to(act)
        rotary.rotate_(qk, rope, backend="triton")
        labels.append("rotary of 4 + 2 heads of 64, 16 channels")
        if hasattr(rotary, "rotate_into_cache_"):  # (a tree before it, in a before-and-after run, has none)
            cache = torch.empty(2, 4, 2, 256, 64, dtype=act)
            rotary.rotate_into_cache_(qk, rope, torch.randn(1, 1, 2, 64).to(act), cache[0], cache[1],
                                      torch.tensor([1]), torch.tensor([[7]]))
            labels.append("rotary and the keys and values into the cache, one launch")
    elif op == "attention":  # the window attention at the embedded model's shapes (4 query heads, 2 key heads of 64)
        from replayssm.engine import attention

        q, cache = torch.randn(80, 4, 4, 64).to(act), torch.randn(2, 4, 2, 256, 64).to(act)
        rows, starts = torch.ones(80, dtype=torch.int64), torch.full((80,), 9)
        attention.slot_attention(q, cache[0], cache[1], rows, starts, 0.125, backend="triton")
        labels.append("window attention, 4 tokens")
        if "gate" in inspect.signature(attention.slot_attention).parameters:  # (not in a tree before it)
            gate = torch.randn(320, 8, 64).to(act)[:, ::2]
            attention.slot_attention(q, cache[0], cache[1], rows, starts, 0.125, backend="triton", gate=gate)
            labels.append("window attention with its output gate, 4 tokens")
        if "key_split" in inspect.signature(attention.slot_attention).parameters:
            from replayssm.ops.triton_common import arrival_counters

            for t in (4, 1):
                attention.slot_attention(q[:, :t], cache[0], cache[1], rows, starts, 0.125, backend="triton",
                                         gate=gate[: 80 * t], key_split=64, arrivals=arrival_counters("cpu"))
                labels.append(f"window attention, keys split, parts merged in the launch, {t} token(s)")
    elif op == "argmax":  # greedy tokens: the embedded model's vocabulary at batch 16, a Qwen3.5 one at batch 1
        from replayssm.engine import argmax
        from replayssm.ops.triton_common import arrival_counters

        for rows, vocab in ((16, 4096), (1, 248320)):
            argmax.argmax_rows(torch.randn(rows, vocab).to(act))
            labels.append(f"argmax of {rows} x {vocab}")
        labels.append("the parts' bests merged")
        argmax.argmax_rows(torch.randn(4, 248320).to(act), arrivals=arrival_counters("cpu"))
        labels.append("argmax of 4 x 248320, the last part merging")
    elif op == "step_inputs":  # a chain step's inputs at Qwen3.5's shapes: 64 rows of 4 tokens, hidden 2048, 64 rotary
        from replayssm.engine import step_inputs

        windows, kv_len = torch.randint(0, 1000, (81, 4)), torch.randint(0, 100, (81,))
        step_inputs.gather_step_inputs(windows, kv_len, torch.arange(64), torch.randn(1000, 2048).to(act),
                                       torch.randn(512, 2, 64).to(act))
        labels.append("windows, lengths, positions, embedding and rotary rows of 64 x 4 tokens")
        if hasattr(step_inputs, "draft_inputs"):  # (not in a tree before it)
            out = torch.randint(0, 99, (64, 5))
            step_inputs.draft_inputs(out[:, 1:], out[:, 0], torch.randint(0, 400, (64, 4)),
                                     torch.randn(512, 2, 64).to(act), 2)
            labels.append("the MTP drafter's inputs after a step of 64 x 4 tokens, 2 later depths")
    elif op == "guards":  # the accepted counts' device check of a step of 64 rows (a strided int64 column)
        from replayssm.ops import guards

        out = torch.randint(1, 4, (64, 5))
        guards.clamp_accepted(torch.arange(64), out[:, 0], torch.full((64,), 4, dtype=torch.int32), backend="triton")
        labels.append("the accepted counts clamped and checked, 64 rows")
    elif op == "normed_linear":  # the embedded MTP head's passes at batch 1 (a depth) and 16 (an update of 4)
        from replayssm.ops.triton_common import arrival_counters
        from replayssm.engine.normed_linear import normed_linear

        h, inter, vocab = 256, 512, 4096
        for m in (1, 64):
            x, table = torch.randn(m, h).to(act), torch.randn(vocab, h).to(act)
            g = (torch.randn(h).to(act), 1e-6)
            ids = torch.randint(0, vocab, (m,))
            normed_linear(table, torch.randn(h, 2 * h).to(act), norm=g, pair=(x, *g), rows=ids)
            normed_linear(x, torch.randn(768, h).to(act), norm=g)
            normed_linear(x, torch.randn(h, h).to(act), output="residual", residual=x)
            normed_linear(x, torch.randn(2 * inter, h).to(act), norm=g, output="glu")
            normed_linear(x, torch.randn(vocab, h).to(act), norm=g, rows=ids[: max(1, m // 4)] % 4, row_group=4,
                          output="argmax", normed_out=torch.empty(max(1, m // 4), h).to(act))
            normed_linear(x, torch.randn(vocab, h).to(act), norm=g, rows=ids[: max(1, m // 4)] % 4, row_group=4,
                          output="argmax", normed_out=torch.empty(max(1, m // 4), h).to(act),
                          arrivals=arrival_counters("cpu"))
            labels += [f"{m} rows: fc with the lookup and both norms", "q|gate|k|v with the input norm",
                       "o_proj with the residual add", "gate|up with the norm and SiLU's product",
                       "the LM head with the final norm and the argmax", "the argmax's blocks merged",
                       "the LM head, the last program merging"]
    return labels


def _parser() -> argparse.ArgumentParser:
    """The command line's options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {','.join(OPS)} (default all)")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--act-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--batch", type=int, default=256, help="requests, for the shape table's lookups (default 256)")
    p.add_argument("--tune", action="append", default=[], metavar="FAMILY.PARAM=VALUE",
                   help="override a shape-table entry (repeatable), as bench kernels --tune")
    p.add_argument("--chained", action="store_true",
                   help="launch the engine's kernels as a chain (triton_common.chained_launches), as the MTP head's "
                        "passes do")
    p.add_argument("--sass", action="store_true",
                   help="also print each kernel's 16 commonest SASS instructions, and each loop body's")
    p.add_argument("--ring-keys", choices=("float32", "act"), default="float32",
                   help="dtype of the rings' keys: float32 (default), normalised as a pool keeps them; act, raw in "
                        "the activations' dtype as an engine's own 16-bit rings (SGLang's layout)")
    p.add_argument("--window", type=int, default=WINDOW, metavar="T",
                   help=f"draft window of the verify ops (default {WINDOW}; the ring holds 4 T records, at least 16)")
    return p


def _launches(args: argparse.Namespace) -> list[tuple[str, str, dict, object]]:
    """Compile the launches of one command line's ops: ``(label, kernel name, its
    arguments, the compiled kernel)`` each, in launch order."""
    from replayssm.ops import tuning

    _set_window(args.window)
    launches = []
    with contextlib.ExitStack() as stack:
        if args.chained:
            from replayssm.ops.triton_common import chained_launches

            stack.enter_context(chained_launches(torch.device("cuda")))
        for item in args.tune:
            name, _, value = item.partition("=")
            family, _, param = name.partition(".")
            stack.enter_context(tuning.override(family, **{param: int(value)}))
        sdt, act = getattr(torch, args.state_dtype), getattr(torch, args.act_dtype)
        for op in args.ops.split(","):
            first = len(LAUNCHES)
            labels = run_op(op, args.batch, sdt, act, act if args.ring_keys == "act" else torch.float32)
            launches += [(label, name, kw, kernel) for (name, kw, kernel), label in zip(LAUNCHES[first:], labels)]
    return launches


def _report(launches: list, found: list[dict], sass: bool) -> str:
    """One command line's report: a line a launch, then its loops, layouts and (``sass``)
    opcode histograms, indented."""
    out = []
    for (label, name, kw, _), c in zip(launches, found):
        consts = " ".join(f"{k}={v}" for k, v in kw.items()
                          if k in ("BV", "BK", "T", "num_warps", "LOAD_AHEAD", "EARLY_TILE", "FUSE_FLUSH",
                                   "BT", "U", "BC", "CHAINED"))
        out.append(f"{label}: {name} [{consts}] {c['registers']} registers, {c['stack_bytes']} bytes of stack, "
                   f"{c['instructions']} SASS instructions, {c['conversions']} layout conversions")
        if c["loops"]:
            out.append("    loops (instructions a trip): " + ", ".join(str(n) for n in c["loops"]))
        out += [f"    layout {{{lay}}}" for lay in c["layouts"]]
        if sass:
            if c["histogram"]:
                out.append("    " + ", ".join(f"{o} {n}" for o, n in c["histogram"]))
            out += [f"    loop {i + 1}: " + ", ".join(f"{o} {n}" for o, n in h)
                    for i, h in enumerate(c["loop_histograms"])]
    return "".join(line + "\n" for line in out)


def reports(command_lines: list[list[str]]) -> list[str]:
    """What :func:`main` prints for each of ``command_lines`` (argument lists), the lines
    run one after another in this process: torch's and Triton's imports are paid once and
    one disassembler run reads every line's kernels. A usage error in any line exits (2)
    before anything compiles."""
    p = _parser()
    parsed = [p.parse_args(argv) for argv in command_lines]
    for args in parsed:
        if not 1 <= args.window <= 16:
            p.error(f"--window: must be in 1..16 (the closed form's bound), got {args.window}")
        bad = [o for o in args.ops.split(",") if o not in OPS]
        if bad:
            p.error(f"--ops: unknown {bad}; known: {', '.join(OPS)}")
    install()
    if not triton.__version__.startswith("3.6"):
        print(f"note: Triton {triton.__version__}; the H200's is 3.6.0, whose counts BENCHMARKS.md quotes",
              file=sys.stderr)
    runs = [_launches(args) for args in parsed]
    found = iter(compiled([kernel for launches in runs for *_, kernel in launches]))
    return [_report(launches, [next(found) for _ in launches], args.sass) for launches, args in zip(runs, parsed)]


def main(argv: list[str] | None = None) -> int:
    """Print the report of the command line ``argv`` (``sys.argv[1:]`` by default)."""
    print(reports([sys.argv[1:] if argv is None else argv])[0], end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
