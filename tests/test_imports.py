"""The import structure: no module of ``kernel`` or ``rpa_tune`` imports another that
(directly or through others) imports it back, counting imports inside functions too; and
the kernel imports nothing of the tuner."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kernel", "rpa_tune")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (REPO / pkg).rglob("*.py"):
            parts = list(p.relative_to(REPO).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, known) -> set[str]:
    """The project modules ``name`` imports anywhere in its body (a ``from m import x`` names
    ``m.x`` when that is a module, else ``m``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_even_through_function_local_imports():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_kernel_imports_nothing_of_the_tuner():
    mods = _modules()
    bad = {m: sorted(d for d in _imports(m, p, mods) if d.startswith("rpa_tune"))
           for m, p in mods.items() if m.startswith("kernel")}
    assert not {m: d for m, d in bad.items() if d}
    text = [p for m, p in mods.items() if m.startswith("kernel") and "rpa_tune" in
            "".join(l for l in p.read_text().splitlines() if l.lstrip().startswith(("import", "from")))]
    assert not text


def test_every_test_module_is_in_exactly_one_tier():
    from conftest import TIERS
    listed = [m for modules in TIERS.values() for m in modules]
    files = sorted(p.stem for p in (REPO / "tests").glob("test_*.py"))
    assert sorted(listed) == files, (set(files) ^ set(listed))
