#!/usr/bin/env bash
# Format the tree and apply ruff's safe fixes.
set -euo pipefail
cd "$(dirname "$0")"
RUFF=${RUFF:-ruff}
command -v "$RUFF" >/dev/null 2>&1 || RUFF="python -m ruff"
$RUFF format .
$RUFF check --fix .
