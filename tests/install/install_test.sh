#!/usr/bin/env bash
# The installed product, used as a user would, with nothing from the build
# or source tree on any path: `cmake --install BUILD --prefix TMP`, then
#   1. every part is there (both libraries with their SONAMEs, both
#      headers, the four programs, chorus.pc and chorus-train.pc, the CMake
#      package, the Python package) and nothing installed names the build;
#   2. README's 20-line program (taken from README.md itself) builds with
#      pkg-config and with find_package(chorus), and runs on 3 ranks under
#      the installed chorusrun with no LD_LIBRARY_PATH;
#   3. a libchorus-train program (examples/train_elastic.c) builds both ways
#      and trains on 2 ranks; the installed chorus-data and chorus-train
#      prepare a dataset and train on it;
#   4. /usr/bin/python3 imports the installed chorus (and chorus.torch where
#      the build made it) from /, and 2 ranks all_reduce through it.
#   install_test.sh BUILD_DIR SOURCE_DIR PYTHON
set -u
. "$(dirname "$0")/../lib.sh"
build=$1 src=$2 py=$3
tmp_dir install
on_exit 'pkill -9 -f "$TMP/" 2>/dev/null'
p=$TMP/prefix
# A user's shell: no variable of the build, the tests or the developer's.
clean() { env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$TMP" CHORUS_TIMEOUT=60 "$@"; }

if ! cmake --install "$build" --prefix "$p" >"$TMP/install.log" 2>&1; then
  cat "$TMP/install.log"; echo "FAIL: cmake --install"; exit 1
fi
# 1. What is there.
for f in bin/chorusrun bin/chorus-train bin/chorus-data bin/chorus-bench include/chorus.h \
         include/chorus_train.h lib/libchorus.so.0 lib/libchorus-train.so.0 lib/libchorus.a \
         lib/pkgconfig/chorus.pc lib/pkgconfig/chorus-train.pc \
         lib/cmake/chorus/chorus-config.cmake lib/cmake/chorus/chorus-config-version.cmake; do
  [ -e "$p/$f" ] || fail "$f is not installed"
done
pydir=$(ls -d "$p"/lib/python3*/*-packages 2>/dev/null | head -n 1)
[ -n "$pydir" ] && [ -e "$pydir/chorus/__init__.py" ] || fail "the Python package is not installed"
for l in libchorus.so.0 libchorus-train.so.0; do
  s=$(readelf -d "$p/lib/$l" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p')
  [ "$s" = "$l" ] || fail "$l has SONAME '$s'"
done
if grep -rlI -e "$build" -e "$src" "$p" >"$TMP/names" 2>/dev/null; then
  fail "installed text files name the build or source tree: $(tr '\n' ' ' <"$TMP/names")"
fi
for f in "$p"/bin/* "$p"/lib/*.so.0 "$pydir"/chorus/*.so; do
  r=$(readelf -d "$f" | grep -E 'RPATH|RUNPATH')
  case $r in *"$build"* | *"$src"*) fail "$f has a run path into the build: $r" ;; esac
done
[ "$FAILS" -eq 0 ] && ok "everything is installed, and nothing names the build tree"

# 2. README's program.
sed -n '/^## The API in 20 lines/,/^## /p' "$src/README.md" | sed -n '/^```c$/,/^```$/p' |
  sed '1d;$d' >"$TMP/prog.c"
[ "$(wc -l <"$TMP/prog.c")" -ge 15 ] || fail "README's program not found in README.md"
run3() { # NAME PROGRAM: 3 ranks under the installed chorusrun print the sum 3
  (cd "$TMP" && clean timeout 60 "$p/bin/chorusrun" --standalone -n 3 -- "$2") >"$TMP/$1.log" 2>&1
  if [ "$(grep -c 'sum of ranks = 3$' "$TMP/$1.log")" -eq 3 ]; then ok "$1 runs on 3 ranks"
  else fail "$1 on 3 ranks"; tail -n 5 "$TMP/$1.log"; fi
}
# PKG_CONFIG_LIBDIR: only our .pc files, as on a machine without other
# development packages (chorus.pc once required libcrypto.pc: libssl-dev).
pc() { clean PKG_CONFIG_LIBDIR="$p/lib/pkgconfig" pkg-config "$@"; }
# shellcheck disable=SC2046
if clean cc -o "$TMP/prog_pc" "$TMP/prog.c" $(pc --cflags --libs chorus) 2>"$TMP/cc.log"; then
  ok "README's program builds with pkg-config"
  run3 "the pkg-config build" "$TMP/prog_pc"
else fail "cc with pkg-config chorus"; cat "$TMP/cc.log"; fi
mkdir -p "$TMP/app"
cp "$TMP/prog.c" "$src/examples/train_elastic.c" "$TMP/app/"
cat >"$TMP/app/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(app C)
find_package(chorus 0.1 REQUIRED)
add_executable(prog prog.c)
target_link_libraries(prog PRIVATE chorus::chorus)
add_executable(train train_elastic.c)
target_link_libraries(train PRIVATE chorus::train)
CM
if clean cmake -S "$TMP/app" -B "$TMP/app/build" -DCMAKE_PREFIX_PATH="$p" >"$TMP/cm.log" 2>&1 &&
   clean cmake --build "$TMP/app/build" >>"$TMP/cm.log" 2>&1; then
  ok "find_package(chorus) builds README's program and a libchorus-train program"
  run3 "the find_package build" "$TMP/app/build/prog"
else fail "find_package(chorus)"; tail -n 20 "$TMP/cm.log"; fi

# 3. libchorus-train, and the installed programs.
if clean cc -o "$TMP/train_pc" "$src/examples/train_elastic.c" $(pc --cflags --libs chorus-train) \
     2>"$TMP/cc2.log"; then ok "a libchorus-train program builds with pkg-config chorus-train"
else fail "cc with pkg-config chorus-train"; cat "$TMP/cc2.log"; fi
for t in "$TMP/train_pc" "$TMP/app/build/train"; do
  [ -x "$t" ] || continue
  (cd "$TMP" && clean OPENBLAS_NUM_THREADS=1 timeout 120 "$p/bin/chorusrun" --standalone -n 2 -- \
     "$t" "$src/data/tinyshakespeare.txt") >"$TMP/train.log" 2>&1
  if grep -q "final loss" "$TMP/train.log"; then ok "it trains on 2 ranks ($(basename "$t"))"
  else fail "$t on 2 ranks"; tail -n 5 "$TMP/train.log"; fi
done
head -c 200000 "$src/data/tinyshakespeare.txt" >"$TMP/text.txt"
if (cd "$TMP" && clean "$p/bin/chorus-data" prepare --vocab-size 300 --threads 1 \
      -o "$TMP/data" "$TMP/text.txt") >"$TMP/data.log" 2>&1 &&
   (cd "$TMP" && clean OPENBLAS_NUM_THREADS=1 timeout 120 "$p/bin/chorusrun" --standalone -n 2 -- \
      "$p/bin/chorus-train" --data "$TMP/data" --layers 1 --heads 2 --channels 32 --ctx 32 \
      --batch 4 --steps 4 --sample 0) >"$TMP/cli.log" 2>&1 &&
   grep -q "validation loss" "$TMP/cli.log"; then
  ok "the installed chorus-data prepares a dataset and chorus-train trains on it"
else fail "chorus-data prepare + chorus-train"; tail -n 5 "$TMP/data.log" "$TMP/cli.log"; fi

# 4. Python.
if [ ! -x "$py" ] || [ -z "$pydir" ]; then
  echo "SKIPPED: the Python package (no $py, or the build made none)"
else
  mods=chorus
  ls "$pydir"/chorus/_torch*.so >/dev/null 2>&1 && mods="chorus, chorus.torch"
  if (cd / && clean PYTHONPATH="$pydir" "$py" -c "import $mods; assert chorus.__file__.startswith('$pydir')") \
      >"$TMP/py.log" 2>&1; then ok "$py imports $mods from / (PYTHONPATH=PREFIX/${pydir#"$p"/})"
  else fail "import $mods"; cat "$TMP/py.log"; fi
  (cd / && clean PYTHONPATH="$pydir" timeout 60 "$p/bin/chorusrun" --standalone -n 2 -- "$py" -c '
import numpy as np, chorus
chorus.init_process_group()
a = np.full(4, chorus.get_rank() + 1, np.float32)
chorus.all_reduce(a)
print("sum", a[0])
chorus.destroy_process_group()') >"$TMP/py2.log" 2>&1
  [ "$(grep -c 'sum 3.0' "$TMP/py2.log")" -eq 2 ] && ok "and 2 ranks all_reduce through it" ||
    { fail "the installed Python package on 2 ranks"; tail -n 5 "$TMP/py2.log"; }
fi
summary "the installed product works" "install check(s) FAILED"
