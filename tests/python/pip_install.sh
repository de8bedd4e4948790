#!/usr/bin/env bash
# The documented pip route (docs/python.md), as written: a venv with
# --system-site-packages made by Debian's python3, then
# `pip install -v --no-build-isolation ./python` (offline).  Checks:
#   - pip refuses Debian's own python3 (PEP 668), which is why the docs
#     use a venv (skipped where the interpreter is not externally managed);
#   - the build shows its progress (-v) and leaves the source tree clean
#     (no python/build, no *.egg-info);
#   - the installed package -- its own libchorus next to its extension,
#     nothing from the build tree -- runs an all_reduce on 2 ranks from /.
# The torch extension is left out here (CHORUS_TORCH=OFF): the release
# build compiles it once, and this test is about the packaging.
#   pip_install.sh PYTHON CHORUSRUN SOURCE_DIR
set -uo pipefail
py=$1 run=$2 src=$3
if ! "$py" -m venv --help >/dev/null 2>&1 || ! "$py" -c 'import setuptools, ensurepip' 2>/dev/null; then
  echo "SKIPPED: venv, ensurepip or setuptools missing for $py (python3-venv, python3-setuptools)"
  exit 77
fi
dest=$(mktemp -d /tmp/chorus-pip.XXXXXX)
trap 'rm -rf "$dest"' EXIT
fails=0
bad() { echo "FAIL $1"; fails=$((fails + 1)); }
before=$(ls -a "$src/python")

stdlib=$("$py" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
if [ -e "$stdlib/EXTERNALLY-MANAGED" ]; then
  if "$py" -m pip install --no-build-isolation --no-deps --dry-run "$src/python" \
      >"$dest/pep668.log" 2>&1; then
    bad "pip installs into $py, which says it is externally managed"
  else grep -q "externally-managed-environment" "$dest/pep668.log" &&
    echo "ok   pip refuses $py itself (PEP 668): the docs' venv is needed" ||
    { bad "pip into $py failed for another reason"; tail -n 5 "$dest/pep668.log"; }
  fi
else echo "skip the PEP 668 check: $py is not externally managed"; fi

# The docs' commands, with the venv and the build cache in the scratch folder.
"$py" -m venv --system-site-packages "$dest/venv" >"$dest/venv.log" 2>&1 ||
  { cat "$dest/venv.log"; echo "FAIL: python3 -m venv"; exit 1; }
if ! XDG_CACHE_HOME=$dest/cache CHORUS_CMAKE_ARGS=-DCHORUS_TORCH=OFF \
    "$dest/venv/bin/pip" install -v --no-build-isolation --no-deps --no-cache-dir "$src/python" \
    >"$dest/pip.log" 2>&1; then
  tail -40 "$dest/pip.log"; echo "FAIL: pip install"; exit 1
fi
grep -q "chorus: building chorus_python" "$dest/pip.log" && grep -qE '^ *\[ *[0-9]+%\]' "$dest/pip.log" &&
  echo "ok   pip install -v shows the build's progress" || bad "no progress in pip's output"
[ "$before" = "$(ls -a "$src/python")" ] && echo "ok   the source tree is left clean" ||
  bad "pip left files in $src/python: $(diff <(echo "$before") <(ls -a "$src/python") | tr '\n' ' ')"
site=$("$dest/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("platlib"))')
for f in __init__.py libchorus.so.0; do
  [[ -e $site/chorus/$f ]] || bad "chorus/$f not installed in the venv"
done
out=$(cd / && env -u PYTHONPATH CHORUS_TIMEOUT=30 "$run" --standalone -n 2 -- "$dest/venv/bin/python" -c '
import numpy as np, chorus, sys
assert chorus.__file__.startswith(sys.prefix), chorus.__file__
chorus.init_process_group()
a = np.full(4, chorus.get_rank() + 1, np.float32)
chorus.all_reduce(a)
print("sum", a[0])
chorus.destroy_process_group()' 2>&1)
echo "$out" | sed 's/^/     /'
[[ $(grep -c "sum 3.0" <<<"$out") == 2 ]] && echo "ok   the venv's chorus all_reduces on 2 ranks (numpy from Debian)" ||
  bad "the installed package did not all_reduce"
[ "$fails" -eq 0 ] && echo "pip install into a venv: ok" && exit 0
echo "$fails pip check(s) FAILED"; exit 1
