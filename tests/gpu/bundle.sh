#!/bin/bash
# Collect what tests/gpu/run.sh needs on a machine that has a GPU and
# PyTorch with CUDA but reaches no package registry and may have no UCX:
# libhalo.so, halod, halocp, UCX's shared libraries as installed here
# (Debian's libucx0, no CUDA: the staged path), with their modules and
# libnuma, and UCX 1.22 with CUDA transports from the libucx-cu13 wheel (the
# direct path).
#
#   tests/gpu/bundle.sh [--no-ucx-wheel] [BUILD_DIR [BUNDLE_DIR]]   (build, tests/gpu/bundle)
#
# The wheel is fetched with pip download (UCX_WHEEL=FILE uses one already
# here); --no-ucx-wheel leaves it out (the CPU dry run needs none).
# Layout: lib/ (libhalo.so, libnuma), lib/ucx/ (libucp, libucs, libuct,
# libucm), lib/ucx/modules/ (UCX's loadable transports), bin/halod,
# ucx-cu13/ (the wheel's libucx/lib, libucx/bin/ucx_info and the libraries
# auditwheel put beside them, at their paths in the wheel so that their
# RPATHs hold), python/halocp, MANIFEST.
set -euo pipefail
wheel=1
if [ "${1:-}" = --no-ucx-wheel ]; then wheel=0; shift; fi
repo=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$repo/build}
out=${2:-$repo/tests/gpu/bundle}
python=${PYTHON:-python3}
lib=$build/lib/libhalo.so
[ -f "$lib" ] || { echo "bundle.sh: no $lib: build halo first (cmake -S . -B build && cmake --build build)" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/lib/ucx/modules" "$out/python"
cp -L "$lib" "$out/lib/libhalo.so"

# The UCX libraries libhalo loads, by the names it asks for.
resolve() { ldd "$1" | awk -v n="$2" '$1 == n { print $3 }'; }
for so in libucp.so.0 libucs.so.0 libuct.so.0 libucm.so.0; do
  path=$(resolve "$lib" "$so")
  [ -n "$path" ] || { echo "bundle.sh: libhalo.so does not resolve $so here" >&2; exit 1; }
  cp -L "$path" "$out/lib/ucx/$so"
done
numa=$(resolve "$(resolve "$lib" libucs.so.0)" libnuma.so.1)
[ -z "$numa" ] || cp -L "$numa" "$out/lib/libnuma.so.1"
# UCX's loadable transports: only those whose dependencies are in the
# bundle or in any glibc (cma, single-copy shared memory); the InfiniBand
# ones need rdma-core, which the GPU machine may lack.
moddir=$(dirname "$(resolve "$lib" libucs.so.0)")/ucx
for m in "$moddir"/libuct_cma.so.0; do
  [ -f "$m" ] && cp -L "$m" "$out/lib/ucx/modules/"
done

if [ -x "$build/bin/halod" ]; then
  mkdir -p "$out/bin"
  strip -o "$out/bin/halod" "$build/bin/halod" 2>/dev/null || cp "$build/bin/halod" "$out/bin/halod"
fi

# UCX with cuda_copy and cuda_ipc, for Python 3.12 on manylinux_2_28 (the
# GPU machine's); only what halo loads is kept (no perftest, no headers).
ucx_wheel=none
if [ "$wheel" = 1 ]; then
  whl=${UCX_WHEEL:-}
  if [ -z "$whl" ]; then
    dl=$(mktemp -d)
    trap 'rm -rf "$dl"' EXIT
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 -d "$dl" "libucx-cu13==1.22.*" ||
      { echo "bundle.sh: cannot download the libucx-cu13 wheel (give one with UCX_WHEEL=FILE, or --no-ucx-wheel)" >&2; exit 1; }
    whl=$(ls "$dl"/libucx_cu13-*.whl)
  fi
  "$python" - "$whl" "$out/ucx-cu13" <<'PY'
import sys, zipfile, os
whl, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        # The wheel holds each library three times (.so, .so.0, .so.0.0.0):
        # the loader and UCX's module loader open the .so.0.
        keep = (n.startswith("libucx/lib/") and n.endswith(".so.0") and "perftest" not in n) \
            or n.startswith("libucx_cu13.libs/") or n == "libucx/bin/ucx_info"
        if keep and not n.endswith("/"):
            z.extract(n, dest)
            info = z.getinfo(n)
            os.chmod(os.path.join(dest, n), (info.external_attr >> 16) & 0o777 or 0o644)
PY
  ucx_wheel="$(basename "$whl") sha256 $(sha256sum "$whl" | cut -c1-16)"
fi

(cd "$repo/python" && tar --exclude=__pycache__ -cf - halocp) | tar -xf - -C "$out/python"
rm -f "$out/python/halocp/libhalo.so"


{
  echo "halo $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "libhalo $(grep -m1 -oE '"[0-9]+\.[0-9]+\.[0-9]+"' "$repo/include/halo.h" | tr -d '"')"
  echo "ucx (this machine's: $(dpkg-query -W -f '${Package} ${Version}' libucx0 2>/dev/null || echo 'not from a package'))"
  echo "ucx-cu13 $ucx_wheel"
  echo "needs glibc >= $(for f in "$out"/lib/*.so* "$out"/lib/ucx/*.so* "$out"/lib/ucx/modules/*.so* $(find "$out/ucx-cu13" -name '*.so*' 2>/dev/null); do objdump -T "$f"; done \
       | grep -oE 'GLIBC_[0-9.]+' | sort -Vu | tail -1 | cut -d_ -f2)"
} > "$out/MANIFEST"
size=$(du -sm "$out" | cut -f1)
echo "bundle.sh: $out ($size MiB)"
cat "$out/MANIFEST"
[ "$size" -le 64 ] || { echo "bundle.sh: the bundle is over 64 MiB" >&2; exit 1; }
