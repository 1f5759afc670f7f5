"""replayssm: exact, low-traffic speculative decoding for Gated DeltaNet layers.

A frozen checkpoint plus a small ring of per-token records per request; the window's
outputs in closed form; rollback by moving a cursor; an exact fold of the ring into the
checkpoint. See DESIGN.md for the math and the contracts.
"""

__version__ = "0.1.0"

# The strategies register themselves with the state pool's registry on import; the
# state package never imports them (strategies build on state, not the reverse).
from . import strategies as _strategies  # noqa: E402,F401
