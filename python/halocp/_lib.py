"""ctypes binding of libhalo's C ABI (include/halo.h, version 0.4).

The package's one C boundary: only this module knows the C names, the
structs, their field_mask bits and the signatures (tests/python/test_imports.py
keeps it so). The rest of the package calls the communicator functions, the
params builder and the Plan class below.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

# The ABI this module was written against: include/halo.h 0.4. These values
# and the structs below are copies of the header; tests/python/test_abi.py
# checks them against it.
ABI_MAJOR, ABI_MINOR = 0, 4

# halo_result_t
SUCCESS = 0
ERR_INVALID_ARGUMENT = 1
ERR_INVALID_HANDLE = 2
ERR_MISMATCH = 3
ERR_TIMEOUT = 4
ERR_PEER_FAILED = 5
ERR_COMM_FAILED = 6
ERR_RENDEZVOUS = 7
ERR_TRANSPORT = 8
ERR_INVALID_STATE = 9
ERR_INTERNAL = 10

# halo_dtype_t
FLOAT32, FLOAT64, FLOAT16, BFLOAT16 = 0, 1, 2, 3

# halo_padding_t
PAD_ZEROS = 0
PAD_REPLICATE = 1
PAD_REFLECT = 2
PAD_CIRCULAR = 3

# halo_memory_type_t
MEMORY_HOST, MEMORY_CUDA = 0, 1

# halo_bootstrap_t
BOOTSTRAP_RENDEZVOUS, BOOTSTRAP_EXTERNAL = 0, 1

# halo_comm_params_t.field_mask
COMM_PARAM_BOOTSTRAP = 1 << 0
COMM_PARAM_RENDEZVOUS = 1 << 1
COMM_PARAM_TOKEN = 1 << 2
COMM_PARAM_JOB_ID = 1 << 3
COMM_PARAM_TIMEOUT = 1 << 4
COMM_PARAM_BOOTSTRAP_TIMEOUT = 1 << 5

# halo_plan_params_t.field_mask
PLAN_PARAM_X_STRIDES = 1 << 0
PLAN_PARAM_OUT_STRIDES = 1 << 1
PLAN_PARAM_GRAD_OUT_STRIDES = 1 << 2
PLAN_PARAM_GRAD_X_STRIDES = 1 << 3
PLAN_PARAM_PADDING = 1 << 4
PLAN_PARAM_HALOS_ONLY = 1 << 5
PLAN_PARAM_LEFT_STRIDES = 1 << 6
PLAN_PARAM_RIGHT_STRIDES = 1 << 7
PLAN_PARAM_GRAD_LEFT_STRIDES = 1 << 8
PLAN_PARAM_GRAD_RIGHT_STRIDES = 1 << 9
PLAN_PARAM_MEMORY_TYPE = 1 << 10
PLAN_PARAM_DEFERRED = 1 << 11

# halo_direction_t: what a plan call does (Plan.run's first argument); a
# halos-only plan's forward sends x's slabs and fills the halos, its backward
# sends the halo gradients and adds the neighbours' into grad_x.
DIR_FORWARD, DIR_BACKWARD = 0, 1

# A CUDA stream's handle as halo_exchange_start takes it: CUDA's default
# stream, whose handle is 0, is CU_STREAM_LEGACY (a NULL stream means none).
CU_STREAM_LEGACY = 0x1


def stream_handle(cuda_stream: int) -> int:
    """halo_exchange_start's stream argument for a CUstream (torch's
    ``Stream.cuda_stream``)."""
    return cuda_stream or CU_STREAM_LEGACY


MAX_DIMS = 8

_Int64Array = ctypes.POINTER(ctypes.c_int64)


class HaloError(RuntimeError):
    """A failure reported by libhalo (or refused before reaching it).

    ``code`` is the library's result code (``halocp.ERR_*``), ``str(err)`` the
    detailed message: which rank, which peer, which shape.
    """

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


HaloError.__module__ = "halocp"  # where users import it from


class CommParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("bootstrap", ctypes.c_int),
        ("rendezvous", ctypes.c_char_p),
        ("token", ctypes.c_char_p),
        ("job_id", ctypes.c_char_p),
        ("timeout_ms", ctypes.c_int64),
        ("bootstrap_timeout_ms", ctypes.c_int64),
    ]


class PlanParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int32),
        ("shape", _Int64Array),
        ("dim", ctypes.c_int32),
        ("left", ctypes.c_int64),
        ("right", ctypes.c_int64),
        ("x_strides", _Int64Array),
        ("out_strides", _Int64Array),
        ("grad_out_strides", _Int64Array),
        ("grad_x_strides", _Int64Array),
        ("padding", ctypes.c_int),
        ("halos_only", ctypes.c_int32),
        ("left_strides", _Int64Array),
        ("right_strides", _Int64Array),
        ("grad_left_strides", _Int64Array),
        ("grad_right_strides", _Int64Array),
        ("memory_type", ctypes.c_int),
    ]


def _source_tree(package_dir: Path) -> Path | None:
    """The repository's root when this package is python/halocp of a checkout."""
    root = package_dir.parent.parent
    if (root / "CMakeLists.txt").is_file() and (root / "include" / "halo.h").is_file():
        return root
    return None


def _candidates() -> list[tuple[str, Path | str]]:
    """Where to look for libhalo, in order, with a word on each place. Only
    places that apply to this installation are listed."""
    env = os.environ.get("HALO_LIBRARY")
    if env:
        # An explicit choice is the only candidate: falling back to another
        # copy would hide a typo behind a version skew.
        p = Path(env)
        return [("HALO_LIBRARY", p / "libhalo.so" if p.is_dir() else p)]
    here = Path(__file__).resolve().parent
    root = _source_tree(here)
    found = []
    # An installed wheel carries the library here (a checkout does not).
    if root is None or (here / "libhalo.so").exists():
        found.append(("inside the package", here / "libhalo.so"))
    # A source checkout: python/halocp/ -> <repo>/build/lib/.
    if root is not None:
        found.append(("in the checkout's build folder", root / "build" / "lib" / "libhalo.so"))
    # An installed prefix on the dynamic loader's path (cmake --install).
    found.append(("on the loader's search path", "libhalo.so.%d" % ABI_MAJOR))
    return found


def _static_tls_hint(err: str) -> str:
    if "static TLS" not in err:
        return ""
    return (
        "\n  (the library needs more static TLS than the loader keeps spare for dlopen: start the"
        " process with GLIBC_TUNABLES=glibc.rtld.optional_static_tls=16384, or preload libhalo)"
    )


def _load_ucx() -> str:
    """Loads the UCX that libhalo will use, before libhalo: HALO_UCX=wheel
    is PyPI's UCX wheel (libucx, which halocp depends on), system the
    loader's (a system or HPC-X UCX), auto (the default) the wheel if it is
    installed, else the system's. The wheel's libraries are loaded by path;
    libhalo's dependency on libucp.so.0 then resolves to them, as the loader
    matches a loaded library by its soname."""
    choice = os.environ.get("HALO_UCX", "auto")
    if choice not in ("auto", "wheel", "system"):
        raise HaloError(ERR_INVALID_ARGUMENT, f"halocp: HALO_UCX={choice!r}: expected auto, wheel or system")
    if choice == "system":
        return choice
    try:
        import libucx
    except ImportError:
        if choice == "wheel":
            raise HaloError(
                ERR_INVALID_STATE,
                "halocp: HALO_UCX=wheel, but PyPI's UCX wheel is not installed (pip install libucx-cu12, or libucx-cu13)",
            ) from None
        return "system"
    libucx.load_library()
    return "wheel"


def _load() -> ctypes.CDLL:
    _load_ucx()
    tried = []
    for where, path in _candidates():
        if isinstance(path, Path) and not path.exists():
            tried.append(f"{where}: {path} (no such file)")
            continue
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            tried.append(f"{where}: {path} ({e}){_static_tls_hint(str(e))}")
    if _source_tree(Path(__file__).resolve().parent) is not None:
        how = "build it in this checkout (cmake -S . -B build && cmake --build build)"
    else:
        how = "install halocp from a wheel built from the repository (pip wheel ./python: the wheel carries it)"
    raise HaloError(
        ERR_INVALID_STATE,
        f"halocp: cannot load libhalo.so: {how}, or set HALO_LIBRARY to the library's path. Looked:\n  "
        + "\n  ".join(tried),
    )


def _declare(lib: ctypes.CDLL) -> None:
    c_int, vp, sz = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    sigs = {
        "halo_version_number": ([], c_int),
        "halo_version_string": ([], ctypes.c_char_p),
        "halo_strerror": ([c_int], ctypes.c_char_p),
        "halo_last_error": ([], ctypes.c_char_p),
        "halo_comm_create": ([c_int, c_int, ctypes.POINTER(CommParams), ctypes.POINTER(vp)], c_int),
        "halo_comm_get_address": ([vp, ctypes.POINTER(vp), ctypes.POINTER(sz)], c_int),
        "halo_comm_connect": ([vp, ctypes.POINTER(vp), ctypes.POINTER(sz)], c_int),
        "halo_comm_destroy": ([vp], c_int),
        "halo_plan_create": ([vp, ctypes.POINTER(PlanParams), ctypes.POINTER(vp)], c_int),
        "halo_comm_abort": ([vp], c_int),
        # Not halocp's: the GPU check's stream test (tests/gpu) calls it through lib().
        "halo_plan_create_multi": ([vp, c_int, ctypes.POINTER(PlanParams), ctypes.POINTER(vp)], c_int),
        "halo_plan_destroy": ([vp], c_int),
        "halo_comm_memory_types": ([vp, ctypes.POINTER(ctypes.c_uint64)], c_int),
        "halo_exchange_start": ([vp, c_int, ctypes.POINTER(vp), sz, vp, ctypes.POINTER(vp)], c_int),
        # Plan.run's halo_exchange is _exchange below, declared apart.
        "halo_request_test": ([vp, ctypes.POINTER(c_int)], c_int),
        "halo_request_wait": ([vp, vp], c_int),
        "halo_request_free": ([vp], c_int),
        "halo_setting_get": ([ctypes.c_char_p, ctypes.c_char_p, sz, ctypes.POINTER(ctypes.c_int64)], c_int),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def lib() -> ctypes.CDLL:
    """The loaded library, loaded and checked on first use."""
    global _lib, _halo_exchange
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                handle = _load()
                _declare(handle)
                _halo_exchange = _exchange_of(handle)
                v = handle.halo_version_number()
                major, minor = v // 10000, v // 100 % 100
                # Before 1.0 every minor version may change the ABI.
                if major != ABI_MAJOR or (minor != ABI_MINOR if major == 0 else minor < ABI_MINOR):
                    raise HaloError(
                        ERR_INVALID_STATE,
                        f"halocp: {handle._name} is libhalo {handle.halo_version_string().decode()}, "
                        f"but halocp speaks ABI {ABI_MAJOR}.{ABI_MINOR}",
                    )
                _lib = handle
    return _lib


def version() -> str:
    """The loaded library's version string, e.g. "0.3.0"."""
    return lib().halo_version_string().decode()


def library_path() -> str:
    """The file halocp loaded libhalo from."""
    return lib()._name


def error(rc: int, what: str) -> HaloError:
    """The HaloError for a failed call, with the library's detailed message.

    Must run on the thread that made the call: the message is per thread.
    """
    L = lib()
    detail = (L.halo_last_error() or b"").decode(errors="replace")
    reason = (L.halo_strerror(rc) or b"").decode()
    if detail.startswith(reason):  # e.g. "ranks disagree on plan 3 ...": say it once
        return HaloError(rc, f"{what}: {detail}")
    return HaloError(rc, f"{what}: {reason}: {detail}" if detail else f"{what}: {reason}")


def setting(name: str) -> tuple[str, int]:
    """A HALO_* setting as libhalo reads it now (the environment, else its
    default): its text and its number (milliseconds for a duration). A value
    the library refuses raises HaloError(ERR_INVALID_ARGUMENT) naming it."""
    buf, number = ctypes.create_string_buffer(4096), ctypes.c_int64()
    check(lib().halo_setting_get(name.encode(), buf, len(buf), ctypes.byref(number)), "halo_setting_get")
    return buf.value.decode(), number.value


# ------------------------------------------------------------ communicators
# halocp's Communicator (in _comm.py) holds the handle these take and return.


def comm_create(rank: int, world_size: int, timeout_ms: int | None = None) -> int:
    """halo_comm_create with an external bootstrap (the caller connects the
    ranks, comm_address and comm_connect); timeout_ms bounds every wait of
    its exchanges (unset: HALO_TIMEOUT_MS, else the library's default)."""
    params = CommParams()
    params.field_mask = COMM_PARAM_BOOTSTRAP
    params.bootstrap = BOOTSTRAP_EXTERNAL
    if timeout_ms is not None:
        params.field_mask |= COMM_PARAM_TIMEOUT
        params.timeout_ms = timeout_ms
    handle = ctypes.c_void_p()
    check(lib().halo_comm_create(rank, world_size, ctypes.byref(params), ctypes.byref(handle)), "halo_comm_create")
    return handle.value


def comm_address(handle) -> bytes:
    """This rank's worker address, to hand to every other rank."""
    ptr, length = ctypes.c_void_p(), ctypes.c_size_t()
    check(lib().halo_comm_get_address(handle, ctypes.byref(ptr), ctypes.byref(length)), "halo_comm_get_address")
    return ctypes.string_at(ptr, length.value)


def comm_connect(handle, addresses: list) -> None:
    """Connect to every rank, given every rank's address in rank order."""
    n = len(addresses)
    bufs = [ctypes.create_string_buffer(a, len(a)) for a in addresses]
    ptrs = (ctypes.c_void_p * n)(*[ctypes.cast(b, ctypes.c_void_p) for b in bufs])
    lens = (ctypes.c_size_t * n)(*[len(a) for a in addresses])
    check(lib().halo_comm_connect(handle, ptrs, lens), "halo_comm_connect")


def comm_memory_types(handle) -> int:
    """The memory types the communicator's UCX moves: a bit per MEMORY_*."""
    types = ctypes.c_uint64(0)
    check(lib().halo_comm_memory_types(handle, ctypes.byref(types)), "halo_comm_memory_types")
    return types.value


def comm_abort(handle) -> None:
    """halo_comm_abort: callable from any thread, without the comm's lock."""
    check(lib().halo_comm_abort(handle), "halo_comm_abort")


def comm_destroy(handle) -> None:
    lib().halo_comm_destroy(handle)  # local; its failure has nothing to tell


# ------------------------------------------------------------------- plans


def _exchange_of(handle: ctypes.CDLL):
    """halo_exchange as Plan.run calls it: its own function object (the
    library's getattr one has argtypes), with no argtypes, so that ctypes
    converts nothing per call: every argument is a ctypes object a plan
    made once (handle, direction, the address of its pointer array, count;
    None is the NULL stream). That keeps the pair's call as cheap as the
    0.3 per-form calls, whose arguments were the pointers themselves."""
    fn = handle["halo_exchange"]
    fn.restype = ctypes.c_int
    return fn


# halo_exchange without argtypes, resolved once (by lib()).
_halo_exchange = None


class Plan:
    """One libhalo plan and every call on it: made from a PlanParams on a
    communicator, then run (blocking), or started as a request that is
    tested, waited for and freed; destroyed when dropped. Every exchange is
    the pair's (halo_exchange, halo_exchange_start) in a direction
    (DIR_FORWARD, DIR_BACKWARD) on the buffers' addresses, in the header's
    order: x, out (a padded plan's forward); grad_out, grad_x (its
    backward); x, left, right and grad_left, grad_right, grad_x (a
    halos-only plan's).

    ``comm`` is halocp's Communicator: its ``handle``, its ``lock`` (one
    thread in the library per communicator) and ``closed`` (its plans went
    with it) are what this reads. (A call on the host made while
    stream-ordered exchanges are queued waits for them in the library.)
    """

    __slots__ = ("comm", "handle", "count", "_buffers", "_args")

    def __init__(self, comm, params: PlanParams):
        self.comm, self.handle = comm, None
        handle = ctypes.c_void_p()
        check(lib().halo_plan_create(comm.handle, ctypes.byref(params), ctypes.byref(handle)), "halo_plan_create")
        self.handle = handle.value
        # The buffers' count of either direction: 3 for a halos-only plan.
        self.count = n = 3 if params.field_mask & PLAN_PARAM_HALOS_ONLY and params.halos_only else 2
        # The pointer array every call fills (under comm.lock; the library
        # reads it during the call only: a start copies it). A call with
        # another number of pointers is halocp's bug: the fill raises.
        self._buffers = (ctypes.c_void_p * n)()
        address = ctypes.c_void_p(ctypes.addressof(self._buffers))
        self._args = tuple((ctypes.c_void_p(self.handle), ctypes.c_int(d), address, ctypes.c_size_t(n), None)
                           for d in (DIR_FORWARD, DIR_BACKWARD))

    def exchange(self, direction: int, *pointers: int) -> None:
        """halo_exchange in direction on the host, on the buffers'
        addresses (count of them): one C call per exchange."""
        with self.comm.lock:
            self._buffers[:] = pointers
            rc = _halo_exchange(*self._args[direction])
            if rc:
                raise error(rc, "halo_exchange")

    def exchange_start(self, direction: int, pointers, stream: int | None = None) -> int:
        """halo_exchange_start in direction on the buffers' addresses (exchange's),
        on the host (stream None) or ordered on a stream (a stream_handle);
        the request, for test, wait and free."""
        request = ctypes.c_void_p()
        with self.comm.lock:
            self._buffers[:] = pointers
            check(lib().halo_exchange_start(self.handle, direction, self._buffers, self.count, stream,
                                            ctypes.byref(request)), "halo_exchange_start")
        return request.value

    def test(self, request: int) -> bool:
        """Progress a started exchange; True once it has finished."""
        done = ctypes.c_int(0)
        with self.comm.lock:
            check(lib().halo_request_test(request, ctypes.byref(done)), "halo_request_test")
        return done.value == 1

    def wait(self, request: int, stream: int | None = None) -> None:
        """Finish a started exchange: on the host (stream None; within the
        communicator's timeout), or make a stream (a stream_handle) wait
        for it, returning at once (its error is then the request's test's
        or host wait's)."""
        with self.comm.lock:
            check(lib().halo_request_wait(request, stream), "halo_request_wait")

    def free(self, request: int) -> None:
        """Release a request; one whose exchange has not ended is released
        when it ends (halo_request_free), and its failure, if the caller
        was not told of it, is the next exchange's error."""
        with self.comm.lock:
            lib().halo_request_free(request)

    def __del__(self):
        # Local and never hangs. A plan evicted from a cache lives on while
        # an autograd graph still holds it for its backward; the
        # communicator's destruction took its plans with it.
        handle, self.handle = self.handle, None
        if handle and not self.comm.closed:
            try:
                with self.comm.lock:
                    lib().halo_plan_destroy(handle)
            except Exception:  # interpreter shutdown
                pass


def check(rc: int, what: str) -> None:
    if rc != SUCCESS:
        raise error(rc, what)


def int64_array(values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)


# torch.nn.Conv3d's padding_mode spellings, and halo_padding_t.
PADDINGS = {"zeros": PAD_ZEROS, "replicate": PAD_REPLICATE, "reflect": PAD_REFLECT, "circular": PAD_CIRCULAR}


def padding_code(mode) -> int:
    """halo_padding_t of a padding_mode argument; ValueError naming the choices."""
    try:
        return PADDINGS[mode]
    except (KeyError, TypeError):
        raise ValueError(f"halocp: padding_mode {mode!r} is not one of {', '.join(map(repr, PADDINGS))}") from None


# Optional stride fields of halo_plan_params_t, by keyword of plan_params.
_STRIDE_FIELDS = {
    "out_strides": PLAN_PARAM_OUT_STRIDES,
    "grad_out_strides": PLAN_PARAM_GRAD_OUT_STRIDES,
    "grad_x_strides": PLAN_PARAM_GRAD_X_STRIDES,
    "left_strides": PLAN_PARAM_LEFT_STRIDES,
    "right_strides": PLAN_PARAM_RIGHT_STRIDES,
    "grad_left_strides": PLAN_PARAM_GRAD_LEFT_STRIDES,
    "grad_right_strides": PLAN_PARAM_GRAD_RIGHT_STRIDES,
}


# torch's dtypes by name (this module does not import torch), and those
# seen, by the dtype itself: a dict lookup per call.
_DTYPE_NAMES = {"torch.float32": FLOAT32, "torch.float64": FLOAT64, "torch.float16": FLOAT16,
                "torch.bfloat16": BFLOAT16}
_dtypes_seen: dict = {}


def halo_dtype(dtype) -> int:
    """The halo_dtype_t of a torch dtype; HaloError for one halo does not move."""
    code = _dtypes_seen.get(dtype)
    if code is None:
        code = _DTYPE_NAMES.get(str(dtype))
        if code is None:
            raise HaloError(ERR_INVALID_ARGUMENT,
                            f"halocp: dtype {dtype} is not supported (float32, float64, float16 or bfloat16)")
        _dtypes_seen[dtype] = code
    return code


def plan_params(dtype: int, shape, dim, left, right, x_strides, padding_mode="zeros", halos_only=False,
                memory_type=None, **strides) -> PlanParams:
    """The one builder of halo_plan_params_t: dtype a halo_dtype_t, strides
    in elements; each optional stride field (out_strides, grad_x_strides,
    left_strides, ...) is set, with its field_mask bit, when given.

    halocp's plans are deferred: made locally on a cache miss, agreed on by
    the ranks in their first exchange (and again whenever the ranks come to
    an exchange with different layouts), so a rank may miss its cache while
    another hits."""
    if not 1 <= len(shape) <= MAX_DIMS:
        raise HaloError(ERR_INVALID_ARGUMENT, f"halocp: tensors of 1 to {MAX_DIMS} dims, not {len(shape)}")
    p = PlanParams()
    p.dtype, p.ndim, p.dim, p.left, p.right = dtype, len(shape), dim, left, right
    p.padding = padding_code(padding_mode)
    p.field_mask = PLAN_PARAM_X_STRIDES | PLAN_PARAM_PADDING | PLAN_PARAM_DEFERRED
    # The arrays must outlive the call only: keep them on the struct object.
    p._keep = [int64_array(shape), int64_array(x_strides)]
    p.shape, p.x_strides = p._keep
    for name, value in strides.items():
        if value is not None:
            p._keep.append(int64_array(value))
            setattr(p, name, p._keep[-1])
            p.field_mask |= _STRIDE_FIELDS[name]
    if halos_only:
        p.halos_only = 1
        p.field_mask |= PLAN_PARAM_HALOS_ONLY
    if memory_type is not None:
        p.memory_type = memory_type
        p.field_mask |= PLAN_PARAM_MEMORY_TYPE
    return p
