"""The house rules of issue 12, checked on the source: strategies depend on the state
package and never the reverse; one definition of NORM_EPS and of the tile-height rule;
strategies read their buffers through typed views, not shared string keys."""

import ast
from pathlib import Path

import pytest
import torch

import replayssm
from replayssm.state import BufferSpec, GDNShape, StatePool, register_strategy, registered_strategies
from replayssm.strategies import STRATEGY_NAMES, CircularStrategy, Strategy, StrategyBuffers

SRC = Path(replayssm.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, resolved to dotted names (relative ones included)."""
    pkg = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)
    return out


def test_state_package_imports_no_strategy():
    """Guards: state/pool.py imported replayssm.strategies (lazily, to dodge the cycle)."""
    for path in sorted((SRC / "state").glob("*.py")):
        bad = [m for m in imported_modules(path) if m.startswith("replayssm.strategies")]
        assert not bad, f"{path.name} imports {bad}"


def test_strategies_use_typed_buffers():
    """Guards: strategies indexed a string-keyed dict shared across modules."""
    for path in sorted((SRC / "strategies").glob("*.py")):
        text = path.read_text()
        assert 'buffers["' not in text and "buf[\"" not in text, f"{path.name} indexes buffers by string"


def test_one_norm_eps_and_one_tile_height_rule():
    """Guards: NORM_EPS was defined in ops/gates.py and ops/triton_common.py; the
    SM-count tile-height rule in ops/recurrent.py and ops/chunked.py."""
    ops = sorted((SRC / "ops").glob("*.py"))
    eps = [p.name for p in ops if "\nNORM_EPS =" in p.read_text()]
    assert eps == ["gates.py"]
    sm_rule = [p.name for p in ops if "multi_processor_count" in p.read_text()]
    assert sm_rule == ["triton_common.py"]


def test_kernel_comments_carry_no_measurements():
    """Tuning history (measured numbers, rejected variants) lives in BENCHMARKS.md."""
    for path in sorted((SRC / "ops").glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("#"):
                for word in (" us ", "x faster", "x slower", "% faster", "H200"):
                    assert word not in stripped, f"{path.name}:{i}: {stripped}"


def test_registry_and_strategy_classes():
    """StatePool(strategy=name) finds the registered strategies; a class works too, and
    a strategy of its own declares typed buffers that the pool allocates blindly."""
    assert tuple(registered_strategies()) == STRATEGY_NAMES
    shape = GDNShape(1, 1, 4, 4)
    assert isinstance(StatePool(shape, 1, 1, strategy=CircularStrategy).strategy, CircularStrategy)

    from dataclasses import dataclass

    @dataclass(frozen=True)
    class ExtraBuffers(StrategyBuffers):
        extra: torch.Tensor

    class Extra(Strategy):
        name = "extra-test"
        Buffers = ExtraBuffers

        @classmethod
        def buffer_specs(cls, pool):
            return {"extra": BufferSpec((3,), torch.float32, fill=1.5)}

    pool = StatePool(shape, 2, 2, strategy=Extra)
    assert pool.strategy.buf.extra.shape == (2, 2, 3) and (pool.strategy.buf.extra == 1.5).all()
    assert pool.nbytes()["extra"] == 2 * 2 * 3 * 4
    with pytest.raises(TypeError):
        pool.buffers["extra"] = torch.zeros(1)  # the mapping is read-only

    class Clash(Extra):
        name = "clash-test"

        @classmethod
        def buffer_specs(cls, pool):
            return {"checkpoints": BufferSpec((1,), torch.float32)}

    with pytest.raises(ValueError, match="reserved"):
        StatePool(shape, 1, 1, strategy=Clash)
    with pytest.raises(ValueError, match="already registered"):
        register_strategy(type("Other", (Extra,), {"name": "circular"}))
