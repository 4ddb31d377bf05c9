#!/usr/bin/env bash
# Copy a Megatron-LM tests export without its functional-test goldens (36 MB of the 43), so that
# it fits in the GPU host's upload beside the bundle (../shared/gpu/README.md):
#   bash tests/megatron_lm/slim.sh [SRC=.megatron-lm] [DST=.megatron-lm-gpu]
# then on the host: MEGATRON_LM=.megatron-lm-gpu bash tools/gpu_session.sh megatron-tests
set -euo pipefail
src=${1:-.megatron-lm}
dst=${2:-.megatron-lm-gpu}
rm -rf "$dst"
mkdir -p "$dst/tests"
cp "$src"/COMMIT "$src"/pyproject.toml "$dst"/ 2>/dev/null || true
for entry in "$src"/tests/*; do
  case $(basename "$entry") in
    functional_tests) ;;
    *) cp -r "$entry" "$dst/tests/" ;;
  esac
done
du -sh "$dst"
