"""``replayssm drift``: long teacher-forced runs of every strategy against a float64 oracle.

DESIGN.md section 5 asks that a strategy claiming exactness does not drift over long
generations. This tool drives one GDN layer through tens of thousands of speculative
steps and measures, every ``--every`` committed tokens, how far each strategy's
committed state is from a float64 oracle that runs the recurrence of section 1 on
exactly the accepted token stream.

The layer and its inputs (``--inputs``):

* ``model`` (the default, :mod:`.model_inputs`): GDN layer ``--layer`` (default the
  last) of a trained model (``--model``, default the shipped ``embedded`` one), with
  the model's shape and gates; its real inputs over held-out standard-library text,
  each request reading its own stretch of the text;
* ``random`` (:mod:`.inputs`): synthetic inputs for a layer of shape ``--shape``
  (Qwen3.5: ``H=16``, ``HV=32``, ``K=V=128`` by default on CUDA), keys correlated from
  token to token as real keys are, gates spread over ``--decay-range``.

A step, for ``--requests`` requests at once: random window lengths ``m`` in ``1..T``,
the layer inputs of each request's next ``m`` tokens in the activation dtype,
``verify``; then a random number of accepted tokens ``n`` in ``1..m`` and ``commit``.
Teacher forcing: every variant sees the same inputs, and a request's next window
starts after its accepted tokens (model inputs: the rejected tokens come again).

Variants:

* the strategies (``snapshot``, ``fold``, ``circular``), each in its own
  :class:`~replayssm.state.StatePool`; all three claim an exact committed state;
* ``plain``: the float32 recurrence decoding the accepted tokens one by one (the same
  backend as the strategies). It is what "exact" means on a device: the exact
  strategies must equal it bit for bit, and its own distance to float64 is the fp32
  rounding that no float32 implementation can beat;
* ``open-loop`` (a control, not a strategy): the ``circular`` ring, but its flush folds
  the chunk-reconstructed corrected deltas ``u``, kept in the activation dtype, into
  the checkpoint with a matrix product (``S <- exp(G) S + sum_c exp(G - G_c) u_c k^_c^T``)
  instead of replaying raw records through the recurrence. DESIGN.md section 3 forbids
  this; the tool must tell it apart from the exact strategies.

Measures per variant and sample: the committed-state relative error
``||S - S64|| / ||S64||`` over all requests and heads, the worst per-(request, head)
relative error, and the relative error of the outputs of the accepted positions since
the previous sample. Each series is assessed (:func:`assess`) by its growth (median of
the last 10% of samples over the median of the first 10% after a 5% warm-up), its
log-log slope against tokens, and its excess over ``plain`` (median of the last 10%).

Verdicts (:func:`verdict`):

* an exact strategy **fails** if, for any series, its excess over ``plain`` exceeds
  ``--excess-factor`` (it has left the recurrence) or it grows (growth above
  ``--growth-factor`` with slope above ``--min-slope``) while ``plain`` does not;
* the control is **detected** by the same test. It only has to be detected when the
  activation dtype is coarser than float32 (with float32 activations rounding ``u`` to
  the activation dtype changes nothing).

Exit status: 0 when every exact strategy passes (and the control is detected where it
must be), 1 when an exact strategy fails, 3 when only the control goes undetected (the
check has no teeth on this configuration).

The package, by role: :mod:`.config` (shapes, dtypes, :class:`DriftConfig`),
:mod:`.inputs` (random gates and inputs), :mod:`.model_inputs` (a trained model's
layer over held-out text), :mod:`.oracle` (the float64 recurrence,
written independently of the library's ops), :mod:`.variants` (strategies, control,
plain), :mod:`.judge` (growth and excess of a series), :mod:`.run` (the run),
:mod:`.report` (the table); the command line is :mod:`replayssm.cli.drift`.
"""

from .config import (A_SCALE, ACT_DTYPES, B_SCALE, CONTROL, INPUTS, PLAIN, SERIES, SHAPES, STATE_DTYPES,
                     STRATEGY_NAMES, DriftConfig)
from .inputs import InputStream, gate_params
from .model_inputs import ModelInputStream
from .judge import assess, verdict
from .oracle import Oracle64
from .report import print_report
from .run import run_drift
from ...strategies.open_loop import open_loop_fold
from .variants import OpenLoopControl, PlainRecurrence, StrategyVariant, Variant

__all__ = [
    "A_SCALE", "ACT_DTYPES", "B_SCALE", "CONTROL", "INPUTS", "PLAIN", "SERIES", "SHAPES", "STATE_DTYPES",
    "STRATEGY_NAMES", "DriftConfig", "InputStream", "ModelInputStream", "Oracle64", "OpenLoopControl",
    "PlainRecurrence", "StrategyVariant", "Variant", "assess", "gate_params", "open_loop_fold", "print_report",
    "run_drift", "verdict",
]
