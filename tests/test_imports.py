"""The package's import graph: no cycle between its packages or its modules, the stages above the runtime they share,
and no library module imports the CLI."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "gptpipe"


def _modules() -> dict[str, Path]:
    return {"gptpipe." + ".".join(f.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): f
            for f in sorted(SRC.rglob("*.py"))}


def _is_module(name: str) -> bool:
    return (SRC.parent / name.replace(".", "/")).with_suffix(".py").is_file()


def _imports(path: Path) -> set[str]:
    """gptpipe modules imported anywhere in the file (in functions and under `if TYPE_CHECKING:` too); for
    ``from gptpipe.train import checkpoint``, the module ``gptpipe.runtime.checkpoint``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gptpipe"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}")}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gptpipe")}
    return found


def _package(module: str) -> str:
    """gptpipe.train.plan → gptpipe.train; a top-level module is its own package."""
    return ".".join(module.split(".")[:2])


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    """Every edge a → b that lies on a cycle (b reaches a)."""
    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return sorted(f"{a} → {b}" for a, targets in edges.items() for b in targets if a in reachable(b))


def test_packages_import_each_other_without_a_cycle() -> None:
    edges: dict[str, set[str]] = {}
    for module, path in _modules().items():
        for target in _imports(path):
            if _package(target) != _package(module):
                edges.setdefault(_package(module), set()).add(_package(target))

    cycles = _cycles(edges)
    assert not cycles, f"package import cycles through: {cycles}"


def test_modules_import_each_other_without_a_cycle() -> None:
    """Module by module (every import counts: in a function, under TYPE_CHECKING, of a package's __init__): a
    cycle means two modules own one concept."""
    modules = _modules()
    edges = {module: {t for t in _imports(path) if t in modules and t != module} for module, path in modules.items()}
    cycles = _cycles(edges)
    assert not cycles, f"module import cycles through: {cycles}"


# The stages that run a model, above the machinery they share (gptpipe.runtime).
STAGES = ("gptpipe.train", "gptpipe.finetune", "gptpipe.export")
# The one seam between them: stage 4 exports and checks a fine-tune run, so it reads the task through stage 7's
# registry of kinds, their facts, the run folder's file names, its config and its metrics' catalogue.
SEAMS = {"gptpipe.export": {"gptpipe.finetune.kinds", "gptpipe.finetune.task_kind", "gptpipe.finetune.run_files",
                            "gptpipe.finetune.config", "gptpipe.finetune.metrics"}}


def test_the_runtime_imports_no_stage() -> None:
    """gptpipe.runtime is the kernel under stages 3, 4 and 7: a stage's change never reaches below it."""
    found = sorted(f"{m} → {t}" for m, path in _modules().items() if m.startswith("gptpipe.runtime")
                   for t in _imports(path) if _package(t) in STAGES)
    assert found == []


def test_a_stage_imports_another_stage_only_through_a_named_seam() -> None:
    found = sorted(f"{m} → {t}" for m, path in _modules().items() if _package(m) in STAGES
                   for t in _imports(path)
                   if _package(t) in STAGES and _package(t) != _package(m)
                   and t not in SEAMS.get(_package(m), set()))
    assert found == []


def test_only_the_cli_entry_points_import_the_cli() -> None:
    users = [m for m, path in _modules().items() if "gptpipe.cli" in _imports(path) and m != "gptpipe.__main__"]
    assert users == []


@pytest.mark.parametrize("module", sorted(m for m in _modules() if m != "gptpipe.__main__"))
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)
