#!/usr/bin/env bash
# Installs what building and testing chorus needs on Debian 12, if missing.
# Safe to run repeatedly; does nothing when everything is present.
#   scripts/deps.sh          build and test
#   scripts/deps.sh --fuzz   also clang and libFuzzer (libclang-rt-14-dev) for
#                            the fuzzers (scripts/fuzz.sh); these are optional:
#                            when they cannot be installed the script says so
#                            and scripts/fuzz.sh reports the fuzzers as skipped
#   scripts/deps.sh --cluster  also the real launchers the release pass tests
#                            against: Open MPI (openmpi-bin), MPICH (mpich),
#                            PMIx headers (libpmix-dev, so the build enables
#                            the PMIx bootstrap), iproute2 for emulated hosts,
#                            etcd (etcd-server, etcd-client: the emulated
#                            hosts run it, and have no network to install
#                            it from); optional like the fuzzers (the tests
#                            that need them skip and say why).  Slurm is
#                            installed by its fixture (tests/fixtures/).
#   scripts/deps.sh --torch  also PyTorch from Debian (python3-torch,
#                            libtorch-dev, pybind11-dev, g++) for the torch
#                            backend, python3-torchvision for the DDP tests
#                            of PyTorch's own suite (dist_suite.py), and
#                            pip + setuptools for the
#                            `pip install ./python` test; optional like the
#                            fuzzers (the backend's tests skip and say why).
# Always: python3-dev and python3-numpy, for `import chorus` (python/), and
# python3-regex for the tokenizer's reference test.
set -euo pipefail
fuzz=0 cluster=0 torch=0
for arg in "$@"; do
  case $arg in
    --fuzz) fuzz=1 ;;
    --cluster) cluster=1 ;;
    --torch) torch=1 ;;
    *) echo "deps.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done
installed() { [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]; }
need=()
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v make >/dev/null 2>&1 || need+=(make)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v pgrep >/dev/null 2>&1 || need+=(procps)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config) # the docs build programs with it
# CBLAS for the training runtime's matrix products (OpenBLAS).
[[ "$(dpkg-query -W -f='${Status}' libopenblas-dev 2>/dev/null)" == "install ok installed" ]] ||
  need+=(libopenblas-dev)
# libcrypto (OpenSSL 3) for authentication and encryption (src/util/crypto.c).
[[ "$(dpkg-query -W -f='${Status}' libssl-dev 2>/dev/null)" == "install ok installed" ]] ||
  need+=(libssl-dev)
# libcurl and jansson for chorusrun's etcd client (src/launcher/kv_etcd.c);
# jansson also reads the tokenizer's encoder.json (src/train/bpe.c).
for p in libcurl4-openssl-dev libjansson-dev; do installed "$p" || need+=("$p"); done
# UCX for the UCX channel (CHORUS_TRANSPORT=ucx): headers to build it,
# libucp (libucx0) loaded at run time by the ranks that use it.
installed libucx-dev || need+=(libucx-dev)
# The Python package (python/chorus): headers and NumPy.
for p in python3-dev python3-numpy; do installed "$p" || need+=("$p"); done
# Python's regex module: the tokenizer's reference (tests/train/bpe_ref.py,
# GPT-2's pre-split pattern needs \p{L}/\p{N}) and the generator of its
# Unicode table (tools/gen_bpe_unicode.py); train.bpe_reference skips
# without it.
installed python3-regex || need+=(python3-regex)
# The fuzzers: clang 14 and its runtime libraries (libFuzzer, ASan, UBSan).
fuzz_need=()
if ((fuzz)); then
  command -v clang >/dev/null 2>&1 || fuzz_need+=(clang)
  [[ "$(dpkg-query -W -f='${Status}' libclang-rt-14-dev 2>/dev/null)" == "install ok installed" ]] ||
    fuzz_need+=(libclang-rt-14-dev)
fi
cluster_need=()
if ((cluster)); then
  for p in openmpi-bin mpich libpmix-dev iproute2 etcd-server etcd-client; do installed "$p" || cluster_need+=("$p"); done
fi
torch_need=()
if ((torch)); then
  for p in python3-torch libtorch-dev pybind11-dev g++ python3-torchvision python3-pip \
           python3-setuptools python3-venv; do
    installed "$p" || torch_need+=("$p")
  done
fi
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
if ((${#need[@]} + ${#fuzz_need[@]} + ${#cluster_need[@]} + ${#torch_need[@]})); then
  $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq || echo "deps: apt-get update failed" >&2
fi
if ((${#need[@]})); then
  echo "deps: installing ${need[*]}"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${need[@]}" >/dev/null
fi
if ((${#fuzz_need[@]})); then
  echo "deps: installing ${fuzz_need[*]} (fuzzers)"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq "${fuzz_need[@]}" >/dev/null ||
    echo "deps: could not install ${fuzz_need[*]}: the fuzzers will be skipped" >&2
fi
if ((${#cluster_need[@]})); then
  echo "deps: installing ${cluster_need[*]} (real launchers for the release tests)"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=600 "${cluster_need[@]}" >/dev/null ||
    echo "deps: could not install ${cluster_need[*]}: the tests that need them will skip" >&2
fi
if ((${#torch_need[@]})); then
  echo "deps: installing ${torch_need[*]} (the PyTorch backend and its tests)"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout=600 "${torch_need[@]}" >/dev/null ||
    echo "deps: could not install ${torch_need[*]}: the torch tests will skip" >&2
fi
