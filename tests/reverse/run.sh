#!/usr/bin/env bash
# Reverse-direction check (issue 2, "Done when"): signatures, epoch payloads and heartbeats
# produced by the Rust engy-core are verified with the reference Python library
# py-sr25519-bindings (and the §6 rules re-implemented in Python).
#
#   tests/reverse/run.sh                 # generate with cargo, then check
#   tests/reverse/run.sh --file X.json   # check an existing reverse_from_rust.json
#
# The venv lives under ${ENGY_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/engy}/reverse-venv and
# is reused. Exit status: 0 all checks passed, 1 a check failed, 2 usage/setup error.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
file=""
while [ $# -gt 0 ]; do
  case "$1" in
    --file) [ $# -ge 2 ] || { echo "run.sh: --file needs a path" >&2; exit 2; }; file="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

cache="${ENGY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/engy}"
venv="$cache/reverse-venv"
mkdir -p "$cache"
if ! "$venv/bin/python" -c 'import sr25519' 2>/dev/null; then
  echo "run.sh: creating venv $venv with py-sr25519-bindings" >&2
  python3 -m venv "$venv" || { echo "run.sh: python3 -m venv failed" >&2; exit 2; }
  "$venv/bin/pip" install --quiet --disable-pip-version-check 'py-sr25519-bindings>=0.2,<1' \
    || { echo "run.sh: pip install py-sr25519-bindings failed" >&2; exit 2; }
fi

if [ -z "$file" ]; then
  file="$cache/reverse_from_rust.json"
  echo "run.sh: generating $file with cargo" >&2
  (cd "$root" && ENGY_REVERSE_OUT="$file" cargo test --quiet -p engy-core --test reverse_python \
      write_reverse_file -- --exact >&2)
fi

"$venv/bin/python" "$here/check_reverse.py" "$file"
