"""Count the device kernels a call launches, on any device (tests and profiling).

A batch-1 static step inside a CUDA graph costs about the same 1.5-2 microseconds per
kernel whatever the kernel does, so the number of kernels, not their work, is a small
step's cost. :func:`count_ops` counts what a call dispatches, as a proxy for that
number that runs on the CPU:

* every ATen operator that computes or moves data (``aten.mm``, ``aten.add``,
  ``aten.index_put_``, ``aten.copy_``, ...), one each;
* every Triton kernel launch (``triton.<kernel>``), one each, the ATen operators the
  Triton interpreter runs around a launch (copies to and from its host buffers) not
  counted;
* not counted: views and metadata (``aten.view``, ``aten.slice``, ``aten.expand``,
  ``aten.t``, ``aten.detach``, ``aten.alias``, ...: any operator whose result aliases
  its input) and bare allocations (``aten.empty``, ``aten.empty_like``, ...), which
  launch no kernel.

A few ATen operators launch more than one CUDA kernel (a ``topk`` may sort in two
passes) and cuBLAS may split a matmul in two; the count is a floor, exact for the
elementwise, indexing and norm work that batch-1 steps are made of.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that launch no kernel although their schema does not mark them as views:
# allocations, and metadata changes in place.
_NO_KERNEL = {
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
    "aten.set_", "aten.resize_", "aten.lift_fresh", "aten.detach", "aten.detach_", "aten.alias", "aten._reshape_alias",
    "aten.as_strided", "aten._unsafe_view",
}


def _op_name(func) -> str:
    """``aten.add`` for ``aten.add.Tensor`` (overloads merged)."""
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}"


class OpCounter(TorchDispatchMode):
    """The counting mode of :func:`count_ops`; :attr:`counts` maps operator names
    (``aten.mm``, ``triton._rms_norm_kernel``) to calls."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused:
            name = _op_name(func)
            if not (func.is_view or name in _NO_KERNEL):
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def launch(self, name: str):
        """One Triton launch named ``name``; the operators inside are not counted."""
        if not self._paused:
            self.counts[f"triton.{name}"] += 1
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _triton_launchers():
    """The Triton classes whose ``run`` launches a kernel (compiled and interpreted)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    return [InterpretedFunction, JITFunction]


@contextlib.contextmanager
def count_ops(run_triton: bool = True):
    """Count the kernels of the code run inside (see the module docstring)::

        with count_ops() as ops:
            drafter.propose(slot_idx)
        ops.total, ops.counts.most_common()

    Yields an :class:`OpCounter`. Triton launches are counted by wrapping the launchers'
    ``run`` for the duration of the block (not thread-safe: count on one thread).

    ``run_triton=False`` counts each Triton launch without running it (the interpreter
    takes seconds a launch; the count is the same). Only for code whose launches do not
    depend on what its kernels write: a step a CUDA graph could capture, which reads
    nothing back to the host. The kernels' outputs are left as they were.
    """
    counter = OpCounter()
    saved = []
    for cls in _triton_launchers():
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if kwargs.get("warmup"):
                return _original(self, *args, **kwargs)
            with counter.launch(getattr(self, "__name__", None) or getattr(self.fn, "__name__", "kernel")):
                return _original(self, *args, **kwargs) if run_triton else None

        saved.append((cls, original))
        cls.run = run
    try:
        with counter:
            yield counter
    finally:
        for cls, original in saved:
            cls.run = original
