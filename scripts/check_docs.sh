#!/bin/sh
# Every file of this project that a comment or a doc names exists, and none
# cites a file outside the repository (the docs and the header are the
# whole specification). Prints what it finds wrong; exits 1 if anything.
#   sh scripts/check_docs.sh        (from anywhere in the checkout)
set -eu
cd "$(git rev-parse --show-toplevel)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bad=0

files=$(git ls-files -- '*.c' '*.h' '*.cpp' '*.md' '*.py' '*.sh' '*.cmake' \
    '*.txt' '*.in' '.ci/*' | grep -v '^tests/fuzz/corpus/')
git ls-files >"$tmp/tracked"
# Directories too, every ancestor: a name may be a folder ("tests/harness").
awk -F/ '{ p = ""; for (i = 1; i < NF; i++) { p = p (i > 1 ? "/" : "") $i; print p } }' \
    "$tmp/tracked" | sort -u >"$tmp/dirs"
sed 's#.*/##' "$tmp/tracked" | sort -u >"$tmp/bases"

# 1. Nothing outside the tree is cited as a source of truth.
if grep -nE '\.\./shared|\b(MODEL|API|STYLE)\.md\b' $files; then
    echo "check_docs: the lines above cite files outside the repository" >&2
    bad=1
fi

# 2. Paths under the project's top directories must exist (a trailing
# slash or a wildcard names a folder or a family: only its folder is
# checked). Placeholders (<x>, X/, ...) and generated names are skipped.
grep -onE '(^|[^A-Za-z0-9_./${-])(src|include|tests|docs|python|examples|scripts|cmake)/[A-Za-z0-9_./*<>-]+' \
    $files >"$tmp/paths" || true
# One awk for every hit (a process per hit took a minute): the tracked
# files and folders and the allowed names are its tables.
awk -v tracked="$tmp/tracked" -v dirs="$tmp/dirs" \
    -v allow=scripts/check_docs.allow '
    BEGIN {
        while ((getline l < tracked) > 0) known[l] = 1
        while ((getline l < dirs) > 0) known[l] = 1
        while ((getline l < allow) > 0) known[l] = 1
    }
    {
        where = $0; sub(/:.*/, "", where)
        rest = substr($0, length(where) + 2)
        line = rest; sub(/:.*/, "", line)
        p = substr(rest, length(line) + 2)
        sub(/^[^A-Za-z]*/, "", p); sub(/[.,;:)]+$/, "", p)
        if (p ~ /[<>*]/ || p ~ /\/X(\/|$)/ || index(p, "...")) next
        d = p; sub(/\/$/, "", d)
        if (d in known) next
        # Files a build makes from a tracked template or source.
        if (d == "python/llmdd/_libpath.py" || d ~ /^python\/llmdd\/_lib/ ||
            d ~ /^cmake\/llmdd.*Targets\.cmake$/) next
        print where ":" line ": names " p ", which is not in the repository"
        bad = 1
    }
    END { exit bad }' "$tmp/paths" >&2 || bad=1

# 3. A bare file name (ending .c, .h, .md or .py) in prose (the
# docs, comment lines of the sources) must be some tracked file's name;
# names of other projects' files are listed in scripts/check_docs.allow.
# shellcheck disable=SC2086 # $files: one name each, no spaces
awk '
    FNR == 1 { md = FILENAME ~ /\.md$/ }
    !md && !/^[[:space:]]*(\/\*|\*|\/\/|#[^i!])/ { next }
    {
        s = $0; pre = ""
        while (match(s, /[a-z][a-z0-9_]*\.(c|h|md|py)/)) {
            before = RSTART > 1 ? substr(s, RSTART - 1, 1) : pre
            after = substr(s, RSTART + RLENGTH, 1)
            name = substr(s, RSTART, RLENGTH)
            if (before !~ /[A-Za-z0-9_.\/<-]/ && after !~ /[A-Za-z0-9_]/)
                print FILENAME ":" FNR ":" name
            pre = substr(s, RSTART + RLENGTH - 1, 1)
            s = substr(s, RSTART + RLENGTH)
        }
    }' $files >"$tmp/names"
awk -v bases="$tmp/bases" -v allow=scripts/check_docs.allow '
    BEGIN {
        while ((getline l < bases) > 0) known[l] = 1
        while ((getline l < allow) > 0) known[l] = 1
    }
    {
        name = $0; sub(/.*:/, "", name)
        if (name in known) next
        at = $0; sub(/:[^:]*$/, "", at)
        print at ": names " name ", which no file of the repository is"
        bad = 1
    }
    END { exit bad }' "$tmp/names" >&2 || bad=1

[ "$bad" -eq 0 ] && echo "check_docs: every file named exists"
exit "$bad"
