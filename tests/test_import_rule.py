"""The import rule of the tree (docs/architecture.md), checked with ``ast`` over every module.

* ``passes`` and ``frontends`` import only ``hgraph`` IR modules (and libraries);
* ``runtime`` imports ``hgraph`` IR modules, ``frontends`` (to build models) and itself, never
  ``passes`` or ``tools`` (it reaches the compiler through ``CompiledModule.instantiate``);
* IR modules of ``hgraph/`` import none of the rooms; only the API modules that wire them
  (``API_MODULES``: ``hgraph.compiled`` wires frontends and passes, ``hgraph.training`` the runtime's
  run object) may, inside their functions, and no module of ``hgraph/`` imports ``tools`` at all;
* imports sit at the top of a module, except optional heavy dependencies (``LAZY_LIBRARIES``) and the
  API module's wiring;
* inside ``runtime`` the sub-rooms have a declared order (``RUNTIME_ORDER``, lowest first): a
  sub-room imports itself and the sub-rooms before it, never one after it, so no two sub-rooms
  import each other;
* no import cycles among the project's modules (top-level imports).

Running this file as a script prints the report (``python tests/test_import_rule.py``).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"hgraph": "hgraph", "passes": "hgraph.passes", "frontends": "hgraph.frontends",
         "runtime": "hgraph.runtime", "tools": "hgraph.tools"}
ROOMS = ("hgraph.passes", "hgraph.frontends", "hgraph.runtime", "hgraph.tools")
API_MODULES = {"hgraph.compiled", "hgraph.training"}   # the public API wires the rooms together, lazily
# optional or heavy dependencies a module may import where it needs them
LAZY_LIBRARIES = ("transformers", "matplotlib", "ortools", "flash_attn", "torch.nn.attention.varlen",
                  "tensorboard", "torch.utils.tensorboard", "wandb", "safetensors", "tomllib", "tomli", "tokenizers", "pyarrow", "datasets",
                  "torch._dynamo")     # a sixth of a process's start-up CPU time, needed only to compile
# runtime's sub-rooms, lowest first: each may import those before it; research (offline studies and
# the papers' baselines) comes last, so nothing a training run imports reaches it
RUNTIME_ORDER = ("process", "kernels", "comm", "data", "engine", "checkpoint", "weights", "planner", "train", "research")
ALLOWED = {
    "hgraph.passes": ("hgraph.passes",),
    "hgraph.frontends": ("hgraph.frontends",),
    "hgraph.runtime": ("hgraph.runtime", "hgraph.frontends"),
    "hgraph.tools": ROOMS,
}


def modules() -> dict[str, Path]:
    out = {}
    for root, package in ROOTS.items():
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO / root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def room(module: str) -> str:
    for r in ROOMS:
        if module == r or module.startswith(r + "."):
            return r
    return "hgraph"


def sub_room(module: str) -> str | None:
    """The runtime sub-room of ``module`` (``"engine"`` for ``hgraph.runtime.engine.executor``), else None."""
    parts = module.split(".")
    if parts[:2] == ["hgraph", "runtime"] and len(parts) > 2:
        return parts[2]
    return None


def imports(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at top level) of every import statement, resolved to module names."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    known = modules_cache()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            # `from pkg import mod` imports the module pkg.mod
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            out.append((name, node.lineno, id(node) in top))
    return out


_CACHE: dict[str, Path] = {}


def modules_cache() -> dict[str, Path]:
    if not _CACHE:
        _CACHE.update(modules())
    return _CACHE


def violations() -> list[str]:
    found = []
    graph = nx.DiGraph()
    for module, path in modules_cache().items():
        rel = path.relative_to(REPO)
        graph.add_node(module)
        for name, line, at_top in imports(path, module):
            where = f"{rel}:{line}"
            ours = name == "hgraph" or name.startswith("hgraph.")
            if not at_top:
                lazy_ok = (module in API_MODULES and ours) or name.startswith(LAZY_LIBRARIES)
                if not lazy_ok:
                    found.append(f"{where}: import of {name} inside a function (imports go at the top)")
            if not ours:
                continue
            src, dst = room(module), room(name)
            if src == "hgraph" and dst == "hgraph.tools":       # no exception: the API wires rooms, not tools
                found.append(f"{where}: {module} ({src}) imports {name} ({dst})")
            elif src == "hgraph" and dst != "hgraph" and module not in API_MODULES:
                found.append(f"{where}: IR module {module} imports {name} ({dst})")
            elif src != "hgraph" and dst != "hgraph" and dst not in ALLOWED[src]:
                found.append(f"{where}: {module} ({src}) imports {name} ({dst})")
            low, high = sub_room(module), sub_room(name)
            if low and high and low != high:
                if low not in RUNTIME_ORDER or high not in RUNTIME_ORDER:
                    found.append(f"{where}: runtime sub-room {low if low not in RUNTIME_ORDER else high} "
                                 "is not in RUNTIME_ORDER")
                elif RUNTIME_ORDER.index(high) > RUNTIME_ORDER.index(low):
                    found.append(f"{where}: {module} ({low}) imports {name} ({high}, later in RUNTIME_ORDER)")
            if at_top and name in modules_cache() and name != module:
                graph.add_edge(module, name)
    for cycle in nx.simple_cycles(graph):
        if len(cycle) > 1 and not all(m in API_MODULES for m in cycle):
            found.append("import cycle: " + " -> ".join(cycle + cycle[:1]))
    return list(dict.fromkeys(found))   # one line per import statement, however many names it takes


def test_imports_follow_the_rule():
    found = violations()
    assert not found, "\n".join(found)


def test_no_module_of_hgraph_imports_tools():
    """The IR and the API modules alike: ``hgraph/`` reaches no ``tools`` module, lazily or not."""
    reached = [f"{path.relative_to(REPO)}:{line}: {name}" for module, path in modules_cache().items()
               if room(module) == "hgraph" for name, line, _ in imports(path, module)
               if room(name) == "hgraph.tools"]
    assert not reached, "\n".join(reached)


if __name__ == "__main__":
    found = violations()
    print(f"import rule: {len(modules_cache())} modules checked, {len(found)} violations")
    print("runtime sub-rooms, lowest first: " + " < ".join(RUNTIME_ORDER))
    print("\n".join(found))
    sys.exit(1 if found else 0)
