"""Draft trees in the engine on CUDA: tree attention, and whole tree decode steps in CUDA graphs.

Run on the GPU machine:  python -m pytest -q -s tests/gpu/test_tree_engine_gpu.py

* The Triton tree attention (one bitmask word of visible window entries per query
  node) against the SDPA reference with the ancestor mask: fp32 within 1e-5 of the
  outputs' scale, bf16 within 2e-2 (the inputs' own rounding); a chain-shaped tree
  equals the causal slot attention bit for bit.
* The embedded model in fp32 on the Triton backend, MTP top-k trees (3,2,1 and 2,2,2),
  every step one CUDA graph replay (tree verify, tree acceptance, commit_tree from a
  device tensor, KV compaction, the next tree): replay equals the eager step token for
  token for every strategy, and for the exact-output strategies (fold, snapshot) the
  tokens equal plain greedy decoding's over 256 tokens per prompt. Sampled tree steps
  replay too and emit tokens of the vocabulary. Tokens per step are printed (``-s``).
* The draft model inside the step (chains and its top-k trees): replay equals eager.
* Spine steps (the tree's best chain, ``chain_from``) and tree steps in one run, each
  kind graphed: replay equals eager, and fold's tokens are plain decoding's.
"""

import pytest
import torch

from replayssm.engine.adapter import HybridEngine
from replayssm.engine.attention import slot_attention, tree_attention
from replayssm.engine.device_drafters import DeviceMTPDrafter
from replayssm.engine.drafters import load_mtp_head
from replayssm.engine.generator import StepGenerator
from replayssm.engine.loading import embedded_model_dir, load_model, load_tokenizer
from replayssm.engine.sampling import SamplingParams
from replayssm.engine.trees import StaticTree

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
NEW = 256
TEXTS = ('import os\nimport sys\n\n\ndef main(argv):\n    """Parse the command line and run."""\n',
         "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [64, 128])
def test_triton_tree_attention_matches_the_reference(dtype, tol, d):
    g = torch.Generator(device=DEV).manual_seed(0)
    tree = StaticTree.from_branching((3, 2, 1), DEV)
    kc = torch.randn(5, 2, 512, d, device=DEV, generator=g).to(dtype)
    vc = torch.randn(5, 2, 512, d, device=DEV, generator=g).to(dtype)
    q = torch.randn(4, tree.num_nodes, 8, d, device=DEV, generator=g).to(dtype)
    slots, starts = torch.tensor([4, 0, 2, 1], device=DEV), torch.tensor([0, 17, 300, 480], device=DEV)
    ref = tree_attention(q, kc, vc, slots, starts, tree.ancestors, d**-0.5, backend="reference")
    got = tree_attention(q, kc, vc, slots, starts, tree.ancestors, d**-0.5, backend="triton")
    assert (got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    chain = StaticTree.chain(4, DEV)
    qc = q[:, :4].contiguous()
    assert torch.equal(tree_attention(qc, kc, vc, slots, starts, chain.ancestors, 0.1, backend="triton"),
                       slot_attention(qc, kc, vc, slots, starts, 0.1, backend="triton"))


@pytest.fixture(scope="module")
def setup():
    path = str(embedded_model_dir("embedded"))
    model = load_model(path, dtype=torch.float32, device="cuda")
    prompts = [load_tokenizer(path).encode(t) for t in TEXTS]
    return path, model, prompts


def _engine(model, strategy, window):
    return HybridEngine(model, strategy=strategy, num_slots=2, window=window, max_len=64 + NEW + window + 4,
                        backend="triton")


def _tree_run(setup, strategy, tree, graphs, sampling=SamplingParams(), chain_from=None, budgets=NEW):
    path, model, prompts = setup
    eng = _engine(model, strategy, tree.num_nodes)
    drafter = DeviceMTPDrafter(eng, load_mtp_head(eng, path), tree=tree)
    return StepGenerator(eng, drafter, tree=tree, graphs=graphs, sampling=sampling,
                         chain_from=chain_from).generate(prompts, budgets)


@pytest.mark.parametrize("strategy", ["fold", "snapshot", "circular"])
@pytest.mark.parametrize("branching", [(3, 2, 1), (2, 2, 2)])
def test_graphed_tree_decoding(setup, strategy, branching):
    tree = StaticTree.from_branching(branching, DEV)
    graphed = _tree_run(setup, strategy, tree, graphs=True)
    eager = _tree_run(setup, strategy, tree, graphs=False)
    assert graphed.tokens == eager.tokens
    print(f"{strategy} {branching}: {graphed.mean_accept_length:.2f} tokens/step")
    if strategy != "circular":  # circular's closed form equals the recurrence to rounding only
        _, model, prompts = setup
        plain = StepGenerator(_engine(model, strategy, tree.num_nodes), graphs=True).generate(prompts, NEW)
        assert graphed.tokens == plain.tokens


def test_graphed_sampled_tree_steps(setup):
    tree = StaticTree.from_branching((3, 2, 1), DEV)
    r = _tree_run(setup, "fold", tree, graphs=True, sampling=SamplingParams(temperature=0.8, top_k=50))
    assert all(len(t) == NEW and all(0 <= x < 4096 for x in t) for t in r.tokens)
    assert r.mean_accept_length > 1.0


@pytest.mark.parametrize("strategy", ["fold", "circular"])
def test_graphed_tree_and_spine_steps_per_bucket(setup, strategy):
    """``chain_from=2``: both prompts' steps verify the 3,2,1 tree's spine (a bucket of 2)
    until the shorter budget ends, then the tree (a bucket of 1), each kind one CUDA
    graph: replay equals the eager steps token for token, and for fold the tokens are
    plain greedy decoding's."""
    tree = StaticTree.from_branching((3, 2, 1), DEV)
    budgets = [NEW // 2, NEW]
    graphed = _tree_run(setup, strategy, tree, graphs=True, chain_from=2, budgets=budgets)
    eager = _tree_run(setup, strategy, tree, graphs=False, chain_from=2, budgets=budgets)
    assert graphed.tokens == eager.tokens
    assert 1 in graphed.stats.rows and 2 in graphed.stats.rows
    if strategy == "fold":
        _, model, prompts = setup
        plain = StepGenerator(_engine(model, strategy, tree.num_nodes), graphs=True).generate(prompts, budgets)
        assert graphed.tokens == plain.tokens


@pytest.mark.parametrize("branching", [None, (3, 2, 1)])
def test_graphed_draft_model_steps(setup, branching):
    """The shipped draft model inside the static step (chains of 3, and its top-k 3,2,1
    trees), every step one CUDA graph with the draft model's forwards in it: replay
    equals the eager steps token for token, and fold's tokens are plain decoding's."""
    from replayssm.engine.model_drafter import DeviceModelDrafter

    _, model, prompts = setup
    tree = None if branching is None else StaticTree.from_branching(branching, DEV)
    window = 4 if tree is None else tree.num_nodes
    runs = []
    for graphs in (True, False):
        eng = _engine(model, "fold", window)
        draft = load_model(str(embedded_model_dir("embedded-draft")), dtype=torch.float32, device="cuda")
        deng = HybridEngine(draft, strategy="fold", num_slots=2, window=window, max_len=eng.max_len + window, backend="triton")
        drafter = DeviceModelDrafter(deng, eng.vocab_size, tree=tree)
        runs.append(StepGenerator(eng, drafter, num_draft=3, tree=tree, graphs=graphs).generate(prompts, NEW))
    assert runs[0].tokens == runs[1].tokens
    plain = StepGenerator(_engine(model, "fold", window), graphs=True).generate(prompts, NEW)
    assert runs[0].tokens == plain.tokens
    print(f"draft model {branching}: {runs[0].mean_accept_length:.2f} tokens/step")
