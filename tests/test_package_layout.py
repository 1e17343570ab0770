"""The package's import structure: no import cycle (lazy imports inside functions included), no
import of a package above it (LAYERS), the RL math imports no Megatron, a registered name spelled
only in its homes; long functions say why, and each test worker declares its findings."""

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


# The packages (and top-level modules) in layers, lowest first: a module imports its own package
# and packages of lower layers only (docs/architecture.md, "Layers").
LAYERS = (
    ("config", "errors", "units"),
    ("runtime", "data", "rewards", "ppo", "preference"),
    ("models", "memory", "agents"),
    ("checkpoint", "generation"),
    ("roles", "run_log"),
    ("rollout", "stages", "smoke"),
    ("controller", "dry_run"),
    ("startup",),
    ("run_loop",),
    ("train",),
    ("launch",),
    ("plan",),
)


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """Every import of a package of the same or a higher layer (another package), as 'a -> b'."""
    layer = {name: i for i, names in enumerate(LAYERS) for name in names}

    def package(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    found = []
    for module, deps in sorted(graph.items()):
        if module == "megatron_rlhf":
            continue
        for dep in sorted(deps):
            here, there = package(module), package(dep)
            if here != there and layer[there] >= layer[here]:
                found.append(f"{module} -> {dep}")
    return found


def test_no_module_imports_a_package_above_it():
    graph = import_graph()
    packages = {m.split(".")[1] for m in graph if "." in m}
    assert packages == {name for names in LAYERS for name in names}, "a package without a layer (LAYERS)"
    assert upward_imports(graph) == []


def test_an_upward_import_is_found(tmp_path):
    pkg = tmp_path / "megatron_rlhf"
    for sub in ("roles", "rollout"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "rollout" / "rows.py").write_text("x = 1\n")
    (pkg / "roles" / "role_set.py").write_text("def f():\n    from megatron_rlhf.rollout.rows import x\n")
    assert upward_imports(import_graph(pkg)) == ["megatron_rlhf.roles.role_set -> megatron_rlhf.rollout.rows"]


# The names of a config key's domain that dispatch through a registry: spelt only in config/names.py,
# in the schema (the default) and in the module that builds the registry.
REGISTERED = {"KL_ESTIMATORS": "ppo/core.py", "LOSS_AGG_MODES": "ppo/core.py", "POLICY_LOSSES": "ppo/core.py",
              "ADVANTAGE_ESTIMATORS": "ppo/advantages.py", "DPO_LOSSES": "preference/core.py",
              "TOOL_PARSERS": "agents/parsers.py", "SANDBOX_KINDS": "agents/sandbox/__init__.py"}


def names_spelled_outside_their_registry(root: Path = PACKAGE) -> List[str]:
    """Each string constant (docstrings aside) equal to a registered name, outside its homes."""
    from megatron_rlhf.config import names

    homes = {"config/names.py", "config/schema.py"}
    found = []
    for path in sorted(root.rglob("*.py")):
        where = str(path.relative_to(root))
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str) or id(node) in docstrings:
                continue
            for table, home in REGISTERED.items():
                if node.value in getattr(names, table) and where not in homes | {home}:
                    found.append(f"{where}:{node.lineno} {node.value!r} ({table}, registered in {home})")
    return found


def test_a_registered_name_is_spelled_only_in_its_homes(tmp_path):
    assert names_spelled_outside_their_registry() == []
    (tmp_path / "roles").mkdir()
    (tmp_path / "roles" / "losses.py").write_text('def f(mode="token-mean"):\n    """k3 in a docstring is prose."""\n')
    assert names_spelled_outside_their_registry(tmp_path) == ["roles/losses.py:1 'token-mean' (LOSS_AGG_MODES, "
                                                              "registered in ppo/core.py)"]


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
    shared = {"__init__", "common", "findings", "environments_for_tests", "rewards_for_tests", "pool"}
    scripts = sorted(p.stem for p in workers.glob("*.py") if p.stem not in shared)
    assert scripts == sorted(FINDINGS), set(scripts) ^ set(FINDINGS)
    for name in scripts:
        imported = {alias.name for node in ast.walk(ast.parse((workers / f"{name}.py").read_text()))
                    if isinstance(node, ast.ImportFrom) and node.module == "tests.workers.findings" for alias in node.names}
        assert FINDINGS[name].__name__ in imported, f"tests/workers/{name}.py does not name its record {FINDINGS[name].__name__}"
