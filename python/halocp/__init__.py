"""halocp — PyTorch bindings of libhalo: a drop-in ``cp_halo_exchange``.

    from halocp import cp_halo_exchange
    y = cp_halo_exchange(x, left_size, right_size, dim, group)

The same signature and numbers as the torch.distributed reference, over
libhalo (UCX) instead of torch.distributed P2P: no packing of boundary
slabs, no zero halos and ``torch.cat`` per call, and errors instead of hangs.
Also: the halos alone (``halos``), exchanges started now and finished later
(``cp_halo_exchange_start``, ``halo_exchange_start_``, ``halos_start``),
``abort`` for a watchdog, halos of tensors tiled over a grid of ranks
(``TileGrid``, ``tile_halo_exchange``), and context-parallel and tiled
convolution layers (``halocp.nn``), the summing exchange of transposed
convolutions (``cp_halo_sum``), attention over a sharded sequence, causal
by position or by frame (``cp_attention``).
Python over ``libhalo.so`` through ctypes; the library is found through
``HALO_LIBRARY``, inside this package (where the wheel puts it), in a source
checkout's ``build/lib``, or on the dynamic loader's path.
"""

from ._comm import Communicator, clear_plans, communicator, destroy_communicator
from ._lib import (
    ERR_COMM_FAILED,
    ERR_INTERNAL,
    ERR_INVALID_ARGUMENT,
    ERR_INVALID_HANDLE,
    ERR_INVALID_STATE,
    ERR_MISMATCH,
    ERR_PEER_FAILED,
    ERR_RENDEZVOUS,
    ERR_TIMEOUT,
    ERR_TRANSPORT,
    HaloError,
    library_path,
    version,
)
from ._cuda import cuda_path
from ._inflight import Exchange, abort
from ._shapes import mark_sharded
from .exchange import cp_halo_exchange, cp_halo_exchange_start, halo_exchange_, halo_exchange_start_, halos, halos_start
from .halo_sum import cp_halo_sum
from .attention import cp_attention
from .tiles import TileGrid, tile_halo_exchange
from . import nn
from . import diffusers  # imports no diffusers: the VAEs' converters look blocks up by name

# include/halo.h's version (the source); pyproject.toml reads this line and
# tests/python/test_abi.py checks it against the header.
__version__ = "0.4.0"

__all__ = [
    "cp_halo_exchange",
    "halo_exchange_",
    "halos",
    "cp_halo_exchange_start",
    "halo_exchange_start_",
    "halos_start",
    "cp_halo_sum",
    "cp_attention",
    "TileGrid",
    "tile_halo_exchange",
    "mark_sharded",
    "Exchange",
    "abort",
    "HaloError",
    "Communicator",
    "communicator",
    "clear_plans",
    "destroy_communicator",
    "version",
    "library_path",
    "cuda_path",
    "nn",
    "diffusers",
]
