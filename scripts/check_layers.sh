#!/bin/sh
# Who may include what (docs/architecture.md): each grep below must print
# nothing. Exits 1, after the offending lines, if one does.
set -eu
cd "$(git rev-parse --show-toplevel)"
out=$(
    grep -rn '#include "ctrl/' src/core src/transport src/base || true
    grep -rn '#include "\(core\|transport\|ctrl\|meta\)/' src/base || true
    # The metadata client has no instance: base/ and its own files only;
    # the core and the control plane use its one header, transports none.
    grep -rn '#include "\(core\|transport\|ctrl\)/' src/meta || true
    grep -rn '#include "meta/' src/core src/ctrl | grep -v '"meta/meta\.h"' || true
    grep -rn '#include "meta/' src/transport || true
    grep -rn '#include "transport/[a-z]*/' src/core src/ctrl || true
    # The tool uses the public header only (its own headers beside it).
    grep -rn '#include "[^"]*/' src/cli || true
)
if [ -n "$out" ]; then
    printf '%s\n' "$out"
    echo "check_layers: the includes above cross a layer" >&2
    exit 1
fi
echo "check_layers: every include within its layer"
