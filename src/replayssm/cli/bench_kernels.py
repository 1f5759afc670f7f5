"""``replayssm bench kernels``: the options of :mod:`replayssm.bench.kernels` (resolved
into its :class:`~replayssm.bench.kernels.BenchConfig`, with the device's defaults), and
its table."""

from __future__ import annotations

import argparse
import sys

import torch

from ..bench.kernels import BASELINE_NAMES
from ..strategies import STRATEGY_NAMES
from .args import device_name, int_list, name_list, output_path, positive_int


def branching(text: str) -> tuple[int, ...]:
    """``"3,2,1"`` -> ``(3, 2, 1)``: children per node at each depth (repeats allowed)."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (children per depth), got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers (children per depth), got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("what to time")
    g.add_argument("--batches", type=int_list, default=None,
                   help="requests per step, comma-separated (default 1,16,64,256 on CUDA; 1,2 in the CPU smoke run)")
    g.add_argument("--strategies", type=name_list(STRATEGY_NAMES, allow_none=True), default=tuple(STRATEGY_NAMES),
                   help="strategies to time, or 'none' (default snapshot,fold,circular)")
    g.add_argument("--baselines", type=name_list(BASELINE_NAMES, allow_none=True), default=tuple(BASELINE_NAMES),
                   help="reference steps to time, or 'none' (default plain_decode,plain_ring,snapshot_verify; "
                        "plain_ring: plain decoding through circular's ring, with --window and --ring-len)")
    g.add_argument("--layers", type=positive_int, default=None,
                   help="GDN layers per captured step (default 8 on CUDA, 2 on the CPU); small batches "
                        "additionally rotate among independent copies so that the states exceed L2")
    g.add_argument("--window", type=positive_int, default=4, help="T, tokens verified per request (default 4)")
    g.add_argument("--accept", type=positive_int, default=3, help="n, tokens committed per request, bonus included (default 3)")
    g.add_argument("--ring-len", default="auto",
                   help="L for circular and plain_ring: a power of two >= 2T, or 'auto' for the length that moves "
                        "the fewest bytes per circular layer-step in the byte model (32 at the default shape)")
    g.add_argument("--conv", action="store_true", help="include the causal conv's verify and commit in the step")
    g.add_argument("--tree", type=branching, default=None, metavar="B1,B2,...",
                   help="time draft trees: the full tree with B_d children per node at depth d (e.g. 3,2,1: 16 nodes, "
                        "depth 3) beside a chain of its node count and a chain of its depth (root included), each "
                        "committing depth + 1 tokens; replaces --window/--accept for the strategies' rows")
    s = parser.add_argument_group("shapes and dtypes")
    s.add_argument("--heads", type=positive_int, default=None, help="H, key heads (default 16 on CUDA)")
    s.add_argument("--value-heads", type=positive_int, default=None, help="HV, value heads (default 32 on CUDA)")
    s.add_argument("--head-k-dim", type=positive_int, default=None, help="K (default 128 on CUDA)")
    s.add_argument("--head-v-dim", type=positive_int, default=None, help="V (default 128 on CUDA)")
    s.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32", help="state dtype (default float32)")
    s.add_argument("--act-dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="activation dtype (default bfloat16 on CUDA, float32 on the CPU)")
    r = parser.add_argument_group("how to run")
    r.add_argument("--device", type=device_name, default=None, help="cuda, cuda:N or cpu (default cuda when available)")
    r.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto",
                   help="ops backend (default auto: Triton on CUDA, the reference on the CPU)")
    r.add_argument("--no-graph", action="store_true", help="time eager steps with the wall clock instead of CUDA graphs")
    r.add_argument("--no-chain", action="store_true",
                   help="launch the step's kernels in stream order, not as a chain whose kernels start during the one "
                        "before (sm_90 and up; DESIGN.md)")
    r.add_argument("--repeats", type=positive_int, default=None, help="timed blocks per configuration (default 30 on CUDA, 3 on the CPU)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random states and inputs")
    r.add_argument("--tune", action="append", default=[], metavar="FAMILY.PARAM=VALUE",
                   help="override a row of the kernels' shape table (replayssm/ops/tuning.py) for the run, e.g. "
                        "circular.replay_max_batch=0 (circular's closed form at every batch); repeatable")
    r.add_argument("--json", type=output_path(".json"), default=None, help="write the rows as JSON to this path")
    r.add_argument("--quiet", action="store_true", help="no progress lines on stderr")



def _positive(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def resolve_config(args: argparse.Namespace):
    """Turn parsed arguments into a :class:`BenchConfig`, applying the device-dependent
    defaults; raises ``ValueError`` naming the offending option."""
    from ..bench import common
    from ..bench.kernels import CPU_DEFAULTS, CUDA_DEFAULTS, DTYPES, BenchConfig, StepShape
    from ..ops.dispatch import resolve

    if args.device in (None, "auto"):
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            raise ValueError(f"--device: {e}") from None
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"--device must be cuda, cuda:N or cpu, got {args.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: no CUDA device is available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    d = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS

    def pick(name):
        value = getattr(args, name)
        return d[name] if value is None else value

    heads = _positive("--heads", pick("heads"))
    value_heads = _positive("--value-heads", pick("value_heads"))
    if value_heads % heads:
        raise ValueError(f"--value-heads ({value_heads}) must be a multiple of --heads ({heads})")
    head_k_dim = _positive("--head-k-dim", pick("head_k_dim"))
    head_v_dim = _positive("--head-v-dim", pick("head_v_dim"))
    layers = _positive("--layers", pick("layers"))
    batches = tuple(_positive("--batches", b) for b in pick("batches"))
    window = _positive("--window", args.window)
    accept = _positive("--accept", args.accept)
    if accept > window:
        raise ValueError(f"--accept must be in [1, --window = {window}], got {accept}")
    repeats = _positive("--repeats", pick("repeats"))
    strategies = tuple(args.strategies)
    baselines = tuple(args.baselines)
    if not strategies and not baselines:
        raise ValueError("--strategies and --baselines select nothing to time")
    state_dtype = DTYPES[args.state_dtype]
    act_dtype = DTYPES[pick("act_dtype")]
    graph = device.type == "cuda" and not args.no_graph
    backend = args.backend
    if graph and resolve(backend, device) != "triton":
        raise ValueError("--backend reference cannot be captured in a CUDA graph (its ops read values on the host); add --no-graph")

    probe = StepShape(batch=1, num_heads=heads, num_value_heads=value_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                      window=window, accept=accept, state_elem=torch.empty((), dtype=state_dtype).element_size(),
                      act_elem=torch.empty((), dtype=act_dtype).element_size())
    if str(args.ring_len).strip().lower() == "auto":
        ring_len, ring_len_source = common.best_ring_len(probe), "auto: fewest bytes per layer-step in the byte model"
    else:
        try:
            ring_len = int(args.ring_len)
        except ValueError:
            raise ValueError(f"--ring-len must be 'auto' or an integer, got {args.ring_len!r}") from None
        if ring_len < 2 * window or ring_len & (ring_len - 1):
            raise ValueError(f"--ring-len must be a power of two >= 2 * --window = {2 * window}, got {ring_len}")
        ring_len_source = "given"
    from . import common as cli_common

    ring_pool = ("circular",) if "plain_ring" in baselines else ()  # plain_ring runs on a circular pool of --window
    cli_common.check_triton_window("--window", window, backend=backend, device=device, strategies=strategies + ring_pool)
    tune = tuple(_tune_item(item) for item in args.tune)
    tree = ()
    if getattr(args, "tree", None):
        from ..ops.trees import DraftTrees

        tree = tuple(_positive("--tree", c) for c in args.tree)
        nodes = DraftTrees.from_branching(tree).max_nodes
        if not strategies:
            raise ValueError("--tree times strategies: select at least one with --strategies")
        cli_common.check_triton_window("--tree (its node count)", nodes, backend=backend, device=device,
                                       strategies=strategies)
    return BenchConfig(
        tree=tree,
        tune=tune,
        device=device, backend=backend, graph=graph, heads=heads, value_heads=value_heads, head_k_dim=head_k_dim,
        head_v_dim=head_v_dim, layers=layers, batches=batches, strategies=strategies, baselines=baselines,
        window=window, accept=accept, ring_len=ring_len, ring_len_source=ring_len_source, state_dtype=state_dtype,
        act_dtype=act_dtype, conv=bool(args.conv), repeats=repeats, seed=int(args.seed),
        chain=not args.no_chain,
    )


def _tune_item(item: str) -> tuple[str, str, int]:
    """``FAMILY.PARAM=VALUE`` of ``--tune``, checked against the shape table."""
    from ..ops import tuning

    target, eq, value = str(item).partition("=")
    family, dot, param = target.partition(".")
    try:
        number = int(value)
    except ValueError:
        number = None
    if not (eq and dot) or number is None:
        raise ValueError(f"--tune takes FAMILY.PARAM=INT, got {item!r}")
    try:
        tuning.check_row(family, {}, {param: number})
    except ValueError as e:
        raise ValueError(f"--tune {item}: {e}") from None
    return family, param, number


def check_args(args: argparse.Namespace) -> None:
    """Validate the options together (``ValueError`` naming the option) before any work."""
    resolve_config(args)



def main(args: argparse.Namespace) -> int:
    from ..bench import common
    from ..bench.kernels import device_facts, format_table, result_payload, run_configs
    from ..ops.dispatch import resolve
    from ..progress import ProgressBar, write_json

    cfg = resolve_config(args)
    out = sys.stdout
    device_info, copy_bw, l2 = device_facts(cfg)
    backend = resolve(cfg.backend, cfg.device)
    print(f"replayssm bench kernels on {device_info['name']} ({cfg.device}), backend {backend}, "
          f"{'CUDA graphs' if cfg.graph else 'eager steps'}", file=out)
    print(f"shape H={cfg.heads} HV={cfg.value_heads} K={cfg.head_k_dim} V={cfg.head_v_dim}, window T={cfg.window}, "
          f"accepted n={cfg.accept}, {cfg.layers} layers per step, state {str(cfg.state_dtype)[6:]}, "
          f"activations {str(cfg.act_dtype)[6:]}, conv {'on' if cfg.conv else 'off'}", file=out)
    plain_cycle = (f"; plain_ring: a flush every {common.cursor_cycle(cfg.window, cfg.ring_len, 1).steps} tokens"
                   if "plain_ring" in cfg.baselines else "")
    print(f"circular ring_len L={cfg.ring_len} ({cfg.ring_len_source}; cursor cycle "
          f"{common.cursor_cycle(cfg.window, cfg.ring_len, cfg.accept).steps} steps{plain_cycle})", file=out)
    if cfg.smoke:
        print("SMOKE RUN: no CUDA device; tiny shape, reference ops, wall-clock timing of eager steps. "
              "These numbers are not measurements and no floor is claimed.", file=out)
    else:
        print(f"measured copy bandwidth {copy_bw / 1e12:.3f} TB/s (read + write), L2 {l2 / 2**20:.0f} MiB; "
              f"floor = one read of a layer's states at that bandwidth", file=out)
    if cfg.tune:
        print("shape table overrides: " + ", ".join(f"{f}.{p}={v}" for f, p, v in cfg.tune), file=out)
    out.flush()

    total = (len(cfg.strategies) + len(cfg.baselines)) * len(cfg.batches)
    with ProgressBar(total, "bench kernels", unit="config", enabled=not args.quiet) as progress:
        rows, errors = run_configs(cfg, copy_bw=copy_bw, l2_bytes=l2, progress=progress)

    print(file=out)
    print(format_table(rows), file=out)
    if errors:
        print(f"\n{len(errors)} configuration(s) failed:", file=out)
        for e in errors:
            print(f"  {e['strategy']} batch {e['batch']}: {e['error']}", file=out)
    if args.json is not None:
        path = write_json(args.json, result_payload(cfg, backend, device_info, rows, errors))
        print(f"\nwrote {path}", file=out)
    return 1 if errors else 0
