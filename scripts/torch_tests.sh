#!/usr/bin/env bash
# Fetches PyTorch's own c10d tests (test/distributed/test_c10d_gloo.py and
# test_c10d_common.py) from Debian's source package of the installed
# python3-torch, for tests/python/torch/c10d_gloo.py.  Nothing of PyTorch's
# is kept in this tree: the files go under DEST, which the build tree holds.
#
#   scripts/torch_tests.sh DEST
#
# The source comes from the archive the machine's apt already installs
# python3-torch from (apt-cache policy names it), through a sources list,
# package lists and cache of DEST's own: the system's apt configuration and
# state are not touched.  Only the upstream tarball is needed (it holds the
# tests); a missing Debian diff is not an error.  When DEST already has the
# files, nothing is fetched.  Exit 0 with the files in DEST/test/distributed,
# or 2 with the reason on stderr (the comparison then skips and says so).
set -uo pipefail
dest=${1:?usage: torch_tests.sh DEST}
mkdir -p "$dest" && dest=$(cd "$dest" && pwd) || { echo "torch_tests: cannot make $1" >&2; exit 2; }
want=(test/distributed/test_c10d_gloo.py test/distributed/test_c10d_common.py)
have_all() { for f in "${want[@]}"; do [[ -s "$dest/$f" ]] || return 1; done; }
if have_all; then echo "torch_tests: $dest has them already"; exit 0; fi
no() { echo "torch_tests: $*" >&2; exit 2; }
src=$(dpkg-query -W -f='${source:Package} ${source:Version}' python3-torch 2>/dev/null) ||
  no "python3-torch is not installed"
pkg=${src% *} ver=${src#* }
# "500 http://deb.debian.org/debian bookworm/main amd64 Packages" under the
# installed version: the archive, suite and component.
line=$(apt-cache policy python3-torch 2>/dev/null |
  awk -v v="$ver" '$1 == v || ($1 == "***" && $2 == v) {f = 1; next}
                   f && $2 ~ /^https?:/ {print $2, $3; exit}')
[[ -n "$line" ]] || no "apt-cache policy names no archive for python3-torch $ver"
uri=${line% *} suite=${line#* }
comp=${suite#*/} suite=${suite%/*}
# The archive's key: the Signed-By of the system's entry for it, else
# Debian's archive keyring.
key=$(grep -rhs -A8 "$uri" /etc/apt/sources.list.d/*.sources 2>/dev/null |
  awk '/^Signed-By:/ {print $2; exit}')
[[ -n "$key" && -r "$key" ]] || key=/usr/share/keyrings/debian-archive-keyring.gpg
work="$dest/.apt"
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$dest" || no "cannot write $dest"
echo "deb-src [signed-by=$key] $uri $suite $comp" >"$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=$work/none"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
          -o "APT::Sandbox::User=root" -o "Acquire::Retries=2")
echo "torch_tests: fetching Debian's source of $pkg $ver from $uri $suite/$comp (private lists in $work)"
apt-get "${apt_opts[@]}" -qq update >"$work/update.log" 2>&1 ||
  no "apt-get update of the deb-src list failed: $(tail -n 2 "$work/update.log" | tr '\n' ' ')"
(cd "$work" && apt-get "${apt_opts[@]}" -qq source --download-only "$pkg=$ver") \
  >"$work/source.log" 2>&1
orig=$(ls "$work"/"${pkg}"_*.orig.tar.* 2>/dev/null | head -n 1)
[[ -n "$orig" ]] ||
  no "apt-get source $pkg=$ver brought no upstream tarball: $(tail -n 2 "$work/source.log" | tr '\n' ' ')"
tar -xf "$orig" -C "$work" --wildcards "*/${want[0]}" "*/${want[1]}" 2>"$work/tar.log" ||
  no "$orig lacks ${want[*]}: $(head -c 300 "$work/tar.log")"
for f in "${want[@]}"; do
  mkdir -p "$dest/$(dirname "$f")"
  cp "$(ls -d "$work"/*/"$f" | head -n 1)" "$dest/$f" || no "cannot copy $f"
done
rm -rf "$work"/*/ "$orig" "$work"/*.dsc "$work"/*.debian.tar.* "$work/cache"
have_all || no "the files did not arrive"
echo "torch_tests: $dest/test/distributed has test_c10d_gloo.py and test_c10d_common.py of $pkg $ver"
