#!/usr/bin/env bash
# `pip install ./python` (offline, --no-build-isolation) into a scratch
# folder, then the installed package -- its own libchorus next to its
# extension, nothing from the build tree -- runs an all_reduce on 2 ranks.
# The torch extension is left out here (CHORUS_TORCH=OFF): the release
# build compiles it once, and this test is about the packaging.
#   pip_install.sh PYTHON CHORUSRUN SOURCE_DIR
set -euo pipefail
py=$1 run=$2 src=$3
if ! "$py" -m pip --version >/dev/null 2>&1 || ! "$py" -c 'import setuptools' 2>/dev/null; then
  echo "SKIPPED: pip or setuptools missing for $py (python3-pip, python3-setuptools)"
  exit 77
fi
dest=$(mktemp -d /tmp/chorus-pip.XXXXXX)
cleanup() { rm -rf "$dest" "$src/python/build" "$src"/python/*.egg-info; }
trap cleanup EXIT
CHORUS_CMAKE_ARGS=-DCHORUS_TORCH=OFF "$py" -m pip install --no-build-isolation --no-deps \
  --no-cache-dir --target "$dest" "$src/python" > "$dest.log" 2>&1 || {
  tail -40 "$dest.log"; rm -f "$dest.log"; echo "FAIL: pip install"; exit 1; }
rm -f "$dest.log"
for f in __init__.py libchorus.so.0; do
  [[ -e $dest/chorus/$f ]] || { echo "FAIL: chorus/$f not installed"; ls -la "$dest/chorus"; exit 1; }
done
ls "$dest"/chorus/_chorus*.so >/dev/null || { echo "FAIL: no extension installed"; exit 1; }
out=$(env -u PYTHONPATH PYTHONPATH="$dest" CHORUS_TIMEOUT=30 "$run" --standalone -n 2 -- "$py" -c '
import numpy as np, chorus, os
assert chorus.__file__.startswith(os.environ["PYTHONPATH"]), chorus.__file__
chorus.init_process_group()
a = np.full(4, chorus.get_rank() + 1, np.float32)
chorus.all_reduce(a)
print("sum", a[0])
chorus.destroy_process_group()' 2>&1)
echo "$out"
[[ $(grep -c "sum 3.0" <<<"$out") == 2 ]] || { echo "FAIL: the installed package did not all_reduce"; exit 1; }
echo "pip install ./python: ok"
