#!/usr/bin/env bash
# vLLM 0.28.0's own CUDA key quantization for the DSA indexer (`indexer_k_quant_and_cache`,
# csrc/libtorch_stable/cache_kernels.cu), built standalone on the H200 test host: vLLM's prebuilt
# extension does not load against the host's torch, so this compiles that one file, unmodified,
# with the headers it includes and our binding (tools/vllm_legacy/binding.cpp), into one torch op.
# Nothing of vLLM is committed: its files live in the ignored folder .vllm-legacy/.
#
# Here, from the project root, with vLLM 0.28.0's sdist (docs/gpu-validation.md has the download):
#     bash tools/vllm_legacy_kernel.sh pack vllm-0.28.0.tar.gz [OUT]   # OUT: .vllm-legacy
# extracts only the files of tools/vllm_legacy/SHA256SUMS, checks their SHA-256 and writes them
# with our build files and .vllm-legacy/build.sh. On the host (carry ".vllm-legacy"):
#     bash .vllm-legacy/build.sh       # nvcc sm_90a, ~1 min; /root/vllm-legacy; a smoke test
#     export DSA_VLLM_LEGACY=/root/vllm-legacy
set -euo pipefail

RELEASE=vllm-0.28.0
# PyPI's vllm-0.28.0.tar.gz (recorded, not required: the files' own hashes are what is checked).
SDIST_SHA256=ac96dd0ec5be9c13f2aa4bfb50498c4727110406f6e4980b58a4097e4d18634a

pack() {
  local tarball=$1 out=${2:-.vllm-legacy} here sha note=""
  here=$(cd "$(dirname "$0")" && pwd)
  local sums=$here/vllm_legacy/SHA256SUMS
  [ -f "$tarball" ] || { echo "no such file: $tarball" >&2; exit 2; }
  tmp=$(mktemp -d)  # global: the EXIT trap reads it
  trap 'rm -rf "$tmp"' EXIT
  local members=()
  while read -r _ path; do members+=("$RELEASE/$path"); done < "$sums"
  if ! tar xzf "$tarball" -C "$tmp" "${members[@]}" 2> "$tmp/tar.log"; then
    cat "$tmp/tar.log" >&2
    echo "$tarball is not vLLM 0.28.0's sdist: files are missing" >&2
    exit 3
  fi
  if ! (cd "$tmp/$RELEASE" && sha256sum --quiet --strict -c "$sums") >&2; then
    echo "$tarball: these files differ from vLLM 0.28.0's (tools/vllm_legacy/SHA256SUMS)" >&2
    exit 4
  fi
  sha=$(sha256sum "$tarball" | cut -d' ' -f1)
  [ "$sha" = "$SDIST_SHA256" ] || note=" (not PyPI's tarball; the files match)"
  rm -rf "$out" && mkdir -p "$out"
  mv "$tmp/$RELEASE" "$out/$RELEASE"
  cp "$sums" "$here/vllm_legacy/binding.cpp" "$here/vllm_legacy/build.py" "$0" "$out/"
  echo "vllm 0.28.0 sdist sha256 $sha$note" > "$out/VERSION"
  printf '#!/usr/bin/env bash\nexec bash "$(dirname "$0")/%s" build "$@"\n' "$(basename "$0")" \
    > "$out/build.sh"
  chmod +x "$out/build.sh"
  echo "ready: $out ($(du -sh "$out" | cut -f1)); $(cat "$out/VERSION")"
}

build() {
  local here out=${VLLM_LEGACY_BUILD:-/root/vllm-legacy} nvcc
  here=$(cd "$(dirname "$0")" && pwd)
  (cd "$here/$RELEASE" && sha256sum --quiet --strict -c "$here/SHA256SUMS")
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -1)
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}
  mkdir -p "$out"
  python3 "$here/build.py" "$here/$RELEASE" "$out" "$@"
  cp "$here/SHA256SUMS" "$here/VERSION" "$out/"
}

case "${1:-}" in
  pack) shift; [ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: $0 pack SDIST_TARBALL [OUT]" >&2; exit 2; }; pack "$@" ;;
  build) shift; build "$@" ;;
  *) echo "usage: $0 pack SDIST_TARBALL [OUT] | build [--no-smoke]" >&2; exit 2 ;;
esac
