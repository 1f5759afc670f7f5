"""The cursor state machine of ``circular`` against a small pure-Python model of it
(DESIGN.md section 3), by property-based testing."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from replayssm.ops import advance_cursors_reference, reset_cursors_reference


class CursorModel:
    """The specification, one request at a time, in plain integers."""

    def __init__(self, L, T):
        self.L, self.T = L, T
        self.write_pos = self.cache_base = 0
        self.is_flush = False

    def commit(self, n):
        if self.is_flush:
            self.cache_base = (self.cache_base + self.write_pos) % self.L
            self.write_pos = n
        else:
            self.write_pos += n
        self.is_flush = self.write_pos + 2 * self.T > self.L

    def reset(self):
        self.write_pos = self.cache_base = 0
        self.is_flush = False


SLOTS = 4


class CursorMachine(RuleBasedStateMachine):
    @initialize(log_t=st.integers(0, 3), extra=st.integers(0, 2))
    def setup(self, log_t, extra):
        self.T = 2**log_t if log_t < 3 else 3  # include a non-power-of-two window
        self.L = 1
        while self.L < 2 * self.T:
            self.L *= 2
        self.L <<= extra
        self.models = [CursorModel(self.L, self.T) for _ in range(SLOTS)]
        self.cur = [torch.zeros(SLOTS, dtype=torch.int32) for _ in range(3)]

    @rule(data=st.data())
    def commit(self, data):
        rows = data.draw(st.lists(st.sampled_from(range(-1, SLOTS)), min_size=1, max_size=6))
        rows = [r for i, r in enumerate(rows) if r < 0 or r not in rows[:i]]  # live slots unique
        acc = [data.draw(st.integers(1, self.T)) for _ in rows]
        advance_cursors_reference(
            *self.cur, torch.tensor(rows, dtype=torch.int32), torch.tensor(acc, dtype=torch.int32), self.T, self.L
        )
        for r, n in zip(rows, acc):
            if r >= 0:
                self.models[r].commit(n)

    @rule(slot=st.sampled_from(range(SLOTS)))
    def reset(self, slot):
        reset_cursors_reference(*self.cur, torch.tensor([slot], dtype=torch.int32))
        self.models[slot].reset()

    @invariant()
    def matches_model(self):
        if not hasattr(self, "models"):
            return
        wp, base, flush = (c.tolist() for c in self.cur)
        for s, m in enumerate(self.models):
            assert (wp[s], base[s], bool(flush[s])) == (m.write_pos, m.cache_base, m.is_flush)
            # the next window always fits behind the committed history
            assert m.write_pos + self.T <= self.L or m.is_flush
            assert 0 <= m.cache_base < self.L


TestCursorMachine = CursorMachine.TestCase
TestCursorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(1, 4), min_size=1, max_size=200))
@settings(max_examples=60, deadline=None)
def test_history_never_overflows_the_ring(accepts):
    """Whatever the acceptance sequence, a window of T tokens written after the history
    (or after a flush) stays inside the L-record ring."""
    T, L = 4, 8
    m = CursorModel(L, T)
    for n in accepts:
        hist = 0 if m.is_flush else m.write_pos
        assert hist + T <= L
        m.commit(n)
