"""BENCHMARKS.md and ``benchmarks/results/`` stay in step: every result file is cited
(by name, a ``{a,b}`` alternation or a ``*`` pattern), every cited result file exists,
and the document speaks to a reader, not to the project's tracker."""

import fnmatch
import re
from itertools import product
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "BENCHMARKS.md"
# a result file's name as the document writes it: letters, digits, _, -, {alternatives}, *
NAME = re.compile(r"[A-Za-z0-9_*{},-]+\.(?:json|log|png|md|\{[a-z,]+\})")


def expand(pattern: str) -> list[str]:
    """``a_{x,y}.{json,log}`` -> ``a_x.json, a_x.log, a_y.json, a_y.log``."""
    parts = re.split(r"(\{[^{}]*\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in product(*choices)]


def cited(text: str) -> set[str]:
    return {name for m in NAME.finditer(text) for name in expand(m.group(0))}


def test_expand_and_cited():
    assert expand("e2e_h200.{json,log}") == ["e2e_h200.json", "e2e_h200.log"]
    assert expand("closed_loop_{a,b}_cpu.png") == ["closed_loop_a_cpu.png", "closed_loop_b_cpu.png"]
    assert cited("see `train_h200_run{1,2}.log` and [x](benchmarks/results/k.json)") == {
        "train_h200_run1.log", "train_h200_run2.log", "k.json"}


def test_every_result_file_is_cited_and_every_cited_file_exists():
    names = cited(DOC.read_text())
    files = sorted(p.name for p in RESULTS.iterdir())
    patterns = [n for n in names if "*" in n]
    uncited = [f for f in files if f not in names and not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert uncited == [], "files in benchmarks/results/ that BENCHMARKS.md does not cite (remove them or cite them)"
    # names that look like result files but are outputs of example commands elsewhere
    result_like = {n for n in names if "*" not in n and re.match(r".*_(h200|cpu)(_.*)?\.|^(drift|e2e)\.log$", n)}
    missing = sorted(n for n in result_like if not (RESULTS / n).exists())
    assert missing == [], "BENCHMARKS.md cites result files that do not exist"
    for p in patterns:
        assert any(fnmatch.fnmatch(f, p) for f in files), p


@pytest.mark.parametrize("word", [r"\bissue \d+", r"\bissue-\d+", r"#\d+\b"])
def test_the_document_names_no_issue_numbers(word):
    hits = [line for line in DOC.read_text().splitlines() if re.search(word, line, flags=re.I)]
    assert hits == []


def test_the_document_is_organised_by_topic():
    heads = [line[3:] for line in DOC.read_text().splitlines() if line.startswith("## ")]
    assert heads == ["Kernels", "End to end", "Numerics and drift", "Memory", "Training and acceptance"]


# An absolute path of a machine's home, scratch or checkout folders, not part of a word or
# a relative path (``results/x.json``, ``a.b/c``).
MACHINE_PATH = re.compile(r"(?<![\w./-])/(?:root|home|tmp|work|mnt|scratch)/")


def test_result_files_name_no_machine_paths():
    """Result files are shared: a run's output folder or a checkout's location written
    into a log or a JSON (a runner's ``--out``, pytest's tracebacks) is stripped before
    the file is committed."""
    assert MACHINE_PATH.search("wrote /root/out/b/e2e.json") and MACHINE_PATH.search('"out": "/tmp/x"')
    assert not MACHINE_PATH.search("benchmarks/results/k.json, tests/gpu/x.py:1, a.root/tmp/b")
    bad = [p.name for p in sorted(RESULTS.iterdir())
           if p.suffix in (".json", ".log", ".md") and MACHINE_PATH.search(p.read_text(errors="replace"))]
    assert not bad, bad
