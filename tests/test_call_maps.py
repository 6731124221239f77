"""The call maps at the top of npattn/functional/attention.py, npattn/kernels/attention.py and
npattn/kernels/gemm.py hold: every name they give exists, and every arrow is a call in the
code. Read from the source with ``ast`` (the engine modules cannot be imported plainly: they
are loaded once per register tile), so no kernel compiles.

A map is the literal block after a line starting "Call map" in the module docstring, one edge
per line::

    caller[, caller...] -> callee[, callee...]     # a comment
                           callee, ...             # (a line without an arrow continues)

A callee is looked up from the caller's module first. ``a -> b``: a's body calls b (``b(...)``, or ``x.b(...)``). ``a => b``: a hands b on without
calling it by name -- a work item passed to ``parallel_items(b)``, a kernel chosen as ``run =
b.serial if ... else b`` -- so b's name appears in a (its decorators included). A name is
``name`` (defined in, or imported into, the map's module), ``alias.name`` (alias: a module the
map's module imports) or ``path::name`` (path under npattn/, for an object reached at run
time: ``run.kernels.attention_forward_kernel``).
"""
import ast
import importlib
import pathlib
import re

import pytest

from npattn.functional.attention import AttentionOptions

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "npattn"
MAPPED = ("functional/attention.py", "kernels/attention.py", "kernels/gemm.py")
ARROW = re.compile(r"\s(->|=>)\s")


# ------------------------------------------------------------------ reading a map

def call_map(text):
    """[(line number in text, callers, arrow, callees)] of the map in a docstring ``text``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("Call map")),
                 None)
    if start is None:
        return []
    while not lines[start].rstrip().endswith("::"):             # the heading may wrap
        start += 1
    edges, i = [], start + 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    indent = len(lines[i]) - len(lines[i].lstrip()) if i < len(lines) else 0
    for n in range(i, len(lines)):
        line = lines[n]
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break                                               # the block ends
        body = line.split("#")[0].strip()
        if not body:
            continue
        match = ARROW.search(f" {body} ")
        if match:
            left, right = f" {body} ".split(match.group(0), 1)
            edges.append((n + 1, names(left), match.group(1), names(right)))
        elif edges:                                             # a continuation line
            edges[-1][3].extend(names(body))
        else:
            raise ValueError(f"line {n + 1} of the call map has no arrow: {line!r}")
    return edges


def names(text):
    return [name.strip() for name in text.split(",") if name.strip()]


# ------------------------------------------------------------------ resolving names

_trees = {}


def tree(path):
    if path not in _trees:
        _trees[path] = ast.parse(path.read_text())
    return _trees[path]


def module_path(path, module, level):
    """The file (or package __init__) of a ``from <level dots><module> import`` in ``path``."""
    base = path.parent
    for _ in range(level - 1):
        base = base.parent
    target = base.joinpath(*module.split(".")) if module else base
    for candidate in (target.with_suffix(".py"), target / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def resolve(path, name):
    """The (file, top-level node) that defines ``name`` as seen from module ``path``, or
    (module file, None) when the name is a module; None when it does not exist."""
    if "::" in name:
        file, _, name = name.partition("::")
        return resolve(PACKAGE / file, name)
    head, _, rest = name.partition(".")
    for node in tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == head:
            found = (path, node)
            break
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == head for target in node.targets
                for t in ([target] + list(getattr(target, "elts", [])))):
            found = (path, node)
            break
        if isinstance(node, ast.ImportFrom) and node.level:
            alias = next((a for a in node.names if (a.asname or a.name) == head), None)
            if alias is None:
                continue
            source = module_path(path, node.module, node.level)
            as_module = module_path(path, f"{node.module}.{alias.name}" if node.module
                                    else alias.name, node.level)
            if as_module is not None:                            # a module: from .. import x
                found = (as_module, None)
            elif source is not None:
                found = resolve(source, alias.name)
            else:
                return None
            break
    else:
        return None
    if not rest:
        return found
    return resolve(found[0], rest) if found and found[1] is None else None


def uses(function, callee, arrow):
    """Whether FunctionDef ``function`` calls ``callee`` (->) or names it (=>)."""
    last = callee.rpartition("::")[2].rpartition(".")[2]
    for node in ast.walk(function):
        if arrow == "->" and isinstance(node, ast.Call):
            func = node.func
            if (isinstance(func, ast.Name) and func.id == last) or (
                    isinstance(func, ast.Attribute) and func.attr == last):
                return True
        if arrow == "=>" and ((isinstance(node, ast.Name) and node.id == last) or (
                isinstance(node, ast.Attribute) and node.attr == last)):
            return True
    return False


def drift(path, text):
    """What in the map of ``text`` (the docstring of ``path``) does not hold: a list of
    messages, empty when every name exists and every arrow is in the code."""
    problems = []
    edges = call_map(text)
    if not edges:
        return [f"{path.name}: no call map"]
    for line, callers, arrow, callees in edges:
        for caller in callers:
            found = resolve(path, caller)
            if found is None or not isinstance(found[1], ast.FunctionDef):
                problems.append(f"line {line}: {caller} is not a function")
                continue
            for callee in callees:                      # seen from the caller's module
                if resolve(found[0], callee) is None and resolve(path, callee) is None:
                    problems.append(f"line {line}: {callee} does not exist")
                elif not uses(found[1], callee, arrow):
                    verb = "call" if arrow == "->" else "name"
                    problems.append(f"line {line}: {caller} does not {verb} {callee}")
    return problems


def docstring(relative):
    path = PACKAGE / relative
    return path, ast.get_docstring(tree(path), clean=False)


# ------------------------------------------------------------------ the tests

@pytest.mark.parametrize("relative", MAPPED)
def test_call_map_holds(relative):
    path, text = docstring(relative)
    assert drift(path, text) == []


def test_maps_reach_from_the_public_op_to_the_tiles():
    """The three maps join up: functional's map names the kernels whose work items and tiles
    the kernel maps follow, and linear/matmul reach the GEMM engine's map."""
    callees = {relative: {c for _, _, _, cs in call_map(docstring(relative)[1]) for c in cs}
               for relative in MAPPED}
    callers = {relative: {c for _, cs, _, _ in call_map(docstring(relative)[1]) for c in cs}
               for relative in MAPPED}
    assert {"kernels/attention.py::attention_forward_kernel",
            "kernels/attention.py::attention_backward_kernel"} <= callees[MAPPED[0]]
    assert {"attention_forward_kernel", "forward_item", "attention_backward_kernel",
            "forward_pair", "backward_item", "backward_pair", "backward_tiles",
            "mask_keys"} <= callers[MAPPED[1]]
    assert {"micro_kernel", "mask_panel", "panel_softmax", "mask_tile",
            "mask_keys"} <= callees[MAPPED[1]]
    assert {"gemm", "gemm_kernel", "rows_item", "block_product"} <= callers[MAPPED[2]]


@pytest.mark.parametrize("old, new, message", [
    # an arrow to a function that is not called there
    ("_run_forward  -> _forward_blocks, kernels/attention.py::attention_forward_kernel",
     "_run_forward  -> _forward_blocks, kernels/attention.py::attention_backward_kernel",
     "_run_forward does not call kernels/attention.py::attention_backward_kernel"),
    # a name that was renamed away
    ("_varlen_run -> _checks.varlen_args", "_varlen_run -> _checks.packed_args",
     "_checks.packed_args does not exist"),
])
def test_a_planted_drift_fails(old, new, message):
    path, text = docstring(MAPPED[0])
    assert old in text
    problems = drift(path, text.replace(old, new))
    assert any(message in p for p in problems), problems


def test_a_work_item_arrow_needs_the_name():
    path, text = docstring(MAPPED[1])
    planted = text.replace("attention_forward_kernel  => forward_item",
                           "attention_forward_kernel  => backward_item")
    assert planted != text
    assert any("attention_forward_kernel does not name backward_item" in p
               for p in drift(path, planted))


@pytest.mark.parametrize("name", ["attention", "gemm"])
def test_importing_an_engine_module_says_how_to_reach_it(name):
    with pytest.raises(ImportError, match=rf"tiles\.engine\('{name}', dtype\)"):
        importlib.import_module(f"npattn.kernels.{name}")


def test_options_travel_as_one_record():
    """Below the public entry points no function of functional/attention.py or _checks.py
    takes attention's options one by one: they take the record, AttentionOptions (or the
    checked AttentionArgs). (A helper may take the one value it computes with, as
    _sink_gradient the sink logits.)"""
    public = set(importlib.import_module("npattn").__all__)
    threaded = []
    for relative in ("functional/attention.py", "_checks.py"):
        for node in tree(PACKAGE / relative).body:
            if isinstance(node, ast.FunctionDef) and node.name not in public:
                params = {a.arg for a in node.args.args + node.args.kwonlyargs}
                options = sorted(params & set(AttentionOptions._fields))
                if len(options) > 1:
                    threaded.append(f"{relative}::{node.name}{tuple(options)}")
    assert threaded == []
