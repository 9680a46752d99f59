#!/bin/sh
# san_run.sh DIR COMMAND [ARG...]: runs one test of a sanitizer build so
# that a report of ANY process of the test fails it: the test, its peer
# helpers, the `llmdd` processes it starts and theirs, Python interpreters
# that load the instrumented library, whatever their output was redirected
# to and however they ended (a helper the test kills, or whose exit status
# it does not read, still fails it). tests/CMakeLists.txt puts this in front
# of every test's command there.
#
# Every instrumented process writes its reports to DIR/run.*/report.<pid>
# (the sanitizers' log_path) rather than to its stderr; after the test this
# prints each report file and fails the test, whatever the command's exit
# status was. Programs without a sanitizer runtime (etcd, sh, ip) ignore
# the options. One exception: gcc's UBSan beside its ASan keeps writing to
# stderr; tests/CMakeLists.txt fails a test whose output shows such a
# report, and tests/harness/cli_util.c passes on those of the tool's
# captured stderr.
set -u
parent=$1
shift
mkdir -p "$parent" || exit 1
dir=$(mktemp -d "$parent/run.XXXXXX") || exit 1
log="log_path=$dir/report"
# Appended to what the caller set (CTest's ENVIRONMENT, .ci/run's
# suppressions); a later option overrides an earlier one. UBSan stops at its
# first report, also in programs the tests compile with a recovering
# -fsanitize=undefined (tests/docs); TSan goes on, and exits 66 at the end.
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}$log"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:+$UBSAN_OPTIONS:}$log:halt_on_error=1"
UBSAN_OPTIONS="$UBSAN_OPTIONS:print_stacktrace=1"
export TSAN_OPTIONS="${TSAN_OPTIONS:+$TSAN_OPTIONS:}$log"

"$@"
rc=$?
found=0
for f in "$dir"/report.*; do
    [ -e "$f" ] || continue
    found=$((found + 1))
    echo "llmdd: sanitizer report of process ${f##*.}:" >&2
    cat "$f" >&2
done
rm -rf "$dir"
if [ "$found" -gt 0 ]; then
    echo "llmdd: $found sanitizer report(s) in this test's processes" \
        "(exit status $rc): failed" >&2
    exit 1
fi
exit "$rc"
