#!/usr/bin/env bash
# Runs here, with the network: downloads the Python 3.12 wheels the GPU machine lacks (see
# wheels.py; the versions this checkout's .venv runs) into bench/gpu/wheels/ (git-ignored), and
# checks that they stay under the 64 MiB a device call can carry.
#   make install && bash bench/gpu/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
DEST=bench/gpu/wheels
LIMIT_MIB=64
[ -x "$PY" ] || { echo "prepare.sh: $PY not found: run \`make install\` first (or set PYTHON)" >&2; exit 1; }

requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
"$PY" bench/gpu/wheels.py > "$requirements"
rm -rf "$DEST" && mkdir -p "$DEST"
# --no-deps: the list is already complete (wheels.py), and a resolver would pull torch again.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -r "$requirements"
cp "$requirements" "$DEST/requirements.txt"

count=$(find "$DEST" -name '*.whl' | wc -l)
expected=$(wc -l < "$requirements")
[ "$count" -eq "$expected" ] || { echo "prepare.sh: $count wheels for $expected requirements" >&2; exit 1; }
bytes=$(du -cb "$DEST" | tail -1 | cut -f1)
echo "prepare.sh: $count wheels, $((bytes / 1048576)) MiB in $DEST (limit $LIMIT_MIB MiB)"
if [ "$bytes" -ge $((LIMIT_MIB * 1048576)) ]; then
    echo "prepare.sh: over the $LIMIT_MIB MiB a device call carries; trim ROOTS in bench/gpu/wheels.py" >&2
    exit 1
fi
