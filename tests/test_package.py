"""The package's shape: its modules import each other without a circle (function-local imports
included), and every error z3ext raises on purpose is a `Z3extError` as well as the builtin a
DeepSpeed caller would catch. No ranks needed."""
import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "deepspeed_z3ext"


def _imports(path):
    """Sibling modules `path` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "deepspeed_z3ext":  # from deepspeed_z3ext import a, b
                out.update(a.name for a in node.names)
            elif node.module.startswith("deepspeed_z3ext."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("deepspeed_z3ext."))
    return out


def import_graph():
    modules = {p.stem: p for p in PACKAGE.glob("*.py")}
    return {name: sorted(m for m in _imports(p) if m in modules and m != name)
            for name, p in modules.items() if name != "__init__"}


def find_cycle(graph):
    """One import circle as a list of modules, or None."""
    state, path = {}, []

    def visit(n):
        state[n] = "open"
        path.append(n)
        for m in graph.get(n, ()):
            if state.get(m) == "open":
                return path[path.index(m):] + [m]
            if m not in state:
                cycle = visit(m)
                if cycle:
                    return cycle
        state[n] = "done"
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state:
            cycle = visit(n)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one():
    # The checker itself: a circle through a function-local import is found.
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None


def test_package_has_no_import_circle():
    graph = import_graph()
    assert "state" in graph and "seams" in graph, graph
    importers = [m for m, deps in graph.items() if "seams" in deps]
    assert importers == [], f"seams.py is the top layer; imported by {importers}"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_errors_share_one_base(tmp_path):
    import deepspeed_z3ext
    from deepspeed_z3ext.config import parse_section

    with pytest.raises(deepspeed_z3ext.Z3extError, match="bogus") as e:
        parse_section({"z3ext": {"enabled": True, "bogus": 1}})
    assert isinstance(e.value, (ValueError, deepspeed_z3ext.Z3extConfigError))

    h = deepspeed_z3ext.aio_handle(1 << 20, 8, False, False, 1)
    import torch
    buf = torch.empty(4096, dtype=torch.uint8)
    with pytest.raises(deepspeed_z3ext.Z3extError, match="missing.bin") as e:
        h.sync_pread(buf, str(tmp_path / "missing.bin"))
    assert isinstance(e.value, OSError) and isinstance(e.value, deepspeed_z3ext.AioError)
    assert issubclass(deepspeed_z3ext.ClaimError, RuntimeError)
    assert issubclass(deepspeed_z3ext.GradientError, RuntimeError) and issubclass(deepspeed_z3ext.GradientError, deepspeed_z3ext.Z3extError)
    assert issubclass(deepspeed_z3ext.Z3extLauncherError, RuntimeError)
    assert issubclass(deepspeed_z3ext.Z3extLauncherError, deepspeed_z3ext.Z3extError)
