"""halocp's build: the wheel carries libhalo.so.

Building a wheel (pip wheel ./python, pip install ./python, python3 -m build
python) compiles libhalo.so from the repository this folder belongs to, with
CMake and Go, and puts it inside the package as halocp/libhalo.so, where
halocp looks first. The sdist carries the library's sources for that. The Python code is the same for every interpreter, the
library is not: the wheel is tagged py3-none-<platform>.

The metadata lives in pyproject.toml; this file only adds the library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
# libhalo's sources: the checkout this folder belongs to, or the copy an
# sdist carries (see SdistWithSources).
BUNDLED = HERE / "libhalo-src"
REPO = BUNDLED if (BUNDLED / "CMakeLists.txt").is_file() else HERE.parent
# What CMake needs to build the libhalo target (tests and halod are left out).
LIBHALO_SOURCES = ["CMakeLists.txt", "go.mod", "go.sum", "cmake", "include", "capi", "comm", "halo", "rendezvous", "ucx"]


class BuildWithLibrary(build_py):
    """build_py, then libhalo.so into the built package."""

    def run(self):
        super().run()
        if self.dry_run:
            return
        build_temp = Path(self.get_finalized_command("build").build_temp)
        target = Path(self.build_lib) / "halocp" / "libhalo.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(build_libhalo(build_temp / "libhalo"), target)
        os.chmod(target, 0o755)


class SdistWithSources(sdist):
    """An sdist that carries libhalo's sources, so that a wheel built from
    it (python3 -m build) can compile the library too."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        if REPO is BUNDLED:
            raise SystemExit("halocp: make the sdist from a checkout, not from another sdist")
        skip = shutil.ignore_patterns("*_test.go", "testdata", "__pycache__", "*.pyc")
        for name in LIBHALO_SOURCES:
            src, dst = REPO / name, Path(base_dir) / BUNDLED.name / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst, ignore=skip)
            else:
                shutil.copy2(src, dst)


def build_libhalo(build_dir: Path) -> Path:
    """Configure and build the repository's libhalo target; return the library."""
    if not (REPO / "CMakeLists.txt").is_file() or not (REPO / "include" / "halo.h").is_file():
        raise SystemExit(
            f"halocp: {REPO} is not a halo checkout (no CMakeLists.txt and include/halo.h beside python/). "
            "The wheel compiles libhalo.so from the repository's sources: build it from a clone "
            "(pip wheel ./python) or from an sdist made there (python3 -m build python)."
        )
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("halocp: building the wheel needs CMake (Debian: apt-get install cmake), Go and UCX's headers")
    build_type = os.environ.get("CMAKE_BUILD_TYPE") or "Release"
    jobs = str(os.cpu_count() or 1)
    subprocess.run([cmake, "-S", str(REPO), "-B", str(build_dir), f"-DCMAKE_BUILD_TYPE={build_type}",
                    "-DBUILD_TESTING=OFF"], check=True)
    subprocess.run([cmake, "--build", str(build_dir), "--target", "libhalo", "-j", jobs], check=True)
    lib = (build_dir / "lib" / "libhalo.so").resolve()
    if not lib.is_file():
        raise SystemExit(f"halocp: the build finished but left no {lib}")
    return lib


class BinaryDistribution(Distribution):
    """Native code inside: installed to platlib, and the wheel is not pure."""

    def has_ext_modules(self):
        return True


cmdclass = {"build_py": BuildWithLibrary, "sdist": SdistWithSources}
try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # no wheel package: setup.py can still build_py/install
    bdist_wheel = None

if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):
        """py3-none-<platform>: any Python 3 (ctypes, no extension module), this platform's libhalo.so."""

        def get_tag(self):
            _, _, plat = super().get_tag()
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass, distclass=BinaryDistribution)
