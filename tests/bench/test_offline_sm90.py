"""``scripts/offline_sm90.py``: the state kernels compiled for sm_90 on a machine
without a GPU (the compiler's registers, stack and instructions, nothing run)."""

import fcntl
import hashlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_sm90.py"
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _tool_can_run() -> str | None:
    """Why the script cannot compile offline with this Triton, or None: it needs the
    wheel's cuobjdump and nvdisasm and the runtime hooks it stands in for a GPU driver
    with."""
    for tool in ("cuobjdump", "nvdisasm"):
        if not (TOOLS / tool).exists():
            return f"this Triton wheel ships no {tool}"
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if not hasattr(driver, "set_active") or "warmup" not in inspect.signature(JITFunction.run).parameters:
        return f"Triton {triton.__version__} has no driver.set_active / JITFunction.run(warmup=)"
    return None


pytestmark = pytest.mark.skipif(_tool_can_run() is not None, reason=str(_tool_can_run()))


#: The engine's kernels outside the state ops, compiled in one command line.
ENGINE_OPS = "norms,rotary,attention,normed_linear,step_inputs,argmax"

#: The command lines the tests read, grouped by the process that runs them
#: (``offline_sm90.reports``): a process pays seconds for its imports (torch, Triton, the
#: engine) and for the disassembler's start before it has read a kernel, so the state
#: kernels' lines share one. The engine's line, about as long as those together, has its
#: own: where the test workers share this file's tests, one compiles each half instead
#: of one waiting for the other. A line missing here runs alone.
PROCESSES = (
    (("--ops", "fold", "--sass"), ("--ops", "fold", "--sass", "--tune", "exact_write.block_v=64"),
     ("--ops", "recurrence,fold", "--state-dtype", "bfloat16"), ("--ops", "closed_form", "--window", "8")),
    (("--ops", ENGINE_OPS),),
)

#: Prints, as one JSON line, the reports of the command lines in its second argument
#: (a JSON list of argument lists); the first is the script's folder.
_DRIVER = ("import json, sys; sys.path.insert(0, sys.argv[1]); import offline_sm90; "
           "print(json.dumps(offline_sm90.reports(json.loads(sys.argv[2]))))")


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """``offline(*argv)``: what the script prints for ``argv`` (it must not fail). A
    command line runs once a test session, in one Triton cache, with the others of its
    process (:data:`PROCESSES`): the tests that read the same launches (``--ops fold``,
    the engine's kernels by name) read the same report, on whichever test worker asks
    first for a line of that process (the others wait for it)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's, under xdist
    shared = shared / "offline_sm90"
    shared.mkdir(exist_ok=True)

    def key(argv) -> str:
        return hashlib.sha1("\0".join(argv).encode()).hexdigest()[:16]

    def run(*argv) -> str:
        lines = next((group for group in PROCESSES if argv in group), (argv,))
        report = shared / f"{key(argv)}.out"
        with open(shared / f"{key(lines[0])}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not report.exists():
                paths = [str(SCRIPT.parents[1] / "src"),
                         *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TRITON_CACHE_DIR": str(shared / "cache"),
                       "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
                env.pop("TRITON_INTERPRET", None)
                out = subprocess.run([sys.executable, "-c", _DRIVER, str(SCRIPT.parent), json.dumps(lines)], env=env,
                                     capture_output=True, text=True, timeout=600)
                assert out.returncode == 0, out.stderr[-2000:]
                for line, text in zip(lines, json.loads(out.stdout.splitlines()[-1]), strict=True):
                    (shared / f"{key(line)}.out").write_text(text)
        return report.read_text()

    return run


def test_reports_the_fold_kernel_at_the_tables_height(offline):
    """One line per launch with the table's tile (32 rows for the fold at batch 256, 64
    with --tune) and a register count within the sm_90 limit."""
    rows = {}
    for tune in ([], ["--tune", "exact_write.block_v=64"]):
        line = next(x for x in offline("--ops", "fold", "--sass", *tune).splitlines() if x.startswith("fold commit"))
        m = re.search(r"_fold_kernel \[.*BV=(\d+).*\] (\d+) registers, (\d+) bytes of stack, (\d+) SASS", line)
        assert m, line
        bv, regs, _, instrs = map(int, m.groups())
        assert 32 <= regs <= 255 and instrs > 100
        rows[bv] = regs
    assert set(rows) == {32, 64} and rows[64] > rows[32]  # a taller tile holds more of the state a thread


def test_16_bit_tiles_take_the_fp32_layout(offline):
    """The exactness rule's layout (ops/triton_common.py): a bf16 state tile is held 4
    keys a thread x 8 lanes a row, as an fp32 one, not the 8 x 4 that Triton gives
    16-byte bf16 loads. Fails if load_parts / store_parts lose their contiguity cap."""
    out = offline("--ops", "recurrence,fold", "--state-dtype", "bfloat16")
    lines = out.splitlines()
    launches = [x for x in lines if x and not x.startswith(" ")]
    tiles = [x for x in lines if "sizePerThread = [1, 4], threadsPerWarp = [4, 8]" in x]
    assert len(launches) == 4 and len(tiles) == 4, out  # decode, fold verify, snapshot verify, fold commit
    assert "sizePerThread = [1, 8]" not in out, out


def test_loops_are_read_from_backward_branches():
    """A loop's trip is the instructions from a backward branch's target to the branch
    (16 bytes each); forward branches are no loops. (The script imports here without
    torch or Triton: it imports them when it compiles.)"""
    dump = "\n".join([
        "        /*0100*/                   FFMA R1, R2, R3, R4 ;",
        "        /*0110*/              @!P0 BRA 0x0150 ;",
        "        /*0120*/                   FMUL R1, R2, R3 ;",
        "        /*0130*/               @P0 BRA 0x0100 ;",
        "        /*0140*/                   BRA 0x0120 ;",
        "        /*0150*/                   EXIT ;",
    ])
    spec = importlib.util.spec_from_file_location("offline_sm90", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script._loops(dump) == [4, 3]
    # each body's opcodes, predicates skipped: 0x100-0x130, then 0x120-0x140
    assert [sorted(h.items()) for h in script._loop_histograms(dump)] == [
        [("BRA", 2), ("FFMA", 1), ("FMUL", 1)], [("BRA", 2), ("FMUL", 1)]]


def test_reports_the_replay_loop(offline):
    """The fold kernel's record loop is reported, shorter than the kernel; with --sass
    its body's opcodes, which sum to the trip (a histogram lists 16 at most)."""
    out = offline("--ops", "fold", "--sass")  # the command line test_reports_the_fold_kernel runs
    line = next(x for x in out.splitlines() if "loops" in x)
    trips = [int(n) for n in line.split(":")[1].split(",")]
    assert len(trips) == 1 and 100 < trips[0] < 900
    body = next(x for x in out.splitlines() if x.startswith("    loop 1:"))
    counts = {op: int(n) for op, n in (item.split() for item in body.split(":")[1].split(","))}
    assert counts["FFMA"] > 64 and sum(counts.values()) <= trips[0]  # a 4-part tile's FMAs, at the least


def test_window_sets_the_verify_ops_window_and_ring(offline):
    """--window 8 compiles the closed form for windows of 8 on a ring of 32 (its
    coefficient kernel's stacked window 2 x 8 rows: BT=8); a window past the closed
    form's bound is refused with a one-line usage error before anything compiles."""
    lines = [x for x in offline("--ops", "closed_form", "--window", "8").splitlines() if "SASS" in x]
    assert lines and all(x.startswith("closed form T=8, L=32:") for x in lines), lines
    assert any("_coefficients_kernel [BT=8 " in x for x in lines), lines
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    env.pop("TRITON_INTERPRET", None)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--ops", "closed_form", "--window", "17"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--window: must be in 1..16" in bad.stderr, bad.stderr[-2000:]


def _launches(offline, kernel: str, n: int, label: str = "") -> tuple[list[int], list[int]]:
    """The ``n`` launches of ``kernel`` in the report of :data:`ENGINE_OPS` (those whose
    line holds ``label``, where two ops launch it), none spilling: their registers and
    SASS instruction counts, in launch order."""
    lines = [x for x in offline("--ops", ENGINE_OPS).splitlines() if kernel in x and label in x]
    assert len(lines) == n, lines
    assert all(" 0 bytes of stack" in x for x in lines), lines
    return ([int(re.search(r"(\d+) registers", x).group(1)) for x in lines],
            [int(re.search(r"(\d+) SASS", x).group(1)) for x in lines])


def test_reports_the_norms_one_launch_each(offline):
    """``--ops norms``: the engine's norm kernel compiles for sm_90 in each of its forms
    (one norm, a residual add with its norm, two norms in one launch, an embedding row
    looked up inside the pair): four launches, none spilling; the pair holds two copies
    of the block code, so it has more instructions than one norm."""
    _, counts = _launches(offline, "_rms_norm_kernel", 4)
    assert counts[2] > counts[0], counts


def test_reports_the_rotary_with_and_without_the_cache_writes(offline):
    """``--ops rotary``: the rotary kernel compiles for sm_90 alone and with the keys'
    and values' cache writes in its launch, neither spilling; the writes add
    instructions."""
    _, counts = _launches(offline, "_rotate_kernel", 2)
    assert counts[1] > counts[0], counts


def test_reports_the_attention_with_and_without_its_gate(offline):
    """``--ops attention``: the window attention compiles for sm_90 alone and with the
    output gate in its epilogue, the same registers (the epilogue runs after the key
    pass) and more instructions, then with its keys split (the parts' merge adds
    instructions), no spills."""
    regs, counts = _launches(offline, "_slot_attention_kernel", 4)
    assert counts[1] > counts[0] and counts[2] > counts[1] and max(regs) <= 255, (regs, counts)


def test_reports_the_normed_linears_of_a_head_pass(offline):
    """``--ops normed_linear``: the MTP head's five normed linears compile for sm_90 at 1
    and 64 rows (each half of K in one tile at the embedded model's widths), none
    spilling, with the argmax's merge after each LM head, and each LM head again with
    its last block merging."""
    regs, _ = _launches(offline, "_normed_linear_kernel", 12)
    assert max(regs) <= 255, regs
    _launches(offline, "_argmax_parts_kernel", 2, "the argmax's blocks merged")


def test_reports_a_steps_inputs_in_one_launch(offline):
    """``--ops step_inputs``: the gather of a chain step's inputs compiles for sm_90,
    no spills."""
    _launches(offline, "_step_inputs_kernel", 1)


def test_reports_greedy_tokens_in_one_launch_or_in_parts(offline):
    """``--ops argmax``: the argmax kernel compiles for sm_90 at a step's rows and, for
    one row of a Qwen3.5 vocabulary, in parts merged by a second kernel, and for four
    rows in parts merged by the last part of each; no spills."""
    _launches(offline, "_argmax_kernel", 3)
    _launches(offline, "_argmax_parts_kernel", 1, "the parts' bests merged")
