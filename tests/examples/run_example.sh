#!/usr/bin/env bash
# run_example.sh - runs one example under chorusrun and checks its output.
#
# usage: run_example.sh [options] CHORUSRUN N BINARY [EXPECTED_GREP...]
#
# Runs `CHORUSRUN --standalone -n N -- BINARY` and fails unless
#  - it exits 0 (chorusrun exits 0 only if every rank did), and
#  - every EXPECTED_GREP (an extended regular expression, grep -E) matches
#    at least one line of its standard output.
# Options:
#   --from-source FILE  standard output must be exactly the lines shown in
#                       FILE's header comment as " *   [rankN]:...", in any
#                       order (a trailing " */" is not part of a line)
#   --lines K           standard output must have exactly K lines
#   --max-seconds S     the run must take at most S seconds
#   --launcher-arg A    an argument for chorusrun (repeatable)
#   --arg A             an argument for BINARY (repeatable)
# Standard output and error are printed in full, for ctest's log.
set -u

src="" lines="" max_s="" largs=() bargs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --from-source) src="$2"; shift 2 ;;
    --lines) lines="$2"; shift 2 ;;
    --max-seconds) max_s="$2"; shift 2 ;;
    --launcher-arg) largs+=("$2"); shift 2 ;;
    --arg) bargs+=("$2"); shift 2 ;;
    --) shift; break ;;
    -*) echo "run_example.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
if [ $# -lt 3 ]; then
  echo "usage: run_example.sh [options] CHORUSRUN N BINARY [EXPECTED_GREP...]" >&2
  exit 2
fi
chorusrun="$1" n="$2" binary="$3"
shift 3

tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT

start=$(date +%s%N)
"$chorusrun" --standalone -n "$n" "${largs[@]}" -- "$binary" "${bargs[@]}" >"$tmp/out" 2>"$tmp/err"
rc=$?
end=$(date +%s%N)
ms=$(( (end - start) / 1000000 ))

echo "--- $chorusrun --standalone -n $n ${largs[*]} -- $binary ${bargs[*]}: exit $rc after $ms ms"
echo "--- stdout:"
cat "$tmp/out"
echo "--- stderr:"
cat "$tmp/err"
echo "---"

fail=0
if [ "$rc" -ne 0 ]; then
  echo "FAIL: exit status $rc, expected 0"
  fail=1
fi
slack=${CHORUS_TEST_SLACK:-1} # the slow builds' multiplier (whole numbers)
slack=${slack%%.*}
if [ -n "$max_s" ] && [ "$ms" -gt $((max_s * 1000 * slack)) ]; then
  echo "FAIL: took $ms ms, more than $max_s s (x $slack)"
  fail=1
fi
if [ -n "$lines" ]; then
  got=$(wc -l <"$tmp/out")
  if [ "$got" -ne "$lines" ]; then
    echo "FAIL: $got lines on stdout, expected $lines"
    fail=1
  fi
fi
for re in "$@"; do
  if ! grep -E -q -- "$re" "$tmp/out"; then
    echo "FAIL: no line of stdout matches: $re"
    fail=1
  fi
done
if [ -n "$src" ]; then
  sed -n 's|^ \*   \(\[rank[0-9]*\]:.*\)$|\1|p' "$src" | sed 's| \*/$||' | LC_ALL=C sort >"$tmp/want"
  if [ ! -s "$tmp/want" ]; then
    echo "FAIL: no expected output found in the header of $src"
    fail=1
  fi
  LC_ALL=C sort "$tmp/out" >"$tmp/got"
  if ! diff -u "$tmp/want" "$tmp/got" >"$tmp/diff"; then
    echo "FAIL: stdout differs from the expected output in $src (- expected, + got, sorted):"
    cat "$tmp/diff"
    fail=1
  fi
fi
[ "$fail" -eq 0 ] && echo "PASS"
exit "$fail"
