#!/usr/bin/env bash
# A Debian package of the whole product (what `cmake --install` installs,
# with prefix /usr): libchorus and libchorus-train, both headers, chorusrun,
# chorus-train, chorus-data, chorus-bench, chorus.pc, chorus-train.pc, the
# CMake package and the Python package (with the PyTorch backend where
# Debian's torch is installed here) in /usr/lib/python3/dist-packages.
#   scripts/package.sh [BUILD_DIR]     (default build-deb)
# Writes BUILD_DIR/chorus_<version>_<arch>.deb and prints its path; then
#   apt install ./build-deb/chorus_*.deb
# Its dependencies are Debian 12's packages (CMakeLists.txt, CPack);
# python3-torch and python3-numpy are recommended, which apt installs by
# default.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build-deb}
scripts/deps.sh
command -v dpkg-deb >/dev/null || { echo "package.sh: dpkg-deb missing (apt-get install dpkg)" >&2; exit 1; }
echo "== configure ($out, prefix /usr)"
log=$(mktemp)
cmake -S . -B "$out" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=/usr \
  -DBUILD_TESTING=OFF >"$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
rm -f "$log"
echo "== build"
# A line per target built, with cmake's percentage; the whole log on failure.
set +e
cmake --build "$out" -j"$(nproc)" 2>&1 | tee "$out/build.log" | grep --line-buffered -E '^\[ *[0-9]+%\] Built target'
rc=${PIPESTATUS[0]}
set -e
[ "$rc" -eq 0 ] || { tail -n 40 "$out/build.log"; echo "package.sh: the build failed" >&2; exit 1; }
echo "== package"
(cd "$out" && cpack -G DEB >cpack.log 2>&1) || { cat "$out/cpack.log"; exit 1; }
ls "$out"/chorus_*.deb
