"""``replayssm.LLM`` on a CUDA GPU: the graphed engine behind the Python API.

Run on the GPU machine:  python -m pytest -q tests/gpu/test_llm_gpu.py

Claims, on the shipped model: the decoding loop replays CUDA graphs; every request
gets its ``max_tokens``; the MTP head is accepted (more than one token per step); in
fp32 an exact strategy's tokens equal plain decoding's (what ``bench e2e`` holds
strict); bf16 (the default dtype on CUDA) generates, and the second call reuses the
captured graphs.
"""

import pytest

from replayssm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["def read_config(path):\n", "class Stack:\n    def push(self, item):\n", "import os\n\n\n"]


def test_llm_fp32_fold_equals_plain_and_is_graphed():
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = LLM("embedded", drafter=None, dtype="float32", max_num_seqs=2, max_model_len=512).generate(PROMPTS, params)
    llm = LLM("embedded", strategy="fold", drafter="mtp", dtype="float32", max_num_seqs=2, max_model_len=512)
    out = llm.generate(PROMPTS, params)
    assert all(g.graphs for g in llm._generators.values())
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert all(len(o.token_ids) == 64 and o.stats.tokens_per_step > 1.0 for o in out)


@pytest.mark.parametrize("strategy", ["snapshot", "circular"])
def test_llm_bf16_generates_twice_on_the_same_graphs(strategy):
    llm = LLM("embedded", strategy=strategy, drafter="mtp", max_num_seqs=4)
    first = llm.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True))
    gen = next(iter(llm._generators.values()))
    steps = dict(gen._steps)
    second = llm.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True))
    assert gen._steps == steps  # no new capture
    assert [o.token_ids for o in first] == [o.token_ids for o in second]  # greedy, same graphs: same tokens
    assert all(len(o.token_ids) == 48 for o in second)
