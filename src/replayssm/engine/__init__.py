"""Speculative decoding of Hugging Face Qwen3.5 / Qwen3-Next models on the state pool.

* :class:`HybridEngine` (``adapter``): runs a loaded ``*ForCausalLM``; GDN layers go
  through a :class:`~replayssm.state.StatePool` strategy, full-attention layers through
  a :class:`KVCache` that rolls back by length. Steps: ``extend`` (prompt / plain
  decoding), ``verify`` + ``commit`` (speculative).
* Drafters (``drafters``): :class:`NgramDrafter`, :class:`MTPDrafter` (the checkpoint's
  ``mtp.*`` head, :func:`load_mtp_head`), :class:`ModelDrafter` (a small draft model).
* :class:`StepGenerator` (``generator``, ``graph_step``): continuous batching over
  static-shape steps, one CUDA graph replay per step on a GPU (forward, acceptance,
  commit and the next drafts on the device); drafters that run inside the step:
  :class:`DeviceNgramDrafter`, :class:`DeviceMTPDrafter`, and for benchmarks
  :class:`OracleDrafter` and :class:`ForcedDrafter` (``device_drafters``), and
  :class:`DeviceModelDrafter` (``model_drafter``: a draft model's chains and top-k
  trees through its own engine's static forwards); with a :class:`StaticTree`
  (``trees``), every step verifies a draft tree instead of a chain.
* :class:`SpeculativeGenerator` (``generator``): the eager decoding loop (host-side
  drafters, the draft model), with greedy acceptance or distribution-preserving
  rejection sampling (``sampling``).
* ``loading`` (local checkpoints and their checks), ``factory`` (drafters by name),
  ``random_model`` (random-weight models for shape benchmarks).

Example::

    from replayssm.engine import DeviceNgramDrafter, HybridEngine, StepGenerator
    from replayssm.engine.loading import load_model, load_tokenizer

    model = load_model("path/to/Qwen3.5-checkpoint")          # bf16 on CUDA
    engine = HybridEngine(model, strategy="circular", num_slots=8, window=4, max_len=4096)
    gen = StepGenerator(engine, DeviceNgramDrafter(), num_draft=3, eos_token_ids=[...])
    result = gen.generate([tokenizer.encode("...")], max_new_tokens=256)
    result.tokens, result.mean_accept_length, result.tokens_per_second
"""

from .adapter import HybridEngine, StepOutput
from .device_drafters import DeviceDrafter, DeviceMTPDrafter, DeviceNgramDrafter, ForcedDrafter, OracleDrafter
from .drafters import Draft, Drafter, MTPDrafter, MTPHead, ModelDrafter, NgramDrafter, load_mtp_head
from .generator import GenerationResult, SpeculativeGenerator, StepGenerator
from .kv_cache import KVCache
from .model_drafter import DeviceModelDrafter
from .sampling import SamplingParams, greedy_accept, rejection_sample, warp_probs
from .trees import StaticTree

__all__ = [
    "DeviceDrafter",
    "DeviceMTPDrafter",
    "DeviceModelDrafter",
    "DeviceNgramDrafter",
    "Draft",
    "Drafter",
    "ForcedDrafter",
    "GenerationResult",
    "HybridEngine",
    "KVCache",
    "MTPDrafter",
    "MTPHead",
    "ModelDrafter",
    "NgramDrafter",
    "OracleDrafter",
    "SamplingParams",
    "SpeculativeGenerator",
    "StaticTree",
    "StepGenerator",
    "StepOutput",
    "greedy_accept",
    "load_mtp_head",
    "rejection_sample",
    "warp_probs",
]
