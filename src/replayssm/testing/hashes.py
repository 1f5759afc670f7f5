"""The counter hash of :mod:`replayssm.ops.counter_hash` transcribed on Python ints, with
plain modular arithmetic (no 16-bit split of the constants, no tensors): the independent
implementation the tests hold the op and the forced drafter's draws to."""

from __future__ import annotations

M32 = 0xFFFFFFFF


def mix32(x: int) -> int:
    """lowbias32 on a Python int in ``[0, 2**32)``."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def counter_hash_int(seed: int, *counters: int) -> int:
    """``mix(... mix(mix(seed) ^ c_1) ... ^ c_n)``, every input taken mod ``2**32``."""
    h = mix32(seed & M32)
    for c in counters:
        h = mix32((c & M32) ^ h)
    return h
