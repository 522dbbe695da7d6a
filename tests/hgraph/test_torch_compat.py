"""The torch range hgraph claims is true: what it calls exists in the floor version.

* ``pyproject.toml``'s torch floor is ``torch_compat.TORCH_FLOOR``;
* the installed torch has every function, keyword and attribute ``torch_compat`` records as present
  in the floor (run on the floor version, this fails if the record is wrong);
* every call of those functions in the project passes only the recorded keywords (a keyword that came
  after the floor, e.g. ``torch.compile(recompile_limit=)``, fails here on any torch);
* the names that moved between releases appear only in ``hgraph/torch_compat.py``;
* ``torch_compat.limit_recompiles`` bounds dynamo's compilations of a function.
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import torch

from hgraph import torch_compat

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("hgraph", "passes", "frontends", "runtime", "tools")
COMPAT = REPO / "hgraph" / "torch_compat.py"
# identifiers whose place or form differs across the supported torch releases
VERSION_SPECIFIC = ("recompile_limit", "cache_size_limit", "varlen_attn", "torch.nn.attention.varlen",
                    "all_gather_into_tensor", "reduce_scatter_tensor")


def project_files() -> list[Path]:
    return [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted torch name, from the module's imports (``import torch.nn.functional as F``,
    ``from torch.utils.checkpoint import checkpoint``)."""
    out = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch"):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def torch_calls(path: Path):
    """(dotted torch function, keywords, line) of every call in ``path`` through a torch name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = _aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            if head in aliases:
                full = aliases[head] + ("." + rest if rest else "")
                yield full, {k.arg for k in node.keywords if k.arg}, node.lineno


def test_pyproject_floor_is_the_compat_floor():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert floor, "pyproject.toml: no torch>=X.Y dependency"
    assert (int(floor.group(1)), int(floor.group(2))) == torch_compat.TORCH_FLOOR


def test_installed_torch_has_what_the_floor_promises():
    for path, keywords in torch_compat.FLOOR_KEYWORDS.items():
        params = inspect.signature(torch_compat.resolve(path)).parameters
        missing = keywords - set(params)
        assert not missing, f"{path} takes no {sorted(missing)} in torch {torch.__version__}"
    for path in torch_compat.FLOOR_ATTRIBUTES:
        torch_compat.resolve(path)


def test_project_passes_only_floor_keywords():
    bad = []
    for path in project_files():
        for name, keywords, line in torch_calls(path):
            allowed = torch_compat.FLOOR_KEYWORDS.get(name)
            if allowed is not None and keywords - allowed:
                bad.append(f"{path.relative_to(REPO)}:{line}: {name}({', '.join(sorted(keywords - allowed))}=)")
    assert not bad, ("keywords the torch floor does not have (guard them in hgraph/torch_compat.py):\n"
                     + "\n".join(bad))


def _names(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, node.value.lineno
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = getattr(node, "module", None) or ""
            for a in node.names:
                yield f"{module}.{a.name}" if module else a.name, node.lineno
        elif isinstance(node, ast.Call) and _dotted(node.func) in ("importlib.util.find_spec",
                                                                    "importlib.import_module"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield arg.value, node.lineno


def test_version_specific_names_only_in_the_compat_module():
    bad = []
    for path in project_files():
        if path == COMPAT:
            continue
        for name, line in _names(ast.parse(path.read_text(encoding="utf-8"))):
            if any(name == v or name.startswith(v + ".") or name.endswith("." + v) for v in VERSION_SPECIFIC):
                bad.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not bad, "version-specific torch names outside hgraph/torch_compat.py:\n" + "\n".join(bad)


def test_recompile_limit_bounds_compilations():
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return gm.forward

    double = torch.compile(lambda x: x * 2, backend=counting, dynamic=False)
    with torch_compat.limit_recompiles(2):
        for n in range(1, 5):
            assert torch.equal(double(torch.ones(n)), torch.full((n,), 2.0))
    assert len(compiles) == 2
