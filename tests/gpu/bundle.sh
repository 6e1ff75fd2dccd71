#!/bin/bash
# Collect what tests/gpu/check.py needs on a machine that has a GPU and
# PyTorch with CUDA but reaches no package registry and may have no UCX:
# libhalo.so, halocp, and UCX's shared libraries as installed here (Debian's
# libucx0), with their modules and libnuma.
#
#   tests/gpu/bundle.sh [BUILD_DIR [BUNDLE_DIR]]   (build, tests/gpu/bundle)
#
# Layout: lib/ (libhalo.so, libnuma), lib/ucx/ (libucp, libucs, libuct,
# libucm), lib/ucx/modules/ (UCX's loadable transports), python/halocp,
# MANIFEST. tests/gpu/run.sh runs the check with it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$repo/build}
out=${2:-$repo/tests/gpu/bundle}
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

(cd "$repo/python" && tar --exclude=__pycache__ -cf - halocp) | tar -xf - -C "$out/python"
rm -f "$out/python/halocp/libhalo.so"


{
  echo "halo $(git -C "$repo" describe --always --dirty 2>/dev/null || echo unknown)"
  echo "libhalo $(grep -m1 -oE '"[0-9]+\.[0-9]+\.[0-9]+"' "$repo/include/halo.h" | tr -d '"')"
  echo "ucx (this machine's: $(dpkg-query -W -f '${Package} ${Version}' libucx0 2>/dev/null || echo 'not from a package'))"
  echo "needs glibc >= $(for f in "$out"/lib/*.so* "$out"/lib/ucx/*.so* "$out"/lib/ucx/modules/*.so*; do objdump -T "$f"; done \
       | grep -oE 'GLIBC_[0-9.]+' | sort -Vu | tail -1 | cut -d_ -f2)"
} > "$out/MANIFEST"
size=$(du -sm "$out" | cut -f1)
echo "bundle.sh: $out ($size MiB)"
cat "$out/MANIFEST"
[ "$size" -le 64 ] || { echo "bundle.sh: the bundle is over 64 MiB" >&2; exit 1; }
