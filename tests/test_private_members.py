"""No module uses another module's private members (docs/architecture.md), checked with ``ast``.

A use is ``obj._name`` (one leading underscore) on anything but ``self`` or ``cls``, in a module that
does not define ``_name`` itself (as a function, class, variable or attribute), where some other module
of the project does: then the name is that module's own, and what is shared must be public. Library
internals (``torch._foreach_add_``, ``module._parameters``) are not the project's: they are left to the
libraries. Tests may reach into internals; the package may not.

Running this file as a script prints the uses (``python tests/test_private_members.py``).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("hgraph", "passes", "frontends", "runtime", "tools")


def _defined(tree: ast.AST) -> set[str]:
    """The names a module defines: functions, classes, variables and attributes it assigns."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            names.add(n.attr)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
    return names


def private_uses(sources: dict[str, str]) -> list[str]:
    """``path:line: expression`` of each private member of another module used, over ``sources``
    (path -> module text)."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    defined = {path: _defined(tree) for path, tree in trees.items()}
    out = []
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")):
                continue
            base = ast.unparse(n.value)
            if base in ("self", "cls") or base.split(".")[0] == "torch" or n.attr in defined[path]:
                continue
            if any(n.attr in names for other, names in defined.items() if other != path):
                out.append(f"{path}:{n.lineno}: {ast.unparse(n)}")
    return sorted(out)


def _project_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8")
            for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))}


def test_no_module_uses_another_modules_private_members():
    uses = private_uses(_project_sources())
    assert uses == [], "\n".join(uses)


def test_the_check_finds_a_private_member_used_from_another_module():
    sources = {"a.py": "class Meter:\n    def _pack(self, t):\n        return t\n",
               "b.py": "def hook(meter, t):\n    return meter._pack(t)\n",
               "c.py": "def own(x):\n    x._mine = 1\n    return x._mine, x._parameters\n"}
    assert private_uses(sources) == ["b.py:2: meter._pack"]


if __name__ == "__main__":
    found = private_uses(_project_sources())
    print("\n".join(found) or "no private member of another module used")
    print(f"{len(found)} uses")
