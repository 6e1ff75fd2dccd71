#!/usr/bin/env bash
# halocp as a user installs it (docs/python.md, "Installing"):
#
#   tests/wheel.sh REPO
#
# 1. pip wheel builds halocp's wheel from the repository: libhalo.so is
#    compiled (CMake and Go) and inside, and the wheel is tagged for the
#    platform, not py3-none-any;
# 2. a plain venv that sees the project venv's packages (PyTorch 2, PyPI's
#    UCX) through a .pth file, as a venv with system site packages sees the
#    system's, installs it offline, and a 2-rank job runs under torchrun with no HALO_LIBRARY,
#    LD_LIBRARY_PATH or PYTHONPATH, from outside the repository, using
#    the copy inside the package;
# 3. with that copy gone, the error lists only places that exist for an
#    installed package (no source-tree build folder).
# Offline: --no-build-isolation (the project venv's setuptools and wheel) and
# --no-index. Exit 77 (skipped) without venv, pip, setuptools, wheel or torch.
set -euo pipefail

repo=$(readlink -f "$1")
source "$repo/tests/lib.sh"
"$python" -c 'import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ["venv", "ensurepip", "pip", "setuptools", "wheel"])))' ||
	skip "needs $python with venv, pip, setuptools and wheel (bash scripts/setup.sh makes .venv)"
"$python" -c 'import torch' 2>/dev/null || skip "needs torch for $python (bash scripts/setup.sh makes .venv)"
clean=(env -u HALO_LIBRARY -u LD_LIBRARY_PATH -u PYTHONPATH)

# 1. The wheel.
run 300 "${clean[@]}" "$python" -m pip wheel --no-build-isolation --no-deps -w "$work/dist" "$repo/python" ||
	fail "pip wheel ./python failed"
wheels=("$work"/dist/halocp-*.whl)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || fail "no single halocp wheel in $work/dist: ${wheels[*]}"
whl=${wheels[0]##*/}
case $whl in
*-py3-none-linux_*.whl) ;;
*) fail "wheel $whl is not tagged py3-none-linux_<arch>" ;;
esac
# The listing first, then grep: grep -q leaves at the first match, and under
# pipefail the writer's broken pipe would fail the test.
listing=$("$python" -m zipfile -l "${wheels[0]}") || fail "cannot list $whl"
grep -q '^halocp/libhalo.so ' <<<"$listing" || fail "$whl does not carry halocp/libhalo.so"
echo "ok: built $whl with halocp/libhalo.so inside"

# 2. Install into a venv and run a job.
# No pip or setuptools of its own (the project venv's pip installs into it):
# an old bundled setuptools would shadow the one PyTorch 2 requires.
"$python" -m venv --without-pip "$work/venv"
# The test's venv reads the project venv's site packages after its own.
base=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
echo "$base" >"$site/project-venv.pth"
run 120 "${clean[@]}" "$python" -m pip --python "$work/venv/bin/python" install --no-index "${wheels[0]}" || fail "pip install $whl failed"
port=$(free_port_pair)
cd "$work"
run 150 "${clean[@]}" "$work/venv/bin/python" -m torch.distributed.run --nproc-per-node 2 --master-port "$port" \
	-r 1 -t 1 --log-dir "$work/logs" "$repo/examples/python/halo_job.py" || fail "the 2-rank job failed"
for r in 0 1; do
	grep -q "rank $r of 2: ok.* from $site/halocp/libhalo.so" "$work/out" ||
		fail "rank $r did not report ok with the library from $site/halocp"
done
echo "ok: a 2-rank job from the venv, with the wheel's own libhalo.so and no environment variable"

# 3. The lookup error of an installed package.
mv "$site/halocp/libhalo.so" "$work/libhalo.so.moved"
"${clean[@]}" "$work/venv/bin/python" -c 'import halocp
try:
    halocp.version()
except halocp.HaloError as e:
    print(e)' >"$work/out" 2>"$work/err" || fail "the lookup error check did not run"
grep -q "inside the package: $site/halocp/libhalo.so (no such file)" "$work/out" ||
	fail "the error does not name the package's own copy"
if grep -q 'build' "$work/out"; then
	fail "the error lists a build folder, which an installed package does not have"
fi
echo "ok: without its library the installed package names only real places: $(grep -c ': ' "$work/out") lines"
