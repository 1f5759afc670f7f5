"""GDN operators: one op per module, each with its plain-PyTorch reference.

Public functions dispatch on ``backend`` (``"auto"``: Triton for CUDA tensors, the
reference elsewhere). The ``*_reference`` functions are float64-capable and run anywhere;
the tests use them as the oracle.
"""

from .chunked import (
    gdn_chunked_window,
    gdn_chunked_window_reference,
    gdn_tree_verify,
    gdn_tree_verify_reference,
    gdn_tree_window_reference,
)
from .conv import (
    causal_conv_commit,
    causal_conv_commit_reference,
    causal_conv_verify,
    causal_conv_verify_reference,
    causal_conv_verify_tree,
    causal_conv_verify_tree_reference,
    conv_ring_commit,
    conv_ring_commit_reference,
)
from .checkpoints import write_checkpoints, write_checkpoints_reference
from .counter_hash import (
    counter_hash,
    counter_hash_reference,
    hash_accept_counts,
    hash_accept_counts_reference,
    hash_tokens,
    hash_tokens_reference,
)
from .cursors import advance_cursors, advance_cursors_reference, reset_cursors, reset_cursors_reference
from .fold import gdn_fold, gdn_fold_reference
from .gates import expand_heads, gdn_gates, l2_normalize
from .prompt_gates import prompt_gates, prompt_gates_reference
from .records import RawRecords
from .recurrent import gdn_recurrence, gdn_recurrence_reference, readout, state_update
from .ring_decode import gdn_ring_decode, gdn_ring_decode_reference
from .snapshot import snapshot_commit, snapshot_commit_reference
from .tree_ops import compact_path, compact_path_reference, gdn_tree_recurrence, gdn_tree_recurrence_reference
from .trees import DeviceTrees, DraftTrees, accepted_paths

__all__ = [
    "DeviceTrees",
    "DraftTrees",
    "accepted_paths",
    "RawRecords",
    "advance_cursors",
    "advance_cursors_reference",
    "causal_conv_commit",
    "causal_conv_commit_reference",
    "causal_conv_verify",
    "causal_conv_verify_reference",
    "causal_conv_verify_tree",
    "causal_conv_verify_tree_reference",
    "compact_path",
    "compact_path_reference",
    "conv_ring_commit",
    "conv_ring_commit_reference",
    "counter_hash",
    "counter_hash_reference",
    "expand_heads",
    "gdn_chunked_window",
    "gdn_chunked_window_reference",
    "gdn_fold",
    "gdn_fold_reference",
    "gdn_gates",
    "gdn_recurrence",
    "gdn_recurrence_reference",
    "gdn_ring_decode",
    "gdn_ring_decode_reference",
    "gdn_tree_recurrence",
    "gdn_tree_recurrence_reference",
    "gdn_tree_verify",
    "gdn_tree_verify_reference",
    "gdn_tree_window_reference",
    "hash_accept_counts",
    "hash_accept_counts_reference",
    "hash_tokens",
    "hash_tokens_reference",
    "l2_normalize",
    "prompt_gates",
    "prompt_gates_reference",
    "readout",
    "reset_cursors",
    "reset_cursors_reference",
    "snapshot_commit",
    "snapshot_commit_reference",
    "state_update",
    "write_checkpoints",
    "write_checkpoints_reference",
]
