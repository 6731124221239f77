"""The layering of docs/architecture.md §2, held by reading imports: arrows point down only.

kernels/ never sees a check or a Python object; functional/ never loops over elements; the
textbook imports nothing but NumPy; nothing below the people layer imports anything above it;
no layer imports torch (PyTorch is an oracle for tests and a peer in benchmarks only).
"""
import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "npattn"
STDLIB = set(sys.stdlib_module_names)

# module (or package prefix) -> third-party and npattn modules it may import (prefix match)
ALLOWED = {
    # the policy module adds the full-width function attribute through llvmlite (Numba's own
    # dependency, never a new one): docs/architecture.md §9.6
    "npattn._jit": {"numba", "numpy", "llvmlite"},
    "npattn._checks": {"numpy"},
    "npattn.reference": {"numpy"},
    # (first match wins) the register tile, the packing and the attention forward's exps write
    # LLVM IR: llvmlite, which Numba itself needs
    "npattn.kernels.vector_tile": {"numpy", "numba", "llvmlite"},
    "npattn.kernels.vector_pack": {"numba", "llvmlite"},
    "npattn.kernels.vector_exp": {"numba", "llvmlite", "npattn.kernels.exp"},
    "npattn.kernels": {"numpy", "numba", "npattn._jit", "npattn.kernels"},
    # (first match wins) the fused decode block composes the functional ops' own bodies after
    # their checks, so that its bits are theirs: docs/architecture.md §2
    "npattn.functional.block": {"numpy", "npattn._checks", "npattn.kernels",
                                "npattn.functional"},
    "npattn.functional": {"numpy", "npattn._checks", "npattn.kernels"},
    "npattn.nn": {"numpy", "npattn._checks", "npattn.functional", "npattn.nn"},
    "npattn.optim": {"numpy", "npattn._checks", "npattn.nn", "npattn.kernels.adam"},
    "npattn.gradcheck": {"numpy", "npattn._checks"},
    "npattn.models": {"numpy", "npattn._checks", "npattn.functional", "npattn.nn",
                      "npattn.models"},
    "npattn.distributed": {"numpy", "npattn.nn", "npattn.optim", "mpi4py"},
}


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path):
    """Absolute names of everything a module imports (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module
            if node.module is None and node.level:  # from . import x, y
                yield from (f"{stem}.{alias.name}" for alias in node.names)
            else:
                yield stem


def rule_for(name):
    for prefix, allowed in ALLOWED.items():
        if name == prefix or name.startswith(prefix + "."):
            return allowed
    return None


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_imports_point_down(path):
    name = module_name(path)
    allowed = rule_for(name)
    for imported in imports(path):
        top = imported.split(".")[0]
        assert top != "torch", f"{name} imports torch: PyTorch is never a runtime dependency"
        if allowed is None or top in STDLIB:
            continue
        assert any(imported == a or imported.startswith(a + ".") for a in allowed), \
            f"{name} imports {imported}; its layer may import only {sorted(allowed)} and the stdlib"


TOOLS = "npattn.tools"   # the people layer: the command and its subcommands, on top of all
PEOPLE = {"npattn", "npattn.__main__"}


def is_tool(name):
    return name == TOOLS or name.startswith(TOOLS + ".")


def test_every_layer_is_checked():
    """A new module must be placed in a layer here, or be a tool (the people layer)."""
    for path in MODULES:
        name = module_name(path)
        assert rule_for(name) is not None or name in PEOPLE or is_tool(name), \
            f"{name} has no layering rule"


def test_only_the_tools_import_the_tools():
    """The library never depends on its commands: only npattn.tools and ``python -m npattn``
    import from npattn.tools."""
    for path in MODULES:
        name = module_name(path)
        if is_tool(name) or name == "npattn.__main__":
            continue
        for imported in imports(path):
            assert not is_tool(imported), f"{name} imports {imported}: the library imports no tool"


def test_only_jit_calls_njit():
    for path in MODULES:
        if module_name(path) == "npattn._jit":
            continue
        source = path.read_text()
        assert "njit" not in source and "numba.jit" not in source, \
            f"{module_name(path)} compiles on its own: use npattn._jit"
