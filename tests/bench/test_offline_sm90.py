"""``scripts/offline_sm90.py``: the state kernels compiled for sm_90 on a machine
without a GPU (the compiler's registers, stack and instructions, nothing run)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_sm90.py"
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton wheel ships no cuobjdump")
def test_reports_the_fold_kernel_at_the_tables_height(tmp_path):
    """One line per launch with the table's tile (64 rows for the fold at batch 256, 128
    with --tune) and a register count within the sm_90 limit."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src"), "TRITON_CACHE_DIR": str(tmp_path),
           "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    rows = {}
    for tune in ([], ["--tune", "exact_write.block_v=128"]):
        out = subprocess.run([sys.executable, str(SCRIPT), "--ops", "fold", *tune], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        line = next(x for x in out.stdout.splitlines() if x.startswith("fold commit"))
        m = re.search(r"_fold_kernel \[.*BV=(\d+).*\] (\d+) registers, (\d+) bytes of stack, (\d+) SASS", line)
        assert m, line
        bv, regs, _, instrs = map(int, m.groups())
        assert 32 <= regs <= 255 and instrs > 100
        rows[bv] = regs
    assert set(rows) == {64, 128} and rows[128] > rows[64]  # a taller tile holds more of the state a thread


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this Triton wheel ships no cuobjdump")
def test_16_bit_tiles_take_the_fp32_layout(tmp_path):
    """The exactness rule's layout (ops/triton_common.py): a bf16 state tile is held 4
    keys a thread x 8 lanes a row, as an fp32 one, not the 8 x 4 that Triton gives
    16-byte bf16 loads. Fails if load_parts / store_parts lose their contiguity cap."""
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1] / "src"), "TRITON_CACHE_DIR": str(tmp_path),
           "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(SCRIPT), "--ops", "recurrence,fold", "--state-dtype", "bfloat16"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    tiles = [x for x in out.stdout.splitlines() if x.strip().startswith("layout") and "sizePerThread = [1, " in x]
    assert len(tiles) == 4, out.stdout  # decode, fold verify, snapshot verify, fold commit: one 2-D layout each
    assert all("sizePerThread = [1, 4], threadsPerWarp = [4, 8]" in x for x in tiles), tiles
