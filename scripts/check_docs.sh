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
while IFS= read -r hit; do
    where=${hit%%:*}
    rest=${hit#*:}
    line=${rest%%:*}
    p=${rest#*:}
    p=$(printf '%s' "$p" | sed -E 's#^[^A-Za-z]*##; s#[.,;:)]+$##')
    case "$p" in
    *'<'* | *'>'* | */X/* | */X | *'*'* | *...*) continue ;;
    esac
    d=${p%/}
    if grep -qxF "$d" "$tmp/tracked" || grep -qxF "$d" "$tmp/dirs" ||
        grep -qxF "$d" scripts/check_docs.allow; then
        continue
    fi
    # Files a build makes from a tracked template or source.
    case "$d" in
    python/llmdd/_libpath.py | python/llmdd/_lib* | cmake/llmdd*Targets.cmake) continue ;;
    esac
    echo "$where:$line: names $p, which is not in the repository" >&2
    bad=1
done <"$tmp/paths"

# 3. A bare file name (ending .c, .h, .md or .py) in prose (the
# docs, comment lines of the sources) must be some tracked file's name;
# names of other projects' files are listed in scripts/check_docs.allow.
for f in $files; do
    case "$f" in
    *.md) grep -nE '' "$f" ;;
    *) grep -nE '^[[:space:]]*(/\*|\*|//|#[^i!])' "$f" ;;
    esac | grep -oE '^[0-9]+:|(^|[^A-Za-z0-9_./<-])[a-z][a-z0-9_]*\.(c|h|md|py)\b' |
        awk -v f="$f" '/^[0-9]+:$/ { n = $0; next }
                       { sub(/^[^a-z]*/, ""); print f ":" n $0 }'
done >"$tmp/names"
while IFS= read -r hit; do
    name=${hit##*:}
    grep -qxF "$name" "$tmp/bases" && continue
    grep -qxF "$name" scripts/check_docs.allow && continue
    echo "${hit%:*}: names $name, which no file of the repository is" >&2
    bad=1
done <"$tmp/names"

[ "$bad" -eq 0 ] && echo "check_docs: every file named exists"
exit "$bad"
