#!/bin/bash
# Run tests/gpu/check.py with the bundle that tests/gpu/bundle.sh made:
#
#   tests/gpu/run.sh [--system-ucx] [check.py options]    e.g. --json figures.json
#
# The bundle's UCX (Debian's, no CUDA support: halocp stages CUDA tensors
# through pinned host buffers) is used unless --system-ucx is given: then
# the UCX already on the loader's path (HPC-X, or UCX built --with-cuda:
# halocp sends device pointers directly) is. GPU_BUNDLE names another bundle.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bundle=${GPU_BUNDLE:-$here/bundle}
[ -f "$bundle/lib/libhalo.so" ] || { echo "run.sh: no bundle at $bundle: run tests/gpu/bundle.sh where halo builds" >&2; exit 2; }
export HALO_LIBRARY=$bundle/lib/libhalo.so
export PYTHONPATH=$bundle/python${PYTHONPATH:+:$PYTHONPATH}
if [ "${1:-}" = --system-ucx ]; then
  shift
  export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$bundle/lib
else
  export LD_LIBRARY_PATH=$bundle/lib:$bundle/lib/ucx${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export UCX_MODULE_DIR=$bundle/lib/ucx/modules
fi
# libhalo is loaded after torch's CUDA libraries: leave it static TLS to spare.
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.rtld.optional_static_tls=16384}
cat "$bundle/MANIFEST"
exec "${PYTHON:-python3}" "$here/check.py" "$@"
