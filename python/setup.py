"""pip install ./python, into a virtual environment (Debian 12's python3 is
"externally managed": pip refuses to install into it, PEP 668):

    /usr/bin/python3 -m venv --system-site-packages ~/venvs/chorus
    ~/venvs/chorus/bin/pip install -v --no-build-isolation ./python

--system-site-packages lets the venv see Debian's numpy and torch;
--no-build-isolation builds offline with Debian's setuptools (python3-venv,
python3-pip, python3-setuptools); -v shows the whole build's output (pip
hides it otherwise; its progress lines still reach the terminal, when there
is one: the torch shim alone compiles for minutes).
The build happens in ~/.cache/chorus/pip-build (XDG_CACHE_HOME), not in the
source tree, and a second install reuses it.

The extensions are built by the project's CMake (the same rules as the
in-tree build, cmake/python.cmake) in the build_ext step, with libchorus
copied next to them so the installed package is self-contained:
chorus/_chorus*.so, chorus/libchorus.so.0 and, where Debian's torch and
pybind11 are installed, chorus/_torch*.so.  CHORUS_CMAKE_ARGS adds
arguments to the CMake configure step (e.g. -DCHORUS_TORCH=OFF).
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def say(line, tty_only=False):
    """A line of progress.  pip shows a build's output only with -v; the
    terminal, when there is one, gets the progress lines anyway."""
    if not tty_only:
        print(line, flush=True)
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
    except OSError:
        pass


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
        say("chorus: building %s in %s (%s jobs); the torch shim takes minutes"
            % (", ".join(targets), build, jobs))
        p = subprocess.Popen(["cmake", "--build", build, "-j", jobs, "--target"] + targets,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            print(line, end="", flush=True)  # all of it, for pip -v
            if re.match(r"^\[ *\d+%\] (Building|Linking)", line):
                say("chorus: " + line.strip(), tty_only=True)
        if p.wait() != 0:
            raise subprocess.CalledProcessError(p.returncode, p.args)
        say("chorus: built")
        out = os.path.join(self.build_lib, "chorus")
        os.makedirs(out, exist_ok=True)
        made = os.path.join(build, "python", "chorus")
        for f in glob.glob(os.path.join(made, "*.so*")):
            shutil.copy2(f, out, follow_symlinks=True)


# Build products outside the source tree (it stays clean), kept between
# installs so that a second one only rebuilds what changed.
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                     "chorus", "pip-build")
os.makedirs(CACHE, mode=0o700, exist_ok=True)

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
    options={"build": {"build_base": CACHE}, "egg_info": {"egg_base": CACHE}},
)
