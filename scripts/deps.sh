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
libucx-dev ucx-utils gnuplot-nox iproute2 libmicrohttpd-dev libcurl4-openssl-dev
etcd-server
python3-pytest python3-numpy python3-torch python3-setuptools python3-pip python3-dev
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
# Another apt or dpkg run (unattended upgrades on a fresh machine) may hold
# apt's or dpkg's lock: wait for it, up to 10 minutes, instead of failing
# with 100. DPkg::Lock::Timeout covers dpkg's lock; the package lists' lock
# is not covered by it (apt 2.6), so a run that failed on a lock is retried.
apt_wait() {
    waited=0
    while :; do
        if out=$($SUDO apt-get -o DPkg::Lock::Timeout=600 "$@" 2>&1); then
            printf '%s\n' "$out"
            return 0
        fi
        case "$out" in
        *"Could not get lock"* | *"Unable to lock"*)
            if [ "$waited" -ge 600 ]; then
                printf '%s\n' "$out" >&2
                return 100
            fi
            [ "$waited" -eq 0 ] &&
                echo "deps.sh: another apt or dpkg run holds its lock; waiting" >&2
            sleep 5
            waited=$((waited + 5))
            ;;
        *)
            printf '%s\n' "$out" >&2
            return 100
            ;;
        esac
    done
}
apt_wait update -q
# shellcheck disable=SC2086
apt_wait install -y -q --no-install-recommends $missing
