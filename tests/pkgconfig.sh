#!/usr/bin/env bash
# A C program built without CMake, through pkg-config, against an installed
# prefix (docs/cpp.md), then run:
#
#   tests/pkgconfig.sh STAGE REPO
#
# STAGE is what `cmake --install build --prefix STAGE` made. The tree is
# copied elsewhere first: halo.pc must describe wherever it lies, so that
# --prefix, DESTDIR and relocated installs all work. The program is
# tests/c/test_exchange.c, on 2 ranks, linked with the installed library
# (the rpath points into the copy; nothing else is on the loader's path).
set -euo pipefail

stage=$(readlink -f "$1")
repo=$(readlink -f "$2")
source "$repo/tests/lib.sh"
command -v pkg-config >/dev/null || skip "pkg-config is not installed"
cc=${CC:-cc}

cp -a "$stage" "$work/prefix"
pc=$(find "$work/prefix" -name halo.pc -path '*/pkgconfig/*')
[ -n "$pc" ] || fail "no halo.pc under $stage"
export PKG_CONFIG_PATH=${pc%/halo.pc}
unset PKG_CONFIG_LIBDIR LD_LIBRARY_PATH

prefix=$(pkg-config --variable=prefix halo)
[ "$(cd "$prefix" && pwd -P)" = "$(cd "$work/prefix" && pwd -P)" ] ||
	fail "halo.pc's prefix is $prefix, not where it lies ($work/prefix)"
flags=$(pkg-config --cflags --libs halo)
libdir=$(pkg-config --variable=libdir halo)
[ -f "$libdir/libhalo.so" ] && [ -f "$(pkg-config --variable=includedir halo)/halo.h" ] ||
	fail "pkg-config's libdir/includedir do not hold libhalo.so and halo.h: $flags"
echo "ok: pkg-config --cflags --libs halo: $flags"

# shellcheck disable=SC2086 # the flags are words
"$cc" -std=gnu99 -o "$work/test_exchange" "$repo/tests/c/test_exchange.c" $flags -lm -Wl,-rpath,"$libdir" ||
	fail "compiling tests/c/test_exchange.c with pkg-config's flags"
loaded=$(ldd "$work/test_exchange" | awk '$1 == "libhalo.so.0" { print $3 }')
[ "$(readlink -f "$loaded")" = "$(readlink -f "$libdir/libhalo.so.0")" ] ||
	fail "the program loads libhalo from $loaded, not from the installed prefix"
run 60 "$work/test_exchange" 2 || fail "the program failed"
cat "$work/out"
echo "ok: built through pkg-config, linked and run against the installed prefix"
