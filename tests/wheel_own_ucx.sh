#!/usr/bin/env bash
# halocp on a machine with no system UCX (README, "Installing halocp"):
#
#   tests/wheel_own_ucx.sh REPO
#
# 1. the wheel (pip wheel ./python) is a manylinux wheel by auditwheel show,
#    and carries no UCX library (libhalo finds PyPI's at load time); when
#    patchelf is there, auditwheel repair makes the manylinux wheel without
#    vendoring UCX;
# 2. in a mount namespace where the system's UCX libraries and modules are
#    hidden (empty files and folders mounted over them), a plain venv that
#    sees only the project venv's packages installs halocp[cu12] offline, and
#    a 2-rank job runs under torchrun, with halocp loading the wheel's UCX.
# Exit 77 (skipped) when not root, without unshare, or without torch,
# libucx-cu12 and auditwheel in the project venv.
set -euo pipefail

repo=$(readlink -f "$1")
source "$repo/tests/lib.sh"
[ "$(id -u)" -eq 0 ] || skip "needs root (a mount namespace hides the system's UCX)"
command -v unshare >/dev/null || skip "needs unshare (util-linux)"
"$python" -c 'import torch, libucx, auditwheel' 2>/dev/null ||
	skip "needs torch, libucx-cu12 and auditwheel in $python (bash scripts/setup.sh)"
clean=(env -u HALO_LIBRARY -u LD_LIBRARY_PATH -u PYTHONPATH -u HALO_UCX -u UCX_MODULE_DIR)

# 1. The wheel.
run 300 "${clean[@]}" "$python" -m pip wheel --no-build-isolation --no-deps -w "$work/raw" "$repo/python" ||
	fail "pip wheel ./python failed"
whl=$(echo "$work"/raw/halocp-*.whl)
"$python" -m auditwheel show "$whl" >"$work/out" 2>"$work/err" || fail "auditwheel show failed"
grep -q 'platform tag to "manylinux_' "$work/out" || fail "auditwheel show: not a manylinux wheel"
listing=$("$python" -m zipfile -l "$whl")
if grep -q 'libuc[mpst]' <<<"$listing"; then
	fail "the wheel vendors UCX: $(grep 'libuc[mpst]' <<<"$listing")"
fi
echo "ok: $(grep -o 'manylinux_[0-9_a-z]*' "$work/out" | head -1) by auditwheel show, no UCX inside"
if command -v patchelf >/dev/null; then
	run 120 "$python" -m auditwheel repair --exclude 'libucp.so*' --exclude 'libucs.so*' --exclude 'libuct.so*' \
		--exclude 'libucm.so*' -w "$work/dist" "$whl" || fail "auditwheel repair failed"
	whl=$(echo "$work"/dist/halocp-*manylinux*.whl)
	[ -f "$whl" ] || fail "auditwheel repair made no manylinux wheel"
	echo "ok: repaired to ${whl##*/}"
else
	echo "note: no patchelf, auditwheel repair not tried"
fi

# 2. Hide the system's UCX, install, run.
"$python" -m venv --without-pip "$work/venv"
base=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
echo "$base" >"$site/project-venv.pth"
port=$(free_port_pair)
mkdir "$work/empty"
touch "$work/empty.so"
cat >"$work/inside.sh" <<INSIDE
set -e
for f in \$(ls -d /usr/lib/*-linux-gnu/libuc[mpst]*.so* /usr/lib/*-linux-gnu/libuct_*.so* 2>/dev/null); do
	mount --bind "$work/empty.so" "\$f"
done
for d in /usr/lib/*-linux-gnu/ucx; do
	[ -d "\$d" ] && mount --bind "$work/empty" "\$d"
done
if "$python" -c 'import ctypes; ctypes.CDLL("libucp.so.0")' 2>/dev/null; then
	echo "the system's libucp still loads"; exit 3
fi
"$python" -m pip --python "$work/venv/bin/python" install --no-index -q "halocp[cu12] @ file://$whl"
cd "$work"
"$work/venv/bin/python" -m torch.distributed.run --nproc-per-node 2 --master-port $port -r 1 -t 1 \
	--log-dir "$work/logs" "$repo/examples/python/halo_job.py"
INSIDE
run 240 "${clean[@]}" unshare -m --propagation private bash "$work/inside.sh" ||
	fail "the job with the system's UCX hidden failed"
for r in 0 1; do
	grep -q "rank $r of 2: ok.* from $site/halocp/libhalo.so" "$work/out" ||
		fail "rank $r did not report ok with the library from $site/halocp"
done
echo "ok: a 2-rank job from a plain venv with the system's UCX hidden, on PyPI's UCX"
