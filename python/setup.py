"""pip install ./python  (offline: add --no-build-isolation; Debian's
python3-pip and python3-setuptools).

The extensions are built by the project's CMake (the same rules as the
in-tree build, cmake/python.cmake) in the build_ext step, with libchorus
copied next to them so the installed package is self-contained:
chorus/_chorus*.so, chorus/libchorus.so.0 and, where Debian's torch and
pybind11 are installed, chorus/_torch*.so.  CHORUS_CMAKE_ARGS adds
arguments to the CMake configure step (e.g. -DCHORUS_TORCH=OFF).
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class CMakeBuild(build_ext):
    def run(self):
        if not os.path.exists(os.path.join(ROOT, "include", "chorus.h")):
            raise RuntimeError("setup.py must stay in the chorus source tree (python/), next to "
                               "include/ and src/")
        build = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(build, exist_ok=True)
        cfg = ["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
               "-DBUILD_TESTING=OFF", "-DCHORUS_PYTHON=ON", "-DCHORUS_PYTHON_ORIGIN=ON",
               "-DCHORUS_PYTHON_EXECUTABLE=" + sys.executable]
        cfg += shlex.split(os.environ.get("CHORUS_CMAKE_ARGS", ""))
        subprocess.check_call(cfg)
        # cmake/python.cmake lists the extension targets it could configure
        # (the torch one only where torch, libtorch-dev and pybind11 are).
        with open(os.path.join(build, "python", "targets.txt")) as f:
            targets = f.read().split()
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", build, "-j", jobs, "--target"] + targets)
        out = os.path.join(self.build_lib, "chorus")
        os.makedirs(out, exist_ok=True)
        made = os.path.join(build, "python", "chorus")
        for f in glob.glob(os.path.join(made, "*.so*")):
            shutil.copy2(f, out, follow_symlinks=True)


setup(
    name="chorus",
    version="0.1.0",
    description="Collective communication for CPU processes: torch.distributed's API over "
                "libchorus, and a PyTorch backend",
    packages=["chorus"],
    ext_modules=[Extension("chorus._chorus", sources=[])],  # built by CMakeBuild
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.9",
    zip_safe=False,
)
