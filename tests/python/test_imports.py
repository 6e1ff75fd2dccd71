"""halocp's import graph: no circle (at any depth, function-level imports
included), and the leaf helpers import nothing of the package. Read from
the source with ast, so nothing is imported to check it.

    python3 -m pytest -p no:cacheprovider tests/python/test_imports.py
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "halocp"
LEAVES = ("_shapes", "_route")


def _modules() -> dict[str, Path]:
    """The package's modules by dotted name below halocp ("nn",
    "diffusers" for diffusers/__init__.py, "diffusers.ltx")."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (relative or absolute)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        # the package a relative import of level 1 starts from
        here = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)] if node.level - 1 <= len(here) else None
                    if base is None:
                        continue
                    base = [*base, *(node.module.split(".") if node.module else [])]
                elif (node.module or "").split(".")[0] == "halocp":
                    base = node.module.split(".")[1:]
                else:
                    continue
                # from . import a, b: the modules a and b; from .m import f: m
                subs = {".".join([*base, a.name]) for a in node.names} & modules.keys()
                deps.update(subs or {".".join(base)})
            elif isinstance(node, ast.Import):
                deps.update(a.name.removeprefix("halocp.") for a in node.names if a.name.startswith("halocp."))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycle(graph) -> list[str] | None:
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    graph = _graph()
    assert "__init__" in graph and graph["__init__"], "the walk found no imports: is the package where it was?"
    found = _cycle({m: d - {"__init__"} for m, d in graph.items()})
    assert found is None, "halocp imports in a circle: " + " -> ".join(found)


def test_leaves_import_nothing_of_the_package():
    graph = _graph()
    for leaf in LEAVES:
        assert not graph[leaf], f"halocp.{leaf} imports {sorted(graph[leaf])}: it is a leaf"


def test_the_walk_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# ---------------------------------------------------- issue 18 §1 and §2
HEADER = PACKAGE.parents[1] / "include" / "halo.h"


def _c_names() -> set[str]:
    import re

    text = HEADER.read_text()
    return set(re.findall(r"\b(halo_\w+)\s*\(", text)) | set(re.findall(r"\b(halo_\w+_t)\b", text))


def _boundary_uses(path: Path, c_names: set[str]) -> list[str]:
    """What a module names of the C boundary: ctypes, a C function or type
    of the header (as an attribute or a string), a field_mask bit, a params
    struct, the loaded library itself."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [a.name for a in node.names]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        for n in names:
            if (n == "ctypes" or n in c_names or n == "field_mask" or n.startswith(("COMM_PARAM_", "PLAN_PARAM_"))
                    or n in ("CommParams", "PlanParams", "lib")):
                found.append(f"{path.name}:{node.lineno}: {n}")
    return found


def test_only_lib_knows_the_c_boundary():
    """One ctypes boundary: only _lib.py imports ctypes, names C functions,
    structs or field_mask bits, or calls the loaded library; the rest call
    _lib's functions and its Plan."""
    c_names = _c_names()
    assert "halo_exchange_start" in c_names and "halo_plan_params_t" in c_names, "the header's names were not read"
    found = [u for m, p in sorted(_modules().items()) if m != "_lib" for u in _boundary_uses(p, c_names)]
    assert not found, "the C boundary is crossed outside _lib.py:\n  " + "\n  ".join(found)


def _functions(path: Path) -> list[str]:
    """The autograd Functions a module defines."""
    tree = ast.parse(path.read_text(), str(path))
    return [c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
            and any(ast.unparse(b).endswith("autograd.Function") for b in c.bases)]


def test_one_autograd_stack():
    """One autograd Function per public form (out of place, in place, halos
    only), shared by the blocking and started forms and every device: the
    device paths (_host.py, _cuda.py) define none."""
    assert len(_functions(PACKAGE / "exchange.py")) == 3, _functions(PACKAGE / "exchange.py")
    for path in (PACKAGE / "_host.py", PACKAGE / "_cuda.py", PACKAGE / "_inflight.py", PACKAGE / "_route.py"):
        assert not _functions(path), f"{path.name} defines autograd Functions {_functions(path)}: a second stack"


# ---------------------------------------------------------- issue 34 §2
def _op_names(path: Path) -> tuple[set[str], set[str]]:
    """(the halocp ops a module registers, those it calls): a registration
    is a call whose first argument is "halocp::NAME" (torch.library's
    custom_op, define, triton_op: whatever form), a use names
    torch.ops.halocp.NAME."""
    import re

    registered, used = set(), set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str) and (m := re.match(r"halocp::(\w+)", node.args[0].value))):
            registered.add(m.group(1))
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch.ops.halocp":
            used.add(node.attr)
    return registered, used


def _imported(graph, module) -> set[str]:
    """module and every module of the package it imports, at any depth."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def test_ops_are_registered_where_they_are_called():
    """A module that calls torch.ops.halocp.NAME registers NAME itself or
    imports the module that does: an op must not exist only because
    halocp/__init__.py happened to import its registration first."""
    graph = _graph()
    ops = {m: _op_names(p) for m, p in _modules().items()}
    owner = {}
    for m, (registered, _) in ops.items():
        for name in registered:
            assert name not in owner, f"halocp::{name} is registered in {owner[name]}.py and {m}.py"
            owner[name] = m
    assert {"exchange", "window_conv", "norm_statistics"} <= set(owner), owner  # the walk sees them
    missing = [f"{m}.py calls torch.ops.halocp.{name}, registered in "
               f"{owner[name] + '.py' if name in owner else 'no module'}, which it does not import"
               for m, (_, used) in sorted(ops.items()) for name in sorted(used)
               if owner.get(name) not in _imported(graph, m)]
    assert not missing, "\n  ".join(["ops used where they may not exist:"] + missing)


def test_no_ops_module():
    """Each op lives beside the eager code it twins: no _ops module
    gathering them above the modules that call them."""
    assert not (PACKAGE / "_ops.py").exists() and not (PACKAGE / "_ops").exists()


# ---------------------------------------------------- halocp.diffusers
def test_diffusers_families_stand_alone():
    """halocp.diffusers: one module per model family, each with its MODELS
    and BLOCKS tables, importing no other family (what they share is in
    _convert); the package lists every family it holds."""
    graph, shared = _graph(), {"diffusers._convert", "diffusers.split"}
    families = {m for m in graph if m.startswith("diffusers.") and m not in shared}
    assert {"diffusers.ltx", "diffusers.cogvideox"} <= families, families
    init = ast.parse((PACKAGE / "diffusers" / "__init__.py").read_text())
    listed = next(node.value for node in ast.walk(init) if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "_FAMILIES" for t in node.targets))
    assert {f"diffusers.{e.id}" for e in listed.elts} == families, "diffusers/__init__.py's _FAMILIES"
    for m in sorted(families):
        assert not graph[m] & families, f"halocp.{m} imports another family: {sorted(graph[m] & families)}"
        tree = ast.parse(_modules()[m].read_text())
        names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                 if isinstance(t, ast.Name)}
        assert {"MODELS", "BLOCKS"} <= names, f"halocp.{m} has no MODELS or BLOCKS table"


# ---------------------------------------------------- issue 34 §2: one shard table
def test_one_shard_table():
    """Every rank's row of a layer's arguments travels by one mechanism:
    _splits.ShardTable (there were two: an all_gather in _sharding beside
    the exchange of _splits)."""
    homes = [f"{m}.{node.name}" for m, path in sorted(_modules().items())
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, (ast.FunctionDef, ast.ClassDef))
             and node.name.lower().lstrip("_").replace("_", "") in ("shardtable", "shardtables")]
    assert homes == ["_splits.ShardTable"], homes


def test_halo_dtype_in_lib():
    """The map from torch's dtypes to halo_dtype_t is the C boundary's: it
    lives in _lib, which imports no torch, and nowhere else."""
    homes = [m for m, path in sorted(_modules().items()) for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name == "halo_dtype"]
    assert homes == ["_lib"], homes
    lib = ast.parse((PACKAGE / "_lib.py").read_text())
    assert not [n for n in ast.walk(lib) if isinstance(n, (ast.Import, ast.ImportFrom))
                and any(a.name.split(".")[0] == "torch" for a in n.names) or
                isinstance(n, ast.ImportFrom) and (n.module or "").startswith("torch")]


# ---------------------------------------------------- issue 34 §2: one cache
# Process-wide caches that are no communicator's prepared state: norm.py's
# header tensors and zeros (small constant tensors, by value and device).
_NOT_PREPARED_STATE = {("norm", "_header_tensor"), ("norm", "_zeros")}


def test_one_cache_of_prepared_state():
    """A communicator's prepared state (plans, routes, the CUDA paths'
    buffers) lives in its one cache, Communicator.prepared, with one
    eviction policy: no other module makes an OrderedDict, evicts
    (popitem, move_to_end), or keeps an lru_cache (bar the process-wide
    constants above)."""
    found = []
    for m, path in sorted(_modules().items()):
        if m == "_comm":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef):
                cached = [d for d in node.decorator_list if "cache" in ast.unparse(d)]
                if cached and (m, node.name) not in _NOT_PREPARED_STATE:
                    found.append(f"{path.name}:{node.lineno}: {node.name} is an lru_cache")
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in ("OrderedDict", "popitem", "move_to_end"):
                found.append(f"{path.name}:{node.lineno}: {name}")
    assert not found, "prepared state kept outside Communicator.prepared:\n  " + "\n  ".join(found)


# ------------------------------------ issue 34 §1: the library frees requests
def test_requests_are_freed_at_their_finish():
    """halo_request_free on a live request means "release it when it ends"
    (the library reports a failure nobody was told of at the next exchange),
    so halocp keeps no request bookkeeping of its own: _lib.Plan.free is the
    one call of halo_request_free, Pending._release the one caller of
    free, and no Communicator list holds requests for later (there was
    comm.waited, drained by _inflight.reap)."""
    calls = []
    for m, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr == "halo_request_free":
                    calls.append(f"{m}.{fn.name} calls halo_request_free")
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "free" \
                        and "request" in ast.unparse(node.args):
                    calls.append(f"{m}.{fn.name} frees")
                if isinstance(node, ast.Attribute) and node.attr in ("waited", "reap"):
                    calls.append(f"{m}.{fn.name} uses .{node.attr}")
    assert sorted(calls) == ["_inflight._release frees", "_lib.free calls halo_request_free"], calls
