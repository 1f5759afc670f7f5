"""Launch parameters of the Triton kernels, looked up by shape in one table.

Each kernel family has a list of rows ``(key, params)``; :func:`lookup` returns the
``params`` of the first row whose key matches the call, so specific rows go before the
catch-all row that ends every list. A key names any of

    K, V          head dimensions (ints)
    state_dtype   the checkpoint's dtype (``torch.float32`` / ``torch.bfloat16``)
    min_batch, max_batch   the windows (requests) of the call, inclusive bounds
    device        the device type (``"cuda"``, ``"cpu"``; CPU runs are the Triton
                  interpreter's correctness runs)

and a missing field matches anything. This replaces per-knob environment variables:
the values live next to the shapes they were measured at (BENCHMARKS.md, tuning notes:
all at Qwen3.5 shapes, ``K = V = 128``), and a tuning run changes them for a block of
code with :func:`override` (``scripts/gpu_profile_ops.py --variants``).

Block heights are upper bounds: :func:`~replayssm.ops.triton_common.block_rows` still
halves them while a call would not fill the GPU, and rows are independent, so no entry
changes any number a kernel computes (the exact kernels' ``BK`` and warps are fixed by
the exactness rule in :mod:`~replayssm.ops.triton_common` and are not in the table).
"""

from __future__ import annotations

import contextlib

import torch

#: Families and the parameters each one takes.
PARAMS = {
    # Exact kernels that write states (snapshots, state updates, the fold and the flush):
    # tall enough to amortise a token's key loads and normalisation over many rows, short
    # enough to keep the four-part tile in registers.
    # ``records_ahead``: how many records the exact replay (the fold; ops/fold.py
    # ``replay_history``) loads ahead of its step, 1 or 2. ``num_warps``: 4, 8 on
    # tiles of 64+ rows, or 1 or 2 (the warps stack along V; triton_common.exact_warps).
    # ``load_ahead``: whether the recurrence kernel loads the next token's inputs during
    # this token's step (1: latency hidden inside the program, a second token's inputs
    # in registers) or at the step's start (0: fewer registers, more programs an SM).
    "exact_write": ("block_v", "records_ahead", "num_warps", "load_ahead"),
    # The writing verify that stores a snapshot of the state after every token
    # (snapshot's): its tile, warps and ``load_ahead`` as exact_write's, apart because
    # its T stores a token change which shape is fastest.
    "exact_snapshot": ("block_v", "num_warps", "load_ahead"),
    # The read-only exact verify: no state to write back, so a taller tile holds fewer
    # live registers per row and amortises the per-token loads further.
    "exact_read_only": ("block_v", "num_warps", "load_ahead"),
    # circular's closed form (ops/chunked.py). Its outputs kernel: rows of V per program,
    # columns of K per step of its pass over the checkpoint, pipeline stages of that
    # pass, warps, and whether its small products with the coefficients run on tensor
    # cores (tf32) when the activations are 16-bit (1) or as fp32 FMA (0). Its
    # coefficient kernel: warps, and value heads per program (those of one key head share
    # its K pass; capped at the GQA group). Its flush (the fold kernel on the flush rows):
    # tile height, which may differ from the fold's (rows are independent), and whether
    # the outputs kernel folds the flush rows itself (1: one read of their checkpoints;
    # the flush tile height then is the outputs kernel's) or a fold launch runs first (0),
    # and the flush's record prefetch depth (as exact_write.records_ahead). And whether
    # the outputs kernel is launched as the coefficient kernel's programmatic dependent
    # where the GPU allows it (1: it overlaps the coefficients; ops/chunked.py
    # launch_closed_form) or after it (0), and a cap on the outputs kernel's registers
    # per thread on CUDA (0: the compiler's choice; a cap trades spills for programs
    # per SM). ``early_tile`` (with fuse_flush): every row loads its whole checkpoint
    # tile into registers before its cursors (1: the loads overlap the cursors' and
    # a row that does not flush multiplies the tile as loaded) or streams it through
    # the k_chunk pipeline after them (0). ``short_tail`` (with fuse_flush): the grid in
    # batch order (0), or in an order that moves the last short_tail rows that do not
    # fold to its end (so no fold's chain starts in the last waves; at least the batch:
    # every folding row first).
    # ``num_warps``: 4 or 2 (a fold inside the kernel, the fused flush, goes through
    # triton_common.exact_warps, so its rows keep the exact kernels' layout and its
    # states their bits; on 1 warp they do not, beside this kernel's tensor-core
    # products: a GPU test).
    # ``coef_max_registers``: the coefficient kernel's register cap (as max_registers):
    # its programs are one warp each, so registers decide how many an SM holds, and
    # how many waves the batch's (request, key head) pairs take.
    # ``records_first``: a row of the outputs kernel that does not fold loads its
    # history's ``u`` and its values before its pass over the checkpoint (1: their
    # latency under the pass) or after it (0: fewer registers held through it).
    "closed_form": ("block_v", "k_chunk", "num_stages", "num_warps", "tf32_coefficients", "coef_warps",
                    "heads_per_program", "flush_block_v", "fuse_flush", "flush_records_ahead", "dependent_launch",
                    "max_registers", "early_tile", "short_tail", "coef_max_registers", "records_first"),
    # The tree recurrence (ops/tree_ops.py: fold's and snapshot's tree verify): rows of the
    # path stack a program holds in registers, all levels together (a level's tile is
    # stack_rows / levels rows high, at least 16); and the most requests x leaf paths
    # for which it steps each leaf's root path in a program of its own instead (the
    # "paths" method; 0: never).
    "exact_tree": ("stack_rows", "path_max_paths"),
    # circular's small-batch path (ops/chunked.py): at batch <= replay_max_batch its
    # verify replays the exact recurrence in one launch and its commit flushes every
    # step, instead of the closed form's three launches. 0 turns it off. A tree verify
    # replays each leaf's root path side by side (ops/chunked.py ``_tree_replay_kernel``)
    # while its requests times their leaves are at most tree_replay_max_paths.
    "circular": ("replay_max_batch", "tree_replay_max_paths"),
    # Plain decoding through circular's ring (ops/ring_decode.py): rows of V per
    # program, a flush row's record prefetch depth (as exact_write.records_ahead), and
    # whether the checkpoint tile loads before the cursors (1: its latency overlaps
    # theirs; more registers live at once) or after, in the row's branch (0), a cap
    # on its registers per thread on CUDA (as closed_form.max_registers), and its warps:
    # 4 (the exact kernels'), 8 where the tile has at least 64 rows, or 1 or 2; they
    # stack along V (ops/ring_decode.py launch_ring_decode says why the flush keeps its
    # bits; at 2 and 1 warps a GPU test checks them).
    # ``split_flush``: one launch for every row (0), or the flush rows in a kernel of
    # their own, ``flush_programs`` programs an SM walking them on tiles of ``block_v``
    # rows (loaded before the cursors), beside the token kernel on ``token_block_v`` rows
    # a program (``early_tile`` is then the token kernel's; 2: on a side stream, 1:
    # in order with it on the caller's stream). ``dot_products``: a row that does not
    # flush multiplies its checkpoint by the token's key and query on tensor cores,
    # streamed in ``k_chunk``-wide chunks ``num_stages`` deep (1; not with early_tile,
    # which holds the tile in registers), or by FMA on the four-part tile (0).
    # ``flush_warps`` (rows apart): the flush kernel's warps, 4 (the exact kernels') or
    # 2, whose tiles keep the 4-warp lanes along K (ops/ring_decode.py
    # launch_ring_decode).
    "ring_decode": ("block_v", "records_ahead", "early_tile", "max_registers", "num_warps", "split_flush",
                    "token_block_v", "flush_programs", "dot_products", "k_chunk", "num_stages", "flush_warps"),
}

_KEY_FIELDS = ("K", "V", "state_dtype", "min_batch", "max_batch", "device")
#: Parameters that may be 0 (the others are sizes, at least 1).
_MAY_BE_ZERO = ("replay_max_batch", "tree_replay_max_paths", "path_max_paths",
                "tf32_coefficients", "fuse_flush", "early_tile", "dependent_launch", "max_registers", "load_ahead",
                "coef_max_registers", "records_first",
                "split_flush", "short_tail", "dot_products")
#: Parameters with a closed set of values (by name, or ``family.name`` for one family).
_CHOICES = {"tf32_coefficients": (0, 1), "dot_products": (0, 1), "fuse_flush": (0, 1), "records_ahead": (1, 2),
            "flush_records_ahead": (1, 2),
            "early_tile": (0, 1), "dependent_launch": (0, 1), "load_ahead": (0, 1), "records_first": (0, 1),
            "ring_decode.split_flush": (0, 1, 2),
            "ring_decode.num_warps": (1, 2, 4, 8), "exact_write.num_warps": (1, 2, 4, 8),
            "exact_read_only.num_warps": (1, 2, 4, 8), "exact_snapshot.num_warps": (1, 2, 4, 8),
            "ring_decode.flush_warps": (2, 4), "closed_form.num_warps": (2, 4)}

#: circular's closed form from batch 33; up to batch 32 four entries differ (the
#: table's rows below say why each value).
_CLOSED_FORM_LARGE = dict(block_v=64, k_chunk=128, num_stages=2, num_warps=4, tf32_coefficients=1, coef_warps=1,
                          heads_per_program=8, flush_block_v=32, fuse_flush=1, flush_records_ahead=1, dependent_launch=1,
                          max_registers=128, early_tile=0, short_tail=0,
                          coef_max_registers=0, records_first=1)

#: The table (see the module notes). Values chosen by measurement at Qwen3.5 shapes
#: (BENCHMARKS.md, tuning notes).
TABLE: dict[str, list[tuple[dict, dict]]] = {
    # Two records ahead: the fold's commit measured faster than with one (BENCHMARKS.md,
    # "The flush inside the outputs kernel").
    # 32 rows on 2 warps: each thread holds what it held at 64 rows on 4 (16 rows a
    # warp), in twice the programs; plain decoding measured faster that way at every
    # batch (most with 16-bit states), and the fold's commit about as fast (BENCHMARKS.md,
    # "The exact kernels on fewer warps").
    "exact_write": [({}, dict(block_v=32, records_ahead=2, num_warps=2, load_ahead=1))],
    # One warp a program, 8 rows (16 for 16-bit states from batch 16): the snapshot
    # verify's T state stores a token measured faster in many small programs than
    # in the writers' tile at every batch (BENCHMARKS.md, "The exact kernels on fewer
    # warps").
    "exact_snapshot": [({"state_dtype": torch.bfloat16, "min_batch": 16}, dict(block_v=16, num_warps=1, load_ahead=1)),
                       ({}, dict(block_v=8, num_warps=1, load_ahead=1))],
    # The read-only verify is bound by issue, and a token's loads, normalisations and
    # gates cost each thread the same whatever its rows: 32 rows a warp amortise them
    # over twice the state of 16. With 16-bit states (loaded 4 keys a thread since
    # triton_common's layout cap) the fold measured faster at 128 rows than at 64 on 4
    # warps at every batch (BENCHMARKS.md, "16-bit tiles in the fp32 tiles' layout").
    # Each token's inputs loaded at its own step (load_ahead 0): fewer registers live
    # across the step; the fold measured faster that way at every batch in both dtypes,
    # the writing kernels (snapshot's) slower, so they keep 1 (BENCHMARKS.md, "Each
    # token loaded at its own step").
    # 64 rows on 2 warps (as 128 on 4, per thread) measured faster for the fold,
    # most at batch 8 (BENCHMARKS.md, "The exact kernels on fewer warps").
    "exact_read_only": [({}, dict(block_v=64, num_warps=2, load_ahead=0))],
    # Small batches are latency-bound: one value head per coefficient program keeps its
    # chain short; large ones share the key head's K pass. From batch 33, the outputs
    # kernel capped at 128 registers fits 4 programs per SM instead of 3 and measured
    # faster; at batch 16 it measured slower (BENCHMARKS.md, "circular's outputs kernel
    # under a register cap"). 16-bit states measured slower capped until their tiles
    # took the fp32 layout, faster since (BENCHMARKS.md, "16-bit tiles in the fp32
    # tiles' layout"). The flush rows in a kernel of their own, beside the outputs
    # kernel, measured slower at every batch in both dtypes and at T = 8 (BENCHMARKS.md,
    # "circular's flush rows apart: slower"; "The whole table beside SGLang's kernels,
    # one H100"), and was removed.
    # Up to batch 32 the grid starts the programs that fold first (short_tail 32, every
    # other row after them): at 16 they fit in the first wave, and the order measured
    # faster at 16, 24 and 32 and slower at 64 and 256, where the first waves would hold
    # only chains and the last ones only reads (BENCHMARKS.md, "circular's folding rows
    # first"). Shorter tails there (8 or 16 rows) measured 4-9% slower at 64 and 256
    # (BENCHMARKS.md, "circular's grid order at the table's other batches").
    # The records first (records_first) measured faster at every batch in both dtypes
    # (BENCHMARKS.md, "circular's outputs kernel: the window's rows in one load", and
    # for fp32 states from batch 64, "The records first at fp32, alone").
    # From batch 33 the non-folding rows multiply their checkpoint in one 128-key chunk
    # (k_chunk = K: all of the tile's loads issued at once, no pipelined pass), which
    # measured faster than two 64-key chunks at batch 256 in both state dtypes and at
    # 64 with 16-bit states (level at 64 in fp32); batches up to 32 keep 64, untimed at
    # 128 (BENCHMARKS.md, "circular's outputs kernel at batch 256 with more in flight").
    "closed_form": [({"max_batch": 32}, dict(_CLOSED_FORM_LARGE, heads_per_program=1, max_registers=0, short_tail=32,
                                             k_chunk=64)),
                    ({}, _CLOSED_FORM_LARGE)],
    # Small batches are latency-bound: one launch with a chain of n + T exact steps
    # beats three launches and the window solve's per-head chain there. The switch sits
    # at the largest batch where replay measured faster (BENCHMARKS.md, kernels:
    # "Where circular switches method").
    # Trees replay their leaf paths up to 48 (requests x leaves): a 3,2,1 tree (6 paths)
    # measured faster that way than its closed form at batch 1 to 8 and slower at 16
    # (BENCHMARKS.md, "Draft trees: each leaf's path replayed").
    # On the CPU the closed form stays the default so that the interpreter's tests
    # cover the history; tests turn the path on with override().
    "circular": [({"device": "cpu"}, dict(replay_max_batch=0, tree_replay_max_paths=0)),
                 ({}, dict(replay_max_batch=8, tree_replay_max_paths=48))],
    # The whole V axis per program: the history's share (its keys, gates and u) is
    # loaded and reduced once per (request, head) instead of once per V block, and the
    # tile's loads are all in flight at once (BENCHMARKS.md, "Plain decoding through the
    # ring, one launch").
    # 64 rows: four levels of 16-row tiles (depth 3) stay in registers; the read-only
    # tile height (128 rows) held four times spilled.
    # path_max_paths: a 3,2,1 tree (6 leaf paths) with fp32 states measured faster by
    # paths than by the stack at every batch timed, 1 to 16 (up to 96 requests x leaves;
    # fold 1.7x at batch 1, 2.5x at 16; snapshot 1.3x and 1.6x), so the paths method
    # takes every call up to there, other trees and 16-bit states included (untimed);
    # beyond, the stack (BENCHMARKS.md, "fold's and snapshot's trees by leaf paths:
    # timed"). On the CPU the stack stays the default, so that the interpreter's engine
    # tests cover it too (the op tests run both).
    "exact_tree": [({"device": "cpu"}, dict(stack_rows=64, path_max_paths=0)),
                   ({}, dict(stack_rows=64, path_max_paths=96))],
    # 16-bit states below batch 16 load the tile late: early, it ran slower at batch 16
    # (and spilled before the layout cap). From batch 16 their flush rows run in a kernel
    # of their own beside the token kernel, whose products with the checkpoint run on
    # tensor cores (dot_products: 86-128 registers, no tile in registers, the history's
    # loads issued before the checkpoint's stream) measured faster at batch 16, 64 and
    # 256 than the FMA token kernel, split or not (BENCHMARKS.md, "16-bit states on
    # tensor cores as stored"); at batch 1 the second launch costs more than it saves.
    # With fp32 states the FMA token kernel stays: its tensor-core form, with two 64 KB
    # pipeline stages of shared memory a program, measured slower, and one launch
    # measured faster from batch 33, the rows apart at batch 16 (BENCHMARKS.md, "The
    # flush rows apart"). There the flush kernel walks 32-row tiles on 2 warps, and from
    # batch 33 the one launch holds 64 rows on 2 warps (each thread's share as at 128
    # rows on 4, in twice the programs); both measured faster than 128 rows on 4
    # (BENCHMARKS.md, "Ring decoding and the closed form on 2 warps"). Batches below 16
    # keep 4 warps: not timed on 2.
    "ring_decode": [({"state_dtype": torch.bfloat16, "max_batch": 15}, dict(block_v=128, records_ahead=1, early_tile=0,
                                                                            max_registers=0, num_warps=4,
                                                                            split_flush=0, token_block_v=128,
                                                                            flush_programs=2, dot_products=0,
                                                                            k_chunk=64, num_stages=2, flush_warps=4)),
                    ({"state_dtype": torch.bfloat16}, dict(block_v=128, records_ahead=1, early_tile=0, max_registers=0,
                                                           num_warps=4, split_flush=2, token_block_v=128,
                                                           flush_programs=2, dot_products=1, k_chunk=64,
                                                           num_stages=2, flush_warps=4)),
                    ({"min_batch": 16, "max_batch": 32}, dict(block_v=32, records_ahead=1, early_tile=1,
                                                              max_registers=0, num_warps=4, split_flush=2,
                                                              token_block_v=128, flush_programs=2, dot_products=0,
                                                              k_chunk=64, num_stages=2, flush_warps=2)),
                    ({"min_batch": 33}, dict(block_v=64, records_ahead=1, early_tile=1, max_registers=0, num_warps=2,
                                             split_flush=0, token_block_v=128, flush_programs=2, dot_products=0,
                                             k_chunk=64, num_stages=2, flush_warps=4)),
                    ({}, dict(block_v=128, records_ahead=1, early_tile=1, max_registers=0, num_warps=4, split_flush=0,
                              token_block_v=128, flush_programs=2, dot_products=0, k_chunk=64, num_stages=2,
                              flush_warps=4))],
}


def _matches(key: dict, K: int, V: int, state_dtype: torch.dtype, batch: int, device: str) -> bool:
    return (
        key.get("device", device) == device
        and key.get("K", K) == K
        and key.get("V", V) == V
        and key.get("state_dtype", state_dtype) == state_dtype
        and key.get("min_batch", batch) <= batch <= key.get("max_batch", batch)
    )


def _check_family(family: str):
    if family not in PARAMS:
        raise ValueError(f"unknown kernel family {family!r}; known: {', '.join(PARAMS)}")


def lookup(family: str, *, K: int, V: int, state_dtype: torch.dtype, batch: int, device: str = "cuda") -> dict:
    """Parameters of ``family`` for a call on heads ``K x V``, states of ``state_dtype``,
    ``batch`` windows and a ``device`` type: the first matching row of :data:`TABLE`
    (a copy)."""
    _check_family(family)
    for key, params in TABLE[family]:
        if _matches(key, K, V, state_dtype, batch, device):
            return dict(params)
    raise ValueError(f"no row of the {family!r} table matches K={K}, V={V}, {state_dtype}, batch {batch}, {device}")


def check_row(family: str, key: dict, params: dict):
    """Raise ``ValueError`` unless ``(key, params)`` is a valid row of ``family``."""
    _check_family(family)
    bad_key = set(key) - set(_KEY_FIELDS)
    if bad_key:
        raise ValueError(f"unknown key fields {sorted(bad_key)} in the {family!r} table; known: {_KEY_FIELDS}")
    bad = set(params) - set(PARAMS[family])
    if bad:
        raise ValueError(f"unknown parameters {sorted(bad)} for {family!r}; known: {PARAMS[family]}")
    for name, value in params.items():
        least = 0 if name in _MAY_BE_ZERO else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{family}.{name} must be an int >= {least}, got {value!r}")
        choices = _CHOICES.get(f"{family}.{name}", _CHOICES.get(name))
        if choices is not None and value not in choices:
            raise ValueError(f"{family}.{name} must be one of {choices}, got {value!r}")


@contextlib.contextmanager
def override(family: str, **params):
    """Within the block, ``family``'s lookups return ``params`` on top of their row
    (any shape): how tuning runs try values without editing the table."""
    check_row(family, {}, params)
    saved = TABLE[family]
    TABLE[family] = [(key, {**row, **params}) for key, row in saved]
    try:
        yield
    finally:
        TABLE[family] = saved


for _family, _rows in TABLE.items():
    for _key, _params in _rows:
        check_row(_family, _key, _params)
