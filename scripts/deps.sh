#!/usr/bin/env bash
# Installs what building and testing chorus needs on Debian 12, if missing.
# Safe to run repeatedly; does nothing when everything is present.
set -euo pipefail
need=()
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v make >/dev/null 2>&1 || need+=(make)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v pgrep >/dev/null 2>&1 || need+=(procps)
# CBLAS for the training runtime's matrix products (OpenBLAS).
[[ "$(dpkg-query -W -f='${Status}' libopenblas-dev 2>/dev/null)" == "install ok installed" ]] ||
  need+=(libopenblas-dev)
# libcrypto (OpenSSL 3) for authentication and encryption (src/util/crypto.c).
[[ "$(dpkg-query -W -f='${Status}' libssl-dev 2>/dev/null)" == "install ok installed" ]] ||
  need+=(libssl-dev)
if ((${#need[@]})); then
  echo "deps: installing ${need[*]}"
  sudo=""
  [[ $(id -u) -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
