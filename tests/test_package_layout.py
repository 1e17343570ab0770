"""The package's import structure: no import cycle (lazy imports inside functions included), the
config package imports nothing above it, the RL math imports no Megatron; long functions say why,
and each test worker declares its findings."""

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = Path(__file__).resolve().parent.parent / "megatron_rlhf"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: Set[str]) -> Set[str]:
    """Every module of the package that ``path`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    return found - {name}


def import_graph(root: Path = PACKAGE) -> Dict[str, Set[str]]:
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    return {name: _imports(path, name, set(files)) for name, path in files.items()}


def find_cycle(graph: Dict[str, Set[str]]) -> List[str]:
    """One import cycle as [a, b, ..., a], or [] when there is none."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "megatron_rlhf.controller" in graph and graph["megatron_rlhf.controller"]
    assert find_cycle(graph) == [], " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_lazy_import_cycle(tmp_path):
    pkg = tmp_path / "megatron_rlhf"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from megatron_rlhf.sub.b import f\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import a\n")
    cycle = find_cycle(import_graph(pkg))
    assert set(cycle) == {"megatron_rlhf.sub.a", "megatron_rlhf.sub.b"}


def test_config_imports_nothing_above_it_and_the_rl_math_no_megatron():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("megatron_rlhf.config"):
            above = [d for d in deps if not d.startswith("megatron_rlhf.config")]
            assert not above, f"{name} imports {above}"
    for path in (PACKAGE / "ppo").rglob("*.py"):
        text = path.read_text()
        assert "megatron.core" not in text and "import megatron\n" not in text, path


LONG_FUNCTION = 80  # lines


def test_a_function_longer_than_a_screen_says_why_and_the_controller_stays_small():
    """A function of more than LONG_FUNCTION lines opens (after its docstring) with a comment
    saying why it is one piece; PPOController (the iteration) stays under 200 lines."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines), str(path))):
            if isinstance(node, ast.ClassDef) and node.name == "PPOController":
                assert node.end_lineno - node.lineno < 200, f"{path}: PPOController has {node.end_lineno - node.lineno} lines"
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if node.end_lineno - node.lineno + 1 <= LONG_FUNCTION:
                continue
            first = node.body[0]
            after_docstring = first.end_lineno if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                else node.body[0].lineno - 1
            if not lines[after_docstring].lstrip().startswith("#"):
                unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
    assert not unexplained, unexplained


def test_every_worker_script_declares_its_findings_and_saves_that_record():
    """Each tests/workers/<name>.py (the shared modules aside) has one record in findings.py, and
    its script names that record: no worker saves an undeclared dict."""
    import pytest

    from tests.workers.findings import FINDINGS, DPIteration, Iteration

    # A record filled field by field names what is left unset (common.save refuses it) and refuses a
    # field it does not declare.
    record = DPIteration.to_fill()
    record.ppo = Iteration(metrics={})
    assert record.unset() == ["grpo"] and record.grpo_lora is None
    with pytest.raises(AttributeError):
        record.grp = Iteration(metrics={})
    workers = PACKAGE.parent / "tests" / "workers"
    shared = {"__init__", "common", "findings", "environments_for_tests", "rewards_for_tests"}
    scripts = sorted(p.stem for p in workers.glob("*.py") if p.stem not in shared)
    assert scripts == sorted(FINDINGS), set(scripts) ^ set(FINDINGS)
    for name in scripts:
        imported = {alias.name for node in ast.walk(ast.parse((workers / f"{name}.py").read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module == "tests.workers.findings" for alias in node.names}
        assert FINDINGS[name].__name__ in imported, f"tests/workers/{name}.py does not name its record {FINDINGS[name].__name__}"
