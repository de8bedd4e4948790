#!/usr/bin/env bash
# Where Debian's python3-torch is installed, the committed fixtures must be
# what it produces today (otherwise test_sampler compares against stale
# lists).  Without torch there is nothing to compare with: skipped.
#   sampler_fixtures_fresh.sh DIR   (the folder of gen_sampler_fixtures.py)
set -u
dir=$1
if ! /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  echo "python3-torch not installed: skipped"
  exit 0
fi
if /usr/bin/python3 "$dir/gen_sampler_fixtures.py" | diff -q - "$dir/sampler_fixtures.txt"; then
  echo "fixtures match torch $(/usr/bin/python3 -c 'import torch; print(torch.__version__)')"
  exit 0
fi
echo "FAIL: sampler_fixtures.txt differs from what torch produces now; regenerate it"
exit 1
