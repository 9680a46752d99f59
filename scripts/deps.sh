#!/bin/sh
# Installs the Debian 12 packages llmdd needs to build, test and benchmark,
# when any is missing. Idempotent; runs apt-get only when something is absent.
#   sh scripts/deps.sh          build, tests (the Python ones too), demo, plots
#                               (libopenblas0-pthread: torch in examples/disagg runs
#                               ~5x faster than on the reference BLAS)
#   sh scripts/deps.sh --ci     also the CI extras (clang for fuzzing, valgrind,
#                               promtool from prometheus for the metrics test)
set -eu

pkgs="build-essential cmake pkg-config libcmocka-dev libcjson-dev libssl-dev
libucx-dev ucx-utils gnuplot-nox iproute2 libmicrohttpd-dev
python3-pytest python3-numpy python3-torch python3-setuptools python3-pip
libopenblas0-pthread"
if [ "${1:-}" = "--ci" ]; then
    pkgs="$pkgs clang libclang-rt-14-dev valgrind prometheus"
fi

missing=""
for p in $pkgs; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
        missing="$missing $p"
    fi
done
[ -z "$missing" ] && exit 0

echo "deps.sh: installing:$missing" >&2
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# shellcheck disable=SC2086
$SUDO apt-get install -y -q --no-install-recommends $missing
