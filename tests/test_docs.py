"""The API reference builds from the docstrings with MkDocs in strict mode (a warning,
such as a docstring that names a parameter the signature lacks or a page that cannot
be found, fails the build), and it documents the stable surface."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_api_reference_builds_without_warnings(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                        "--site-dir", str(site)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    pages = {p: (site / p / "index.html").read_text() for p in ("api/llm", "api/engine", "api/state", "api/ops")}
    for name in ("max_num_seqs", "SamplingParams", "finish_reason"):
        assert name in pages["api/llm"], name
    for name in ("HybridEngine", "StepGenerator", "load_model"):
        assert name in pages["api/engine"], name
    for name in ("StatePool", "GDNShape", "CircularStrategy", "FoldStrategy", "SnapshotStrategy"):
        assert name in pages["api/state"], name
    # the dispatching ops show their parameters, not (*args, **kwargs)
    assert "cu_seqlens" in pages["api/ops"] and "*args" not in pages["api/ops"]
