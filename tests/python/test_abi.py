"""halocp's copies of include/halo.h (constants, structs, version) against
the header itself, and the built library's exports against the header.
Needs no torch; the exports check needs libhalo.so:

    HALO_LIBRARY=build/lib/libhalo.so python3 -m pytest -p no:cacheprovider -q tests/python/test_abi.py
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEADER_TEXT = (REPO / "include" / "halo.h").read_text()
# Comments hold prose like "1 .. 8" and "e.g."; the declarations are parsed without them.
HEADER = re.sub(r"/\*.*?\*/|//[^\n]*", "", HEADER_TEXT, flags=re.S)


def _load_lib():
    # _lib.py alone, not the package: halocp/__init__ imports torch.
    spec = importlib.util.spec_from_file_location("halocp_lib_copy", REPO / "python" / "halocp" / "_lib.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LIB = _load_lib()


def _defines() -> dict[str, str]:
    found = dict(re.findall(r"^#define (HALO_\w+) +(.+?)\s*$", HEADER, flags=re.M))
    assert "HALO_VERSION_MAJOR" in found, "found no #define HALO_VERSION_* in include/halo.h"
    return found


def _value(name: str, expr: str) -> int:
    m = re.fullmatch(r"(\d+)u?(?:\s*<<\s*(\d+))?", expr.strip())
    if not m:
        raise AssertionError(f"include/halo.h: {name} = {expr!r}: not N or N << M, teach test_abi.py")
    return int(m[1]) << int(m[2] or 0)


def _enums() -> tuple[dict[str, int], set[str]]:
    """Every enum constant of the header, and the typedef names of the enums."""
    bodies = re.findall(r"\benum(?:\s+\w+)?\s*\{(.*?)\}\s*(\w*)\s*;", HEADER, flags=re.S)
    assert len(bodies) == len(re.findall(r"\benum\b", HEADER)) >= 6, "include/halo.h: cannot parse every enum"
    constants, types = {}, set()
    for body, typedef in bodies:
        entries = [e.strip() for e in body.split(",")]
        assert entries and all(entries), f"include/halo.h: empty entry in enum {typedef or body!r}"
        for e in entries:
            name, eq, expr = e.partition("=")
            name = name.strip()
            assert eq and re.fullmatch(r"HALO_\w+", name), f"include/halo.h: enum entry {e!r} has no explicit value"
            constants[name] = _value(name, expr)
        if typedef:
            types.add(typedef)
    return constants, types


def _structs() -> dict[str, list[tuple[str, str]]]:
    """The members (type, name) of each typedef'd struct with a body."""
    found = {}
    for body, typedef in re.findall(r"typedef struct \w+\s*\{(.*?)\}\s*(\w+)\s*;", HEADER, flags=re.S):
        members = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            m = re.fullmatch(r"(.+?)\s*\b(\w+)", " ".join(decl.split()))
            assert m, f"include/halo.h: cannot parse member {decl!r} of {typedef}"
            members.append((m[1].replace(" *", "*"), m[2]))
        found[typedef] = members
    assert {"halo_comm_params_t", "halo_plan_params_t"} <= found.keys(), "include/halo.h: parameter structs not found"
    return found


def test_constants_match_header():
    """Every enum constant of the header, under its name less HALO_, has the header's value."""
    constants, _ = _enums()
    for name in ("HALO_SUCCESS", "HALO_ERR_INTERNAL", "HALO_FLOAT32", "HALO_PAD_ZEROS", "HALO_BOOTSTRAP_EXTERNAL",
                 "HALO_COMM_PARAM_TIMEOUT", "HALO_PLAN_PARAM_PADDING"):
        assert name in constants, f"the parser missed {name} in include/halo.h"
    wrong = []
    for name, value in constants.items():
        py = name.removeprefix("HALO_")
        if not hasattr(LIB, py):
            wrong.append(f"{name} = {value}: _lib.py has no {py}")
        elif getattr(LIB, py) != value:
            wrong.append(f"{name} = {value}: _lib.py has {py} = {getattr(LIB, py)}")
    assert not wrong, "\n".join(wrong)


def test_no_stale_constants():
    """_lib.py has no result code, dtype, padding, bootstrap or mask bit that the header lacks."""
    constants, _ = _enums()
    pattern = r"SUCCESS|ERR_\w+|(?:B?FLOAT\d+)|PAD_\w+|BOOTSTRAP_\w+|COMM_PARAM_\w+|PLAN_PARAM_\w+"
    stale = [n for n in vars(LIB) if re.fullmatch(pattern, n) and "HALO_" + n not in constants]
    assert not stale, f"_lib.py names constants include/halo.h lacks: {stale}"


def test_structs_match_header():
    """CommParams and PlanParams have the header's fields, in its order, with matching types."""
    _, enum_types = _enums()
    ctype = {
        "uint64_t": ctypes.c_uint64,
        "int32_t": ctypes.c_int32,
        "int64_t": ctypes.c_int64,
        "const char*": ctypes.c_char_p,
        "const int64_t*": ctypes.POINTER(ctypes.c_int64),
        **{t: ctypes.c_int for t in enum_types},  # C enums here are int-sized
    }
    structs = _structs()
    for cname, py in (("halo_comm_params_t", LIB.CommParams), ("halo_plan_params_t", LIB.PlanParams)):
        members = structs[cname]
        names, want = [f[0] for f in py._fields_], [n for _, n in members]
        assert names == want, f"{py.__name__} fields {names} differ from {cname} {want}"
        for (ctyp, name), (_, pytyp) in zip(members, py._fields_):
            assert ctyp in ctype, f"{cname}.{name}: type {ctyp!r} unknown to test_abi.py"
            assert pytyp is ctype[ctyp], f"{py.__name__}.{name} is {pytyp.__name__}, {cname} has {ctyp}"


def test_abi_version_and_max_dims():
    d = _defines()
    header = (int(d["HALO_VERSION_MAJOR"]), int(d["HALO_VERSION_MINOR"]))
    assert (LIB.ABI_MAJOR, LIB.ABI_MINOR) == header, f"_lib.py ABI_MAJOR/MINOR differ from include/halo.h {header}"
    # The header states the ndim range only in prose, on the ndim member.
    m = re.search(r"\bndim;\s*/\*\*<\s*1 \.\. (\d+)\s*\*/", HEADER_TEXT)
    assert m, "include/halo.h: no '/**< 1 .. N */' on halo_plan_params_t.ndim"
    assert LIB.MAX_DIMS == int(m[1]), f"_lib.py MAX_DIMS is {LIB.MAX_DIMS}, include/halo.h says ndim is 1 .. {m[1]}"


def test_version_matches_header():
    """halocp.__version__ (which pyproject.toml reads) is the header's version."""
    d = _defines()
    want = "{}.{}.{}".format(d["HALO_VERSION_MAJOR"], d["HALO_VERSION_MINOR"], d["HALO_VERSION_PATCH"])
    assert d["HALO_VERSION_STRING"] == f'"{want}"', "include/halo.h: HALO_VERSION_STRING disagrees with its parts"
    # Read, not imported: the package imports torch.
    tree = ast.parse((REPO / "python" / "halocp" / "__init__.py").read_text())
    found = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__version__" for t in n.targets)]
    assert found == [want], f"halocp.__version__ is {found}, include/halo.h says {want}"


def test_pyproject_version_is_dynamic():
    """pyproject.toml types no version of its own."""
    tomllib = pytest.importorskip("tomllib")
    p = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())
    assert "version" not in p["project"] and "version" in p["project"].get("dynamic", [])
    assert p["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "halocp.__version__"}


def test_lib_calls_only_current_functions():
    """halocp exchanges through the pair only: _lib.py names no HALO_DEPRECATED
    function of the header (as an attribute or a string), and every
    halo_* function it names is declared there, so a misspelt C name
    fails here, not at run time."""
    decl = _declarations()
    tree = ast.parse((REPO / "python" / "halocp" / "_lib.py").read_text())
    named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    named |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    named = {n for n in named if re.fullmatch(r"halo_\w+", n) and not n.endswith("_t")}
    assert {"halo_exchange", "halo_exchange_start"} <= named, f"_lib.py does not name the pair: {sorted(named)}"
    deprecated = sorted(n for n in named if decl.get(n, (False,))[0])
    assert not deprecated, f"_lib.py names deprecated calls: {deprecated}"
    unknown = sorted(named - decl.keys())
    assert not unknown, f"_lib.py names functions include/halo.h does not declare: {unknown}"


def _declarations() -> dict[str, tuple[bool, str]]:
    """Every function of the header: whether it is HALO_DEPRECATED, and its parameter list."""
    found = {}
    for dep, name, args in re.findall(r"(HALO_DEPRECATED\s+)?\b[\w ]+?\*?\s*\b(halo_\w+)\s*\(([^;{]*?)\)\s*;", HEADER):
        found[name] = (bool(dep), " ".join(args.split()))
    return found


def test_call_pair_and_deprecated_calls():
    """halo_exchange and halo_exchange_start are the exchange calls: every
    other one (the 0.3 plan calls) is marked HALO_DEPRECATED, nothing else is."""
    decl = _declarations()
    pair = "halo_plan_t plan, halo_direction_t direction, void *const *buffers, size_t count, void *stream"
    assert decl.get("halo_exchange") == (False, pair), f"include/halo.h: halo_exchange is {decl.get('halo_exchange')}"
    assert decl.get("halo_exchange_start") == (False, pair + ", halo_request_t *request"), \
        f"include/halo.h: halo_exchange_start is {decl.get('halo_exchange_start')}"
    old = {n for n in decl if re.fullmatch(r"halo_plan_(?:halos_)?(?:forward|backward)(?:_multi)?(?:_start)?|halo_plan_(?:test|wait)", n)}
    assert len(old) == 18, f"include/halo.h: expected the 18 0.3 exchange calls, found {sorted(old)}"
    marked = {n for n, (dep, _) in decl.items() if dep}
    assert marked == old, f"HALO_DEPRECATED on {sorted(marked - old)}, missing on {sorted(old - marked)}"


def test_blocking_calls_wrap_halo_exchange():
    """capi/halo.c's 0.3 blocking single-layout calls are halo_exchange with
    their tensors as its buffers (the *_multi ones are, in Go: see exports.go)."""
    src = (REPO / "capi" / "halo.c").read_text()
    for name, direction, n in (("halo_plan_forward", "FORWARD", 2), ("halo_plan_backward", "BACKWARD", 2),
                               ("halo_plan_halos_forward", "FORWARD", 3), ("halo_plan_halos_backward", "BACKWARD", 3)):
        m = re.search(rf"halo_result_t {name}\([^)]*\)\s*\{{(.*?)\n\}}", src, flags=re.S)
        assert m, f"capi/halo.c: no definition of {name}"
        assert f"return halo_exchange(plan, HALO_DIR_{direction}, b, {n}, NULL);" in m[1], \
            f"capi/halo.c: {name} is not a halo_exchange call:{m[1]}"


def _exported(lib: Path) -> set[str]:
    """The functions that lib's dynamic symbol table defines (nm -D)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm (binutils) is not on PATH: cannot read libhalo.so's exports")
    run = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    assert run.returncode == 0, f"nm -D {lib}: {run.stderr.strip()}"
    # "address type name[@version]"; T/W/i: code.
    return {f[2].split("@")[0] for f in (line.split() for line in run.stdout.splitlines()) if len(f) == 3 and f[1] in "TWi"}


def test_library_exports_the_header():
    """libhalo.so (HALO_LIBRARY, which the ctest python_abi sets) exports
    every function include/halo.h declares, and nothing else (capi/exports.map):
    a helper of ours that leaks, or cgo's runtime hooks, would read as part
    of the ABI."""
    path = os.environ.get("HALO_LIBRARY")
    if not path:
        pytest.skip("HALO_LIBRARY is not set: the ctest python_abi checks the built libhalo.so")
    declared, exported = set(_declarations()), _exported(Path(path))
    assert len(declared) >= 38, f"include/halo.h: parsed only {sorted(declared)}"
    missing = sorted(declared - exported)
    extra = sorted(exported - declared)
    assert not missing, f"{path} does not export {missing}, which include/halo.h declares"
    assert not extra, f"{path} exports {extra}, which include/halo.h does not declare"
