"""What a drift run depends on: shapes, dtypes, the gate scales and :class:`DriftConfig`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops import triton_common
from ...ops.dispatch import BACKENDS, triton_available
from ...state import GDNShape
from ...strategies import STRATEGY_NAMES
from ...engine.loading import check_device

PLAIN = "plain"
CONTROL = "open-loop"

#: GDN layer shapes (H, HV, K, V). ``qwen3.5``: Qwen3.5-35B-A3B / Qwen3-Next-80B at TP1;
#: ``qwen3.5-hv64``: Qwen3.5-122B-A10B / 397B-A17B at TP1 (DESIGN.md section 6).
SHAPES = {
    "qwen3.5": GDNShape(num_heads=16, num_value_heads=32, head_k_dim=128, head_v_dim=128),
    "qwen3.5-hv64": GDNShape(num_heads=16, num_value_heads=64, head_k_dim=128, head_v_dim=128),
    "small": GDNShape(num_heads=4, num_value_heads=8, head_k_dim=64, head_v_dim=64),
    "tiny": GDNShape(num_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=16),
}
ACT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SERIES = ("state", "state_worst_head", "output")
#: Where the layer inputs come from: a trained model's GDN layer over held-out text
#: (:mod:`.model_inputs`) or the synthetic stream (:class:`.inputs.InputStream`).
INPUTS = ("model", "random")
#: Defaults of the random inputs' options (they do not apply to model inputs).
DEFAULT_DECAY_RANGE = (1e-3, 0.5)
DEFAULT_KEY_CORRELATION = 0.5
DEFAULT_MODEL = "embedded"

# Raw gate inputs: a ~ N(0, A_SCALE^2) with dt_bias = 0, so the per-token decay of head h
# is g = -exp(A_log[h]) * softplus(a). A_log is set so that the mean decay E[-g] of the
# heads spreads log-uniformly over --decay-range (memories from 1/max to 1/min tokens).
A_SCALE = 0.5
B_SCALE = 1.5  # beta = sigmoid(b), b ~ N(0, 1.5^2): beta spread over (0, 1)


# ---------------------------------------------------------------------- configuration
@dataclass
class DriftConfig:
    """Everything a drift run depends on (validated by :meth:`check`).

    ``inputs = "model"``: ``model`` (default ``"embedded"``, the shipped checkpoint)
    and ``layer`` (index among its GDN layers, default the last) pick the layer whose
    real inputs drive the run; its shape and gates are the model's. ``inputs =
    "random"``: ``shape`` (default ``qwen3.5`` on CUDA, ``tiny`` on the CPU),
    ``decay_range`` and ``key_correlation`` shape the synthetic stream. An option of
    the other kind of inputs is an error, not ignored; ``None`` means its default
    (see the ``random_*`` properties).
    """

    tokens: int = 32768
    requests: int = 4
    window: int = 4
    ring_len: int = 16
    every: int = 256
    inputs: str = "model"
    model: str | None = None
    layer: int | None = None
    shape: str | None = None
    act_dtype: str = "bf16"
    state_dtype: str = "fp32"
    device: str = "cpu"
    backend: str = "auto"
    strategies: tuple[str, ...] = STRATEGY_NAMES
    control: bool = True
    decay_range: tuple[float, float] | None = None
    key_correlation: float | None = None
    growth_factor: float = 2.0
    min_slope: float = 0.1
    excess_factor: float = 4.0
    seed: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        for name in ("tokens", "requests", "window", "ring_len", "every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.tokens // self.every < 10:
            raise ValueError(
                f"tokens / every must give at least 10 samples to assess growth, got {self.tokens} / {self.every}"
            )
        self._check_inputs()
        if self.act_dtype not in ACT_DTYPES:
            raise ValueError(f"act_dtype must be one of {sorted(ACT_DTYPES)}, got {self.act_dtype!r}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)}, got {self.state_dtype!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        bad = [s for s in self.strategies if s not in STRATEGY_NAMES]
        if bad or len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategies must be distinct names from {STRATEGY_NAMES}, got {list(self.strategies)}")
        if not self.strategies and not self.control:
            raise ValueError("nothing to run: no strategies and no control")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not self.excess_factor > 1:
            raise ValueError(f"excess_factor must be > 1, got {self.excess_factor}")
        if not self.min_slope >= 0:
            raise ValueError(f"min_slope must be >= 0, got {self.min_slope}")
        # The pool validates window / ring_len per strategy; circular (and the control)
        # need a power-of-two ring of at least 2T.
        if ("circular" in self.strategies or self.control) and (
            self.ring_len & (self.ring_len - 1) or self.ring_len < 2 * self.window
        ):
            raise ValueError(f"ring_len must be a power of two >= 2 * window = {2 * self.window}, got {self.ring_len}")
        dev = check_device(self.device)
        if self.backend == "triton":
            if not triton_available():
                raise ValueError("backend triton needs the triton package (pip install triton)")
            if dev.type != "cuda" and not triton_common.INTERPRETER:
                raise ValueError(f"backend triton on {self.device} needs the Triton interpreter "
                                 "(TRITON_INTERPRET=1 in the environment); use --backend reference or auto")

    def _check_inputs(self) -> None:
        if self.inputs not in INPUTS:
            raise ValueError(f"inputs must be one of {INPUTS}, got {self.inputs!r}")
        other = ("shape", "decay_range", "key_correlation") if self.inputs == "model" else ("model", "layer")
        for name in other:
            if getattr(self, name) is not None:
                kind = "random" if self.inputs == "model" else "model"
                raise ValueError(f"--{name.replace('_', '-')} applies to --inputs {kind} only "
                                 f"(this run's inputs are {self.inputs})")
        if self.inputs == "model":
            self._check_model()
            return
        if self.random_shape not in SHAPES:
            raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {self.shape!r}")
        lo, hi = self.random_decay_range
        if not (0 < lo <= hi < 20):
            raise ValueError(f"decay_range must satisfy 0 < min <= max < 20, got {self.decay_range}")
        if not 0 <= self.random_key_correlation < 1:
            raise ValueError(f"key_correlation must be in [0, 1), got {self.key_correlation}")

    def _check_model(self) -> None:
        from ...engine.loading import check_model_dir, resolve_model_path
        from .model_inputs import gdn_layer_count

        try:  # a missing shipped checkpoint, a missing directory, an unreadable config, ...
            path = check_model_dir(resolve_model_path(self.model_name))
        except ValueError as e:
            raise ValueError(f"--model: {e}") from None
        if self.layer is None:
            return
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"layer must be a non-negative int (an index among the GDN layers), got {self.layer!r}")
        count = gdn_layer_count(path)
        if count is not None and self.layer >= count:
            raise ValueError(f"layer must be below the model's {count} GDN layers, got {self.layer}")

    @property
    def model_name(self) -> str:
        """The ``--model`` of model inputs (default :data:`DEFAULT_MODEL`)."""
        return self.model if self.model is not None else DEFAULT_MODEL

    @property
    def random_shape(self) -> str:
        """The shape of random inputs: ``shape``, else ``qwen3.5`` on CUDA and ``tiny``
        elsewhere (a CPU runs the realistic shape far too slowly)."""
        if self.shape is not None:
            return self.shape
        return "qwen3.5" if str(self.device).startswith("cuda") else "tiny"

    @property
    def random_decay_range(self) -> tuple[float, float]:
        return tuple(self.decay_range) if self.decay_range is not None else DEFAULT_DECAY_RANGE

    @property
    def random_key_correlation(self) -> float:
        return self.key_correlation if self.key_correlation is not None else DEFAULT_KEY_CORRELATION

    @property
    def control_required(self) -> bool:
        """The control must be detected only if rounding ``u`` to the activation dtype
        loses anything, i.e. for activation dtypes coarser than float32."""
        return self.control and ACT_DTYPES[self.act_dtype] != torch.float32
