"""``replayssm bench acceptance``: how many draft tokens a trained model accepts.

For each drafter (n-gram prompt lookup, the checkpoint's MTP head, the draft model) and
each verify window ``T`` (``T - 1`` drafts per step), greedy decoding of held-out
prompts (cuts of standard-library files the model never trained on, see
:mod:`replayssm.corpus`) under one strategy reports:

* **tokens per step**: tokens emitted per request per target step, ``accepted + 1``
  (the verify window's bonus token); at most ``T``;
* **accepted per step**: draft tokens accepted per request per step;
* **acceptance rate**: accepted over drafted;
* whether the tokens equal plain greedy decoding's through the same decoding loop
  (they must, for an exact strategy).

Beside them, the model's held-out loss measured in the same run (cross-entropy in nats
per token over windows of the held-out stream), since acceptance means little without
knowing how good the model is.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

DRAFTERS = ("ngram", "mtp", "model")
GENERATOR_OF = {"ngram": "static", "mtp": "static", "model": "eager"}


@dataclass(frozen=True)
class AcceptanceConfig:
    """One acceptance run: the checkpoints (directories), the drafters and windows, the
    held-out prompts and the held-out loss's windows, the strategy, dtype and device."""

    model: str
    draft_model: str | None = None
    drafters: tuple[str, ...] = DRAFTERS
    windows: tuple[int, ...] = (2, 4, 8)
    prompts: int = 8
    prompt_len: int = 128
    max_new_tokens: int = 128
    heldout_windows: int = 32
    strategy: str = "fold"
    dtype: str = "auto"
    device: str = "auto"
    #: draft trees as children per depth: when given, the run compares MTP draft trees
    #: (teacher-forced, :func:`measure_trees`) instead of the drafter / window table
    trees: tuple[tuple[int, ...], ...] = ()
    #: also fit a tree of at most this many nodes (0: none) from ``probe_tree`` measured
    #: on the next ``prompts`` held-out files (:func:`fit_tree`)
    fit_tree: int = 0
    probe_tree: tuple[int, ...] = (4, 2, 2)


def heldout_prompts(tokenizer, files, count: int, prompt_len: int) -> tuple[list[list[int]], list[str]]:
    """``count`` prompts of ``prompt_len`` tokens, one per file of ``files`` (the
    held-out ones, :func:`replayssm.corpus.heldout_files`; path order, files too
    short skipped), each cut from a third of the way into its file (past the licence
    header and module docstring most files open with). Returns the token lists and the
    files' relative paths."""
    prompts, names = [], []
    for f in files:
        ids = tokenizer.encode(f.text, add_special_tokens=False)
        if len(ids) < 3 * prompt_len:
            continue
        start = len(ids) // 3
        prompts.append(ids[start : start + prompt_len])
        names.append(f.rel)
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} held-out files are long enough for {count} prompts of "
                         f"{prompt_len} tokens; lower --prompts or --prompt-len")
    return prompts, names


@torch.no_grad()
def heldout_loss(model, tokenizer, *, windows: int, seq_len: int = 512, files=None) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over ``windows`` windows
    of ``seq_len`` tokens spread evenly over the held-out stream (``files``, default
    :func:`replayssm.corpus.heldout_files`, joined by the end-of-text token as in
    training)."""
    from ..corpus import heldout_stream, heldout_windows

    stream = heldout_stream(tokenizer, files)
    w = heldout_windows(stream, windows, seq_len + 1).to(model.device)
    total = 0.0
    for i in range(0, w.shape[0], 8):
        x = w[i : i + 8]
        logits = model(input_ids=x[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(),
                                                   reduction="sum").item()
    return total / (w.shape[0] * seq_len)


def measure(model, model_dir: str, prompts: list[list[int]], *, drafter: str, window: int, max_new_tokens: int,
            strategy: str = "fold", draft_model_dir: str | None = None, eager: bool = False) -> dict:
    """Greedy decoding of ``prompts`` with ``drafter`` and ``window - 1`` drafts per step
    (``window == 1``: plain decoding, no drafter), end-of-text ignored. The draft model
    (and plain decoding with ``eager``) runs the eager loop, the others the static step.
    Returns the tokens and the statistics of one row of the table."""
    from ..engine.adapter import HybridEngine
    from ..engine.factory import engine_max_len, make_drafter
    from ..engine.generator import SpeculativeGenerator, StepGenerator

    max_len = engine_max_len(max(len(p) for p in prompts), max_new_tokens, window)
    engine = HybridEngine(model, strategy=strategy, num_slots=len(prompts), window=window, max_len=max_len)
    kind = "none" if window == 1 else drafter
    d = make_drafter(kind, engine, model_dir=model_dir, draft_model_dir=draft_model_dir, batch=len(prompts),
                     max_len=max_len)
    if kind == "model" or eager:  # the draft model decodes on the host between steps
        gen = SpeculativeGenerator(engine, d, num_draft=max(1, window - 1), eos_token_ids=())
    else:
        gen = StepGenerator(engine, d, num_draft=max(1, window - 1), eos_token_ids=())
    t0 = time.perf_counter()
    r = gen.generate(prompts, max_new_tokens)
    return dict(drafter=kind, window=window, tokens=r.tokens, steps=r.steps, tokens_per_step=r.mean_accept_length,
                accepted_per_step=r.mean_accept_length - 1.0, acceptance_rate=r.acceptance_rate if r.drafted else None,
                drafted=r.drafted, accepted=r.accepted, seconds=time.perf_counter() - t0)


def tree_shapes(branchings) -> list[tuple[int, ...]]:
    """The shapes a tree comparison measures: each tree of ``branchings`` (children per
    depth) and, beside it, the chain of the same depth and the chain of the same node
    count; each once, in order of node count."""
    from ..engine.trees import StaticTree

    out = []
    for br in branchings:
        nodes = StaticTree.from_branching(br).num_nodes
        for shape in ((1,) * len(br), tuple(br), (1,) * (nodes - 1)):
            if shape not in out:
                out.append(shape)
    return sorted(out, key=lambda br: (StaticTree.from_branching(br).num_nodes, len(br)))


@torch.no_grad()
def measure_trees(engine, head, prompts: list[list[int]], continuations: list[list[int]], shapes, *,
                  max_new_tokens: int, drafter: str = "mtp") -> list[dict]:
    """Tokens per step of greedy speculative decoding with draft trees (the MTP head's
    top-k expansion, ``head``, or with ``drafter="ngram"`` n-gram lookup with several
    continuations), teacher-forced: the target's greedy continuation of every prompt is known
    (``continuations``, plain decoding's tokens, first one included, at least
    ``max_new_tokens`` plus the deepest tree's depth + 1), so one forward of the target
    over prompt + continuation gives its greedy token and hidden state at every
    position, and each step's acceptance follows from the drafts alone. Per step the
    MTP drafter (:class:`~replayssm.engine.device_drafters.DeviceMTPDrafter` with the
    tree) proposes the tree from the request's committed position, the greedy tree
    acceptance (:func:`~replayssm.engine.sampling.accept_greedy_tree`) keeps the deepest
    node the continuation follows, and the drafter observes the accepted path with the
    target's hidden states there: what a decode step with tree verify does.

    Every shape decodes the same budget: a request takes steps until it holds
    ``max_new_tokens`` generated tokens (the first from the prompt's prefill), tokens
    past the budget not counted. ``shapes``: branchings (children per depth) or
    :class:`~replayssm.engine.trees.StaticTree`. Returns one row per shape: ``tree``
    (its description), ``parents``, ``nodes``, ``depth``, ``steps`` (all requests),
    ``tokens`` (emitted by them), ``tokens_per_step``, and ``node_hits``: per node, the
    steps whose target tokens followed its root path (what :func:`fit_tree` reads).
    """
    from ..engine.device_drafters import DeviceMTPDrafter, DeviceNgramDrafter
    from ..engine.sampling import accept_greedy_tree
    from ..engine.trees import StaticTree

    dev, b = engine.device, len(prompts)
    trees = [t if isinstance(t, StaticTree) else StaticTree.from_branching(t, dev) for t in shapes]
    need = max_new_tokens + max(t.max_depth for t in trees) + 1
    if any(len(c) < need for c in continuations):
        raise ValueError(f"continuations must hold at least max_new_tokens + depth + 1 = {need} tokens")
    seqs = [list(p) + list(c[:need]) for p, c in zip(prompts, continuations)]
    slots = [engine.alloc() for _ in range(b)]
    try:
        out = engine.extend(slots, seqs, all_logits=True, prompt=True)
    finally:
        for s in slots:
            engine.free(s)
    length = max(len(x) for x in seqs)
    seq = torch.full((b, length), -1, dtype=torch.int64, device=dev)
    hid = out.hidden.new_zeros((b, length, out.hidden.shape[-1]))
    mismatch = 0  # the teacher-forced argmax must reproduce the continuation (the model's own)
    for i, (p, x) in enumerate(zip(prompts, seqs)):
        seq[i, : len(x)] = torch.tensor(x, device=dev)
        hid[i, : len(x)] = out.hidden[out.offsets[i] : out.offsets[i + 1]]
        mismatch += int((out.window_logits(i).argmax(-1)[len(p) - 1 : -1].cpu() != torch.tensor(x[len(p):])).sum())
    prompt_hidden = torch.cat([hid[i, : len(p)] for i, p in enumerate(prompts)])
    offsets = [0]
    for p in prompts:
        offsets.append(offsets[-1] + len(p))
    idx = torch.arange(b, device=dev)
    budget_end = torch.tensor([len(p) + max_new_tokens - 1 for p in prompts], device=dev)  # last token's index
    rows = []
    for tree in trees:
        d = DeviceMTPDrafter(engine, head, tree=tree) if drafter == "mtp" else DeviceNgramDrafter(tree=tree)
        d.bind(b, tree.num_nodes - 1, length + tree.num_nodes + 2, dev)
        drafts = d.join(list(range(b)), prompts, [c[0] for c in continuations], list(range(b)),
                              hidden=prompt_hidden, offsets=offsets)
        pos = torch.tensor([len(p) for p in prompts], device=dev)  # the root: the last emitted token
        steps = torch.zeros(b, dtype=torch.int64, device=dev)
        hits = torch.zeros(tree.num_nodes, dtype=torch.int64, device=dev)
        span = torch.arange(tree.max_depth + 1, device=dev)
        while True:
            live = pos < budget_end
            if not bool(live.any()):
                break
            tokens = torch.cat([seq[idx, pos][:, None], drafts], 1)
            node, nxt = accept_greedy_tree(seq.gather(1, pos[:, None] + tree.depth[None] + 1), tokens, tree)
            count = tree.depth[node] + 1
            steps += live
            hits += (tree.ancestors[node] & live[:, None]).sum(0)
            path = tree.path_tokens(tokens, node)[:, 1:]
            new = torch.cat([path, path.new_full((b, 1), -1)], 1)
            new[idx, count - 1] = nxt
            d.observe(idx, new, count, hidden=hid[idx[:, None], pos[:, None] + span].reshape(-1, hid.shape[-1]),
                      positions=pos[:, None] + span)
            pos = torch.where(live, (pos + count).clamp(max=budget_end), pos)
            drafts = d.propose(idx)
        total_steps = int(steps.sum())
        tokens = b * (max_new_tokens - 1)
        rows.append(dict(drafter=drafter, tree=tree.describe(), parents=tree.host_parents, nodes=tree.num_nodes,
                         depth=tree.max_depth, steps=total_steps, node_hits=hits.tolist(), tokens=tokens,
                         tokens_per_step=tokens / max(1, total_steps), teacher_forcing_mismatches=mismatch))
    return rows


def fit_tree(parents: list[int], hits: list[int], max_nodes: int) -> list[int]:
    """The static tree of at most ``max_nodes`` nodes that a measured probe tree says
    accepts the most: a step's expected tokens are ``1 + sum`` over the non-root nodes
    of the probability that the target follows the node's root path, so the best tree
    keeps the ``max_nodes - 1`` nodes of the probe (``parents``) with the most
    ``hits`` (:func:`measure_trees`' counts), which is a tree since a node's hits never
    exceed its parent's (ties go to the earlier node). Top-k expansion fills a node's
    children best first, so a kept node's lower-ranked siblings are kept before it
    (ties within a family follow rank). Returns the parents of the kept nodes,
    renumbered in breadth-first order (``[-1, ...]``)."""
    n = len(parents)
    if len(hits) != n or not 1 <= max_nodes:
        raise ValueError(f"hits must have one count per node ({n}) and max_nodes must be >= 1")
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    rank = [0] * n
    seen: dict[int, int] = {}
    for i in range(1, n):
        rank[i] = seen.get(parents[i], 0)
        seen[parents[i]] = rank[i] + 1
    kept = {0}
    for i in sorted(range(1, n), key=lambda i: (-hits[i], depth[i], rank[i], i)):  # best first
        need, stack = set(), [i]  # i with its ancestors and lower-ranked siblings not yet kept
        while stack:
            j = stack.pop()
            if j in kept or j in need:
                continue
            need.add(j)
            stack += [parents[j]] + [s for s in range(1, j) if parents[s] == parents[j] and rank[s] < rank[j]]
        if len(kept) + len(need) <= max_nodes:
            kept |= need
    bfs = sorted(kept, key=lambda i: (depth[i], i))
    new = {old: k for k, old in enumerate(bfs)}
    return [-1] + [new[parents[i]] for i in bfs[1:]]


def run_acceptance(args: AcceptanceConfig, progress_enabled: bool = True) -> dict:
    """Every (drafter, window) row of ``args`` plus plain decoding through each loop the
    drafters use, the held-out loss, the configuration and the environment: the JSON
    result of ``replayssm bench acceptance``."""
    from ..corpus import heldout_files
    from ..engine.loading import load_model, load_tokenizer, model_label
    from ..progress import ProgressBar
    from .common import environment

    tok = load_tokenizer(args.model)
    held = heldout_files()
    fit = bool(args.trees) and args.fit_tree > 0
    prompts, files = heldout_prompts(tok, held, args.prompts * (2 if fit else 1), args.prompt_len)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    loss = heldout_loss(model, tok, windows=args.heldout_windows, files=held)
    if args.trees:
        return _run_trees(args, model, prompts, files, loss, progress_enabled)
    runs = [(d, t) for d in args.drafters for t in args.windows]
    rows = []
    # Plain decoding through the same loop as each drafter: the graphed static step for
    # n-gram and MTP, the eager loop for the draft model. In 16-bit the two loops round
    # differently (fused kernels, other GEMM shapes), so only like compares with like.
    loops = sorted({GENERATOR_OF[d] for d in args.drafters})
    plain: dict[str, dict] = {}
    with ProgressBar(len(runs) + len(loops), "acceptance", unit="run", enabled=progress_enabled) as bar:
        for loop in loops:
            plain[loop] = measure(model, args.model, prompts, drafter="none", window=1,
                                  max_new_tokens=args.max_new_tokens, strategy=args.strategy, eager=loop == "eager")
            bar.update()
        for d, t in runs:
            bar.set_description(f"acceptance {d} T={t}")
            row = measure(model, args.model, prompts, drafter=d, window=t, max_new_tokens=args.max_new_tokens,
                          strategy=args.strategy, draft_model_dir=args.draft_model)
            row["loop"] = GENERATOR_OF[d]
            row["equals_plain"] = row.pop("tokens") == plain[row["loop"]]["tokens"]
            rows.append(row)
            bar.update()
    dev = next(model.parameters()).device
    return dict(
        config=dict(model=model_label(args.model),
                    draft_model=model_label(args.draft_model) if "model" in args.drafters else None,
                    dtype=str(model.dtype).replace("torch.", ""), device=str(dev), strategy=args.strategy,
                    prompts=len(prompts), prompt_files=files, prompt_len=args.prompt_len,
                    max_new_tokens=args.max_new_tokens, windows=list(args.windows), drafters=list(args.drafters)),
        environment=environment(dev, "auto"), heldout_loss=loss, heldout_windows=args.heldout_windows,
        plain_steps={k: v["steps"] for k, v in plain.items()}, rows=rows,
        exit_code=0 if all(r["equals_plain"] for r in rows) or args.strategy == "circular" else 1,
    )


def _run_trees(args: AcceptanceConfig, model, prompts, files, loss: float, progress_enabled: bool) -> dict:
    """The tree comparison of :func:`run_acceptance`, per drafter of ``args.drafters``
    that makes trees (mtp, ngram): every tree of ``args.trees`` beside the chains of its
    depth and of its node count, and the fitted tree, teacher-forced on the first
    ``args.prompts`` prompts (the fit on the others)."""
    from ..engine.adapter import HybridEngine
    from ..engine.drafters import load_mtp_head
    from ..engine.loading import model_label
    from ..engine.trees import StaticTree
    from ..ops.trees import DraftTrees
    from ..progress import ProgressBar
    from .common import environment

    extra = ((1,) * (args.fit_tree - 1), (1,) * len(args.probe_tree)) if args.fit_tree > 1 else ()
    shapes = tree_shapes(tuple(args.trees) + extra)
    deepest = max(max(len(br) for br in shapes), len(args.probe_tree))
    budget = args.max_new_tokens + deepest + 1  # the continuation covers the deepest tree at the last step
    evalp, fitp = prompts[: args.prompts], prompts[args.prompts :]
    nodes = max(StaticTree.from_branching(br).num_nodes for br in (*shapes, args.probe_tree))
    engine = HybridEngine(model, strategy=args.strategy, num_slots=args.prompts, window=1,
                          max_len=args.prompt_len + budget + nodes + 2)
    head = load_mtp_head(engine, args.model) if "mtp" in args.drafters else None
    kinds = [d for d in ("mtp", "ngram") if d in args.drafters]
    fitted: dict[str, list[int]] = {}
    probes: dict[str, dict] = {}
    rows = []
    with ProgressBar(1 + bool(fitp) + len(kinds) * (1 + bool(fitp)), "trees", unit="pass",
                     enabled=progress_enabled) as bar:
        if fitp:
            plain_fit = measure(model, args.model, fitp, drafter="none", window=1, max_new_tokens=budget,
                                strategy=args.strategy)["tokens"]
            bar.update()
            for kind in kinds:
                probes[kind] = measure_trees(engine, head, fitp, plain_fit, [args.probe_tree],
                                             max_new_tokens=args.max_new_tokens, drafter=kind)[0]
                fitted[kind] = fit_tree(probes[kind]["parents"], probes[kind]["node_hits"], args.fit_tree)
                bar.update()
        plain = measure(model, args.model, evalp, drafter="none", window=1, max_new_tokens=budget,
                        strategy=args.strategy)["tokens"]
        bar.update()
        for kind in kinds:
            trees = [StaticTree.from_branching(br, engine.device) for br in shapes]
            if kind in fitted:
                trees.append(StaticTree(DraftTrees.from_parents([fitted[kind]]), engine.device))
            part = measure_trees(engine, head, evalp, plain, trees, max_new_tokens=args.max_new_tokens, drafter=kind)
            if kind in fitted:
                part[-1]["tree"] = f"fitted ({part[-1]['nodes']} nodes)"
            rows += part
            bar.update()
    chain_of = {(r["drafter"], r["nodes"], r["depth"]): r for r in rows if r["nodes"] == r["depth"] + 1}
    for r in rows:
        same_depth = chain_of.get((r["drafter"], r["depth"] + 1, r["depth"]))
        same_nodes = chain_of.get((r["drafter"], r["nodes"], r["nodes"] - 1))
        r["vs_chain_same_depth"] = r["tokens_per_step"] / same_depth["tokens_per_step"] - 1 if same_depth else None
        r["vs_chain_same_nodes"] = r["tokens_per_step"] / same_nodes["tokens_per_step"] - 1 if same_nodes else None
    dev = next(model.parameters()).device
    return dict(
        config=dict(model=model_label(args.model), dtype=str(model.dtype).replace("torch.", ""), device=str(dev),
                    strategy=args.strategy, prompts=len(evalp), prompt_files=files[: len(evalp)],
                    fit_prompt_files=files[len(evalp):], prompt_len=args.prompt_len,
                    max_new_tokens=args.max_new_tokens, trees=[",".join(map(str, br)) for br in args.trees],
                    fit_tree=args.fit_tree, probe_tree=",".join(map(str, args.probe_tree)), drafters=kinds,
                    method="teacher-forced against the target's greedy continuation"),
        environment=environment(dev, "auto"), heldout_loss=loss, heldout_windows=args.heldout_windows,
        trees=rows, probes={k: {f: p[f] for f in ("tree", "tokens_per_step", "node_hits")} for k, p in probes.items()},
        # in fp32 the teacher-forced pass must reproduce plain decoding's tokens; in 16 bits
        # its other kernels may flip a near-tie (counted in every row, not a failure)
        fitted_parents=fitted,
        exit_code=1 if model.dtype == torch.float32 and rows[0]["teacher_forcing_mismatches"] else 0,
    )


def print_table(result: dict, file=None) -> None:
    file = file or sys.stdout
    if "trees" in result:
        return _print_trees(result, file)
    c = result["config"]
    print(f"acceptance: {c['model']} ({c['dtype']}, {c['device']}), {c['prompts']} held-out prompts of "
          f"{c['prompt_len']} tokens, {c['max_new_tokens']} greedy tokens each, strategy {c['strategy']}", file=file)
    print(f"held-out loss {result['heldout_loss']:.3f} nats/token ({result['heldout_windows']} windows of 512)",
          file=file)
    print(f"{'drafter':<8} {'T':>2} {'tokens/step':>11} {'accepted/step':>13} {'acceptance':>10} {'steps':>6} "
          f"{'== plain':>8}", file=file)
    for r in result["rows"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        print(f"{r['drafter']:<8} {r['window']:>2} {r['tokens_per_step']:>11.2f} {r['accepted_per_step']:>13.2f} "
              f"{rate:>10} {r['steps']:>6} {'yes' if r['equals_plain'] else 'NO':>8}", file=file)


def _print_trees(result: dict, file) -> None:
    c = result["config"]
    print(f"draft trees: {c['model']} ({c['dtype']}, {c['device']}), drafters {','.join(c['drafters'])}, "
          f"{c['prompts']} held-out "
          f"prompts of {c['prompt_len']} tokens, {c['max_new_tokens']} greedy tokens each, {c['method']}", file=file)
    mismatches = result["trees"][0]["teacher_forcing_mismatches"]
    print(f"held-out loss {result['heldout_loss']:.3f} nats/token; teacher-forced argmax differs from plain "
          f"decoding's token at {mismatches} positions", file=file)
    for kind, parents in result["fitted_parents"].items():
        print(f"{kind} fitted tree (from probe {c['probe_tree']} on {len(c['fit_prompt_files'])} other prompts): "
              f"parents {parents}", file=file)
    print(f"{'drafter':<7} {'tree':<22} {'nodes':>5} {'depth':>5} {'tokens/step':>11} {'steps':>6} "
          f"{'vs chain, same depth':>20} {'vs chain, same nodes':>20}", file=file)
    pct = lambda x: "-" if x is None else f"{x:+.1%}"  # noqa: E731
    for r in result["trees"]:
        name = r["tree"] if len(r["tree"]) <= 22 else f"chain of {r['nodes']}"
        print(f"{r['drafter']:<7} {name:<22} {r['nodes']:>5} {r['depth']:>5} {r['tokens_per_step']:>11.2f} "
              f"{r['steps']:>6} {pct(r['vs_chain_same_depth']):>20} {pct(r['vs_chain_same_nodes']):>20}", file=file)
