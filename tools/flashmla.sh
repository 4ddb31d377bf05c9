#!/usr/bin/env bash
# FlashMLA on the H200 test host, for Megatron's fused DSA path (`dsa_kernel_backend="cudnn"`:
# Megatron's `dsa_cudnn_kernels` imports `flash_mla.flash_mla_sparse_fwd`, the signature of
# FlashMLA's nv_dev branch, which takes `indexer_topk`). Nothing of it is committed: the sources
# (a git snapshot of deepseek-ai/FlashMLA and of the cutlass commit it pins as a submodule) live
# in the ignored folder .flashmla/.
#
# Here, from the project root, with bare git directories of FlashMLA and cutlass:
#     bash tools/flashmla.sh pack FLASHMLA_GIT_DIR CUTLASS_GIT_DIR [REV]   # REV: nv_dev
# writes .flashmla/flashmla.tgz and .flashmla/build.sh. On the host (carry ".flashmla"):
#     bash .flashmla/build.sh        # SM90 only; prints a smoke test of flash_mla_sparse_fwd
#     export PYTHONPATH=/root/flashmla/FlashMLA:$PYTHONPATH
set -euo pipefail

pack() {
  local mla=$1 cutlass=$2 rev=${3:-nv_dev} commit cut_commit tmp
  [ -d .git ] || { echo "run this from the project root" >&2; exit 2; }
  commit=$(git --git-dir="$mla" rev-parse "$rev")
  cut_commit=$(git --git-dir="$mla" ls-tree "$commit" csrc/cutlass | awk '{print $3}')
  tmp=$(mktemp -d)
  mkdir -p "$tmp/FlashMLA/csrc/cutlass"
  git --git-dir="$mla" archive "$commit" | tar x -C "$tmp/FlashMLA"
  git --git-dir="$cutlass" archive "$cut_commit" include tools/util/include \
    | tar x -C "$tmp/FlashMLA/csrc/cutlass"
  rm -rf .flashmla && mkdir -p .flashmla
  tar czf .flashmla/flashmla.tgz -C "$tmp" FlashMLA
  rm -rf "$tmp"
  echo "FlashMLA $commit ($rev; cutlass $cut_commit)" > .flashmla/VERSION
  cp "$0" .flashmla/flashmla.sh
  printf '#!/usr/bin/env bash\nexec bash "$(dirname "$0")/flashmla.sh" build\n' > .flashmla/build.sh
  echo "ready: .flashmla ($(du -sh .flashmla | cut -f1)); $(cat .flashmla/VERSION)"
}

build() {
  local here root=/root/flashmla src=/root/flashmla/FlashMLA nvcc
  here=$(cd "$(dirname "$0")" && pwd)
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -1)
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}
  if ! cmp -s "$here/VERSION" $root/VERSION; then  # a new snapshot: from scratch
    rm -rf $root && mkdir -p $root
    tar xzf "$here/flashmla.tgz" -C $root
    cp "$here/VERSION" $root/VERSION
  fi
  if [ ! -f $root/.built ]; then  # (again after a failure: ninja keeps what compiled)
    # SM90 code only (the host's nvcc may predate SM100's); the system compilers, as DeepGEMM;
    # CUDA 13 keeps libcu++ (<cuda/std/...>, which cutlass includes) under include/cccl, which
    # nvcc adds and the C++ compiler of api.cpp does not.
    export CPLUS_INCLUDE_PATH=$CUDA_HOME/include/cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}
    command -v ninja > /dev/null || python3 -c "import ninja" 2> /dev/null \
      || echo "no ninja on this host: torch builds the extension one file at a time" >&2
    if ! (cd $src && CC=/usr/bin/gcc CXX=/usr/bin/g++ FLASH_MLA_DISABLE_SM100=1 \
          MAX_JOBS=${MAX_JOBS:-16} NVCC_THREADS=${NVCC_THREADS:-2} \
          python3 setup.py build_ext --inplace > $root/build.log 2>&1); then
      grep -n -i " error" $root/build.log | head -30
      echo "FlashMLA build failed: $root/build.log" >&2; exit 13
    fi
    touch $root/.built
  fi
  (cd /tmp && PYTHONPATH="$src:${PYTHONPATH:-}" python3 - <<'PY'
import torch
import flash_mla
from flash_mla import flash_mla_sparse_fwd

s, h, d, topk = 1024, 64, 576, 512
q = torch.randn(s, h, d, device="cuda", dtype=torch.bfloat16) / 8
kv = torch.randn(s, 1, d, device="cuda", dtype=torch.bfloat16) / 8
rows = torch.arange(s, device="cuda")[:, None]
idx = torch.arange(topk, device="cuda")[None, :].expand(s, topk)
idx = torch.where(idx <= rows, idx, -1).to(torch.int32)[:, None, :].contiguous()
out, _, lse = flash_mla_sparse_fwd(q, kv, idx, d**-0.5, d_v=512)
sel = idx[:, 0].clamp(min=0).long()
scores = torch.einsum("shd,skd->shk", q.float(), kv[sel, 0].float()) * d**-0.5
scores = scores.masked_fill((idx[:, 0] < 0)[:, None, :], float("-inf"))
ref = torch.einsum("shk,skd->shd", scores.softmax(-1), kv[sel, 0, :512].float())
err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
print(f"flash_mla {flash_mla.__file__}: flash_mla_sparse_fwd smoke test, max rel err {err:.1e}")
PY
  )
}

case "${1:-}" in
  pack) shift; [ $# -ge 2 ] || { echo "usage: $0 pack FLASHMLA_GIT CUTLASS_GIT [REV]" >&2; exit 2; }; pack "$@" ;;
  build) build ;;
  *) echo "usage: $0 pack FLASHMLA_GIT CUTLASS_GIT [REV] | build" >&2; exit 2 ;;
esac
