#!/usr/bin/env bash
# The H200 runs behind docs/gpu-validation.md, docs/benchmarks.md and docs/megatron.md.
# On the GPU host, after `source .gpu/bin/env.sh` (../shared/gpu/README.md):
#   bash tools/gpu_session.sh deepgemm tests bench demo toy replay ...
#   bash tools/gpu_session.sh deepgemm tests-speed bench bench-long bench-split bench-thd
#   (docs/benchmarks.md)
# Every step logs to $OUT (default ./gpu-out); the last step packs the logs into $OUT/logs.tgz.
set -uo pipefail
TORCH213_WHEELS="torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl \
  triton-3.7.1-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
OUT=${OUT:-gpu-out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)  # absolute: a step may run from another folder
export DSA_PRECISION_REPORT=$LOGS/gpu_report.jsonl
# The engines' files (docs/gpu-validation.md): vLLM 0.33 / LMDeploy / SGLang, and vLLM 0.28.0's
# files at the same paths in a root of their own (picked by their hashes).
ENGINE_ROOTS=$PWD/.engine-kernels:$PWD/.engine-kernels/vllm-0.28
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$LOGS/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  >> "$LOGS/device.txt" 2>&1
cat "$LOGS/device.txt"

run() {  # run NAME TIMEOUT CMD...: log to $LOGS/NAME.log, print its tail
  local name=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $(( $(date +%s) - start )) s"
  grep -v -i "warn\|deprecat" "$LOGS/$name.log" | tail -n "${TAIL:-25}"
}

bench_step() {  # bench_step NAME TIMEOUT ARGS...: the JSON report in NAME.log, tables in NAME.txt
  local name=$1 limit=$2
  shift 2
  TAIL=3 run "$name" "$limit" python -m dsa_precision bench --json "$@"
  python - "$LOGS/$name.log" <<'PY' | tee "$LOGS/$name.txt"
import json, sys
from dsa_precision.cli.bench_tables import format_tables
text = open(sys.argv[1]).read()
start = 0 if text.startswith("{\n") else text.index("\n{\n") + 1  # warnings may precede it
print(format_tables(json.JSONDecoder().raw_decode(text[start:])[0]))
PY
}

for step in "$@"; do
  case $step in
    deepgemm)  # build DeepGEMM from the ignored .dg/ bundle (../shared/gpu/deepgemm.sh)
      run deepgemm 400 bash .dg/build.sh
      export PYTHONPATH=/root/dg/DeepGEMM:${PYTHONPATH:-} ;;
    deepgemm-path)  # a later call on the same machine: the build of `deepgemm` if it is there
      if [ -d /root/dg/DeepGEMM/deep_gemm ]; then
        export PYTHONPATH=/root/dg/DeepGEMM:${PYTHONPATH:-}; echo "== deepgemm-path: reused"
      else
        run deepgemm 400 bash .dg/build.sh
        export PYTHONPATH=/root/dg/DeepGEMM:${PYTHONPATH:-}
      fi ;;
    flashmla)  # build FlashMLA's SM90 kernels from the ignored .flashmla/ bundle (tools/flashmla.sh)
      TAIL=5 run flashmla 580 bash .flashmla/build.sh
      grep -v "ptxas info\|bytes stack frame\|Compiling entry\|Function properties\|Used [0-9]* registers" \
        /root/flashmla/build.log 2> /dev/null | tail -60 > "$LOGS/flashmla_build_tail.log"
      export PYTHONPATH=/root/flashmla/FlashMLA:${PYTHONPATH:-} ;;
    vllm-legacy)  # build vLLM 0.28.0's own key quantization from the ignored .vllm-legacy/
      # (tools/vllm_legacy_kernel.sh); the tests-vllm_028 step then checks vllm-legacy's k with it
      run vllm_legacy_build 400 bash .vllm-legacy/build.sh
      export DSA_VLLM_LEGACY=/root/vllm-legacy ;;
    vllm-ops)  # vLLM's own pieces from its wheel (../shared/gpu/vllm_wheel.sh): the vendored
      # DeepGEMM 2.8.1 from .vllm-dg/ on PYTHONPATH, and its ops library (the indexer top-k
      # kernels), joined from the parts kept by .bigcarry/bin/keep.sh, as DSA_VLLM_OPS
      # (a later call on the same machine reuses the joined library)
      ops=_C_stable_libtorch.abi3.so
      TAIL=3 run vllm_ops 120 bash -c "{ [ -f \$HOME/vllm-ops/$ops ] || \
        bash .bigcarry/bin/join.sh $ops \$HOME/vllm-ops; } && \
        mkdir -p \$HOME/vdg && tar -xJf .vllm-dg/vdg.tar.xz -C \$HOME/vdg"
      export PYTHONPATH=${PYTHONPATH:-}:$HOME/vdg DSA_VLLM_OPS=$HOME/vllm-ops/$ops
      export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
      cat .vllm-dg/VERSION 2> /dev/null ;;
    logprobs-vllm)  # issue 48: the RL tables with the rollout's top-k by vLLM's own kernels and
      # rope_fp32+fp8+ties (after `vllm-ops`; the engines' files in .engine-kernels)
      export DSA_ENGINE_KERNELS=${DSA_ENGINE_KERNELS:-$PWD/.engine-kernels}
      for shape in "2048 256 30" "8192 2048 10"; do
        read -r seq topk steps <<< "$shape"
        TAIL=12 run "logprobs_vllm_$seq" 600 python examples/logprob_mismatch.py --seq "$seq" \
          --topk "$topk" --steps "$steps" --rollout engine-kernels --rollout-topk vllm \
          --configs baseline,rope_fp32+fp8,rope_fp32+fp8+ties --out "$LOGS/lp_vllm_$seq.json"
      done ;;
    logprobs-vllm-long)  # issue 48: the RL table at S = 32768 (top-2048; 1 attention head:
      # Megatron's unfused sparse attention holds heads x S x S float32 scores, and 2 ran out of
      # memory in the warm-up backward on an H100), rollout top-k by vLLM's kernels (after
      # `vllm-ops`); the baseline is left out (its BF16 indexer holds S x 32 x S float32 scores)
      export DSA_ENGINE_KERNELS=${DSA_ENGINE_KERNELS:-$PWD/.engine-kernels}
      for steps in 0 2; do
        TAIL=12 run "logprobs_vllm_32768_s$steps" 400 env \
          PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python examples/logprob_mismatch.py \
          --seq 32768 --topk 2048 --attention-heads 1 --steps "$steps" \
          --train-config rope_fp32+fp8 --rollout engine-kernels --rollout-topk vllm \
          --configs rope_fp32+fp8,rope_fp32+fp8+ties --out "$LOGS/lp_vllm_32768_s$steps.json"
      done ;;
    toy-ties)  # issue 48: the step time of replay_ties (2 % of rows sent, --tie-share) beside the
      # computed picks and full replay, S = 2048 then 8192
      for shape in "2048 256 30 2" "8192 2048 8 1"; do
        read -r seq topk steps profile <<< "$shape"
        TAIL=10 run "toy_ties_$seq" 600 python examples/toy_glm5_train.py --seq "$seq" \
          --topk "$topk" --steps "$steps" --share-steps 0 --stock-steps 0 \
          --profile-steps "$profile" --host-steps 0 \
          --configs rope_fp32+fp8,rope_fp32+fp8+ties,replay --out "$LOGS/toy_ties_$seq.json"
      done ;;
    topk-engines)  # issue 48: SGLang 0.5.23's and LMDeploy 0.18.0's top-k kernels (the files in
      # DSA_ENGINE_KERNELS; lmdeploy-tilelang after `tilelang`) against the exact top-k
      export DSA_ENGINE_KERNELS=${DSA_ENGINE_KERNELS:-$PWD/.engine-kernels}
      TAIL=45 run engine_topk_engines 600 python tools/engine_topk.py --engines sglang lmdeploy \
        --runs 3 --out "$LOGS/topk-engines" ;;
    conformance-034)  # issue 49: vLLM 0.34.0's kernels (.engine-kernels034, the vendored
      # DeepGEMM of its wheel in .vllm-dg034) against the profiles vllm and vllm-eager, kernel
      # level then layer level
      mkdir -p "$HOME/vdg034" && tar -xJf .vllm-dg034/vdg.tar.xz -C "$HOME/vdg034"
      TAIL=20 run conformance_034 600 env DSA_ENGINE_KERNELS="$PWD/.engine-kernels034" \
        PYTHONPATH="$PWD:$HOME/vdg034:${PYTHONPATH:-}" python tools/engine_conformance.py \
        --profiles vllm vllm-eager --out "$LOGS/conf034"
      TAIL=20 run layer_conformance_034 600 env DSA_ENGINE_KERNELS="$PWD/.engine-kernels034" \
        PYTHONPATH="$PWD:$HOME/vdg034:${PYTHONPATH:-}" python tools/layer_conformance.py \
        --profiles vllm vllm-eager --out "$LOGS/layer034" ;;
    engine-topk)  # issue 48: vLLM's four top-k kernels against the exact top-k, and the tie
      # replay (after `vllm-ops`): docs/gpu-validation.md, "The engines' top-k"
      TAIL=45 run engine_topk 600 python tools/engine_topk.py --out "$LOGS" ;;
    te)  # Transformer Engine 2.20.2 (CUDA 13) from .bigcarry/ (../shared/gpu/README.md, "Transformer
      # Engine on the H200"): the joined wheel, then the torch extension built here (~105 s)
      w=transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
      TAIL=5 run te_install 600 bash -c "bash .bigcarry/bin/join.sh $w \$HOME/te-wheel && \
        python -m pip install --no-deps --no-index \$HOME/te-wheel/$w .bigcarry/te/*.whl && \
        NVTE_FRAMEWORK=pytorch MAX_JOBS=16 NVTE_CUDA_ARCHS=90 python -m pip install --no-deps \
        --no-index --no-build-isolation .bigcarry/te/transformer_engine_torch-2.20.2.tar.gz && \
        python -c 'import transformer_engine as t, transformer_engine.pytorch; print(\"TE\", t.__version__)'" ;;
    tilelang)  # tilelang 0.1.15 (CUDA 13 build, TVM bundled; its JIT compiles with the host's nvcc)
      # and what it imports, from .bigcarry/ (docs/megatron.md, "TileLang"), into a folder ahead of
      # the bundle on PYTHONPATH: its apache-tvm-ffi 0.1.12 shadows the bundle's 0.1.15.post2
      # (tilelang pins <0.1.13; cudnn-frontend takes >=0.1.11); then the smoke test
      w=tilelang-0.1.15-wheels.tar
      site=${TILELANG_SITE:-$HOME/tilelang-site}
      if [ ! -d "$site/tilelang" ]; then
        TAIL=4 run tilelang_install 300 bash -c "bash .bigcarry/bin/join.sh $w \$HOME/tl-wheels && \
          tar xf \$HOME/tl-wheels/$w -C \$HOME/tl-wheels && rm -rf $site && \
          python -m pip install -q --no-deps --no-index --target $site \
          \$HOME/tl-wheels/${w%.tar}/*.whl && ls $site"
      else
        echo "== tilelang: reused $site"
      fi
      export PYTHONPATH=$site:${PYTHONPATH:-}
      command -v nvcc > /dev/null || export PATH=${CUDA_HOME:-/usr/local/cuda}/bin:$PATH
      TAIL=12 run tilelang_smoke 500 python tools/tilelang_smoke.py ;;
    tests-tilelang)  # the drop-ins on Megatron's TileLang sparse attention (after `tilelang`)
      TAIL=30 run gpu_tests_tilelang 600 python -m pytest -m gpu -q -rs -s -p no:cacheprovider \
        tests/gpu/test_tilelang.py ;;
    toy-backends)  # the toy at one S on each of Megatron's backends (none, cudnn, tilelang):
      # baseline = Megatron's indexer and sparse attention on that backend, FP8 = the package's
      # top-k and that backend's sparse attention; a backend whose library is absent is skipped
      # with megatron-core's reason (cudnn: after `flashmla`; tilelang: after `tilelang`)
      for kb in none cudnn tilelang; do
        why=$(python -c "import sys; from megatron.core import utils as u
m = {'none': lambda: [], 'cudnn': u._missing_cudnn_dsa_kernel_dependencies,
     'tilelang': u._missing_tilelang_dsa_kernel_dependencies}[sys.argv[1]]()
print(', '.join(m))" "$kb" 2> /dev/null || echo "megatron-core does not import")
        if [ -n "$why" ]; then echo "== toy_${TOY_SEQ:-8192}_$kb: skipped, missing $why"; continue; fi
        TAIL=12 run "toy_${TOY_SEQ:-8192}_$kb" 600 python examples/toy_glm5_train.py \
          --seq ${TOY_SEQ:-8192} --topk ${TOY_TOPK:-2048} --kernel-backend $kb \
          --steps ${TOY_STEPS:-8} --share-steps 0 --stock-steps 0 --profile-steps 1 \
          --host-steps 1 --configs ${TOY_CONFIGS:-baseline,rope_fp32+fp8,replay} \
          --out "$LOGS/toy_${TOY_SEQ:-8192}_$kb.json"
      done ;;
    bridge-wheels)  # Megatron-Bridge 0.6.2, transformers 5.12.1 and what they import, from the
      # wheels in .gpu-extra/ (README, "With Megatron-Bridge"; the host reaches no registry)
      TAIL=3 run bridge_wheels 300 bash -c 'python -m pip install --no-deps --no-index \
        $(ls .gpu-extra/*/*.whl) && python -c "import transformers; print(transformers.__version__)"' ;;
    bridge)  # issue 31: the Bridge tests (TE's spec), then the toy built by the Bridge (the four
      # configurations, the default against the Bridge's stock model)
      TAIL=30 run bridge_tests 600 python -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/gpu/test_bridge.py
      TAIL=14 run toy_bridge 600 python examples/toy_glm5_train.py --bridge --steps 30 \
        --share-steps 1 --stock-steps 3 --profile-steps 2 \
        --configs baseline,rope_fp32,fp8,rope_fp32+fp8,replay --out "$LOGS/toy_bridge.json" ;;
    tests)  # every test marked gpu, in any folder of tests/ (tests/test_gpu_suite.py checks it)
      TAIL=40 run gpu_tests 900 python -m pytest -m gpu -q -rs -p no:cacheprovider tests ;;
    tests-speed)  # the GPU tests of the DeepGEMM path, chunked select, top-k, no-sync, CUDA graph
      TAIL=40 run gpu_tests_speed 600 python -m pytest -m gpu -q -rs -s -p no:cacheprovider \
        tests/gpu/test_scoring.py tests/gpu/test_determinism.py \
        -k "deepgemm or entry_points or select or topk or never_waits or cuda_graph" ;;
    tests-legacy)  # the GPU tests of vllm-legacy: vLLM 0.28.0's key and query kernels, the layer
      # cells at S = 512 (after `vllm-legacy`; placed before tests-*, which would take the name)
      export DSA_ENGINE_KERNELS=${DSA_ENGINE_KERNELS:-$ENGINE_ROOTS}
      TAIL=8 run gpu_tests_legacy 600 python -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests -k "legacy or vllm_028" ;;
    tests-*)  # tests-KEYWORD: the gpu tests matching a -k expression
      TAIL=40 run "gpu_tests_${step#tests-}" 600 python -m pytest -m gpu -q -rs -s \
        -p no:cacheprovider tests -k "${step#tests-}" ;;
    bench)  # S 8192 16384, H 32 64: package beside the raw kernels, both backends
      bench_step bench 600 ${BENCH_ARGS:-} ;;
    bench-before)  # issue 51: the same `bench` (BENCH_ARGS) from the package as it was before the
      # restructure (.before/, from `git archive 651c40b dsa_precision`), run from inside .before/
      # so that its copy is the one imported; run `bench` in the same call to compare
      ( cd .before && bench_step bench_before 600 ${BENCH_ARGS:-} ) ;;
    bench-long)  # S 32768 65536 131072, chunked select (about 2-3 minutes on an H200)
      bench_step bench_long 600 --long ${BENCH_ARGS:-} ;;
    bench-split)  # FP8 time split at S 16384 65536: score traffic share, fused-kernel decision
      bench_step bench_split 600 --split ${BENCH_ARGS:-} ;;
    bench-long-4g)  # issue 20: --long with 4 GiB chunks (a quarter of the chunks of the default)
      bench_step bench_long_4g 600 --long --chunk-bytes 4294967296 ${BENCH_ARGS:-} ;;
    bench-thd)  # packed sequences (THD): indexer_scores_varlen / indexer_select_varlen beside
      # the raw kernels at T 8192 16384 (with BENCH_ARGS=--long also T 32768-131072, select only)
      bench_step bench_thd 600 --thd ${BENCH_ARGS:-} ;;
    bench-megatron)  # Megatron's own indexer top-k on each dsa_kernel_backend (none, cudnn,
      # tilelang: after `tilelang`; a missing one is skipped with its reason) beside the package's
      # FP8 top-k, S 8192 16384 (--megatron-seq in BENCH_ARGS for others)
      bench_step bench_megatron 600 --megatron ${BENCH_ARGS:-} ;;
    bench-all)  # bench, bench-long, bench-split and bench-thd in one process (kernels compile once)
      bench_step bench_all 560 --seq 8192 16384 --long --split --thd ${BENCH_ARGS:-} ;;
    demo)  # every engine profile, H = 32 and 64, cuDNN training side (DeepGEMM inference side)
      for heads in 32 64; do
        for engine in "vllm-exact" "vllm" "vllm-eager" "vllm-legacy" "lmdeploy" \
                      "sglang-fused --rope-interleaved" "sglang-unfused --hadamard"; do
          tag=$(echo "$engine" | cut -d' ' -f1)-h$heads
          TAIL=9 run "demo_$tag" 300 python -m dsa_precision demo --device cuda --heads $heads \
            --engine $engine
        done
        TAIL=9 run "demo_deepgemm-h$heads" 300 python -m dsa_precision demo --device cuda \
          --heads $heads --engine vllm --backend deepgemm
      done ;;
    demo-backends)  # training side scored by cuDNN and by DeepGEMM, H = 32 and 64; engine
      # DEMO_ENGINE (default vllm; with its model flags, e.g. "sglang-fused --rope-interleaved")
      engine=${DEMO_ENGINE:-vllm}
      for heads in 32 64; do
        for backend in ${DEMO_BACKENDS:-cudnn deepgemm}; do
          TAIL=12 run "demo_$(echo "$engine" | cut -d' ' -f1)_${backend}-h$heads" 300 \
            python -m dsa_precision demo --device cuda --heads $heads --engine $engine \
            --backend $backend
        done
      done ;;
    toy)
      TAIL=12 run toy_2048 900 python examples/toy_glm5_train.py --out "$LOGS/toy_2048.json"
      TAIL=12 run toy_8192 900 python examples/toy_glm5_train.py --seq 8192 --topk 2048 \
        --steps 12 --share-steps 2 --out "$LOGS/toy_8192.json" ;;
    toy3)  # issue 19: three interleaved runs at S = 2048, then one at S = 8192 (baseline, FP8
      # eager and graphed, and the indexer-free bound: the FP8 picks handed in)
      configs=baseline,rope_fp32+fp8,rope_fp32+fp8+graph,replay
      for i in 1 2 3; do
        TAIL=12 run "toy_2048_$i" 300 python examples/toy_glm5_train.py --steps 40 \
          --share-steps 1 --stock-steps 1 --profile-steps 2 --configs $configs \
          --out "$LOGS/toy_2048_$i.json"
      done
      TAIL=12 run toy_8192 300 python examples/toy_glm5_train.py --seq 8192 --topk 2048 \
        --steps 8 --share-steps 1 --stock-steps 1 --profile-steps 1 --host-steps 3 \
        --configs $configs \
        --out "$LOGS/toy_8192.json" ;;
    toy3-auto|toy3-packed)  # issue 33: three interleaved runs at S = 2048 of the FP8 switches
      # alone (dsa_indexer_cuda_graph's default "auto"), always eager and always graphed beside
      # the baseline; toy3-packed on packed THD micro-batches of 4 sequences, then S = 8192
      pack=$([ "$step" = toy3-packed ] && echo "--packed 4 --stock-steps 0" || echo "--stock-steps 1")
      configs=baseline,rope_fp32+fp8,rope_fp32+fp8+eager,rope_fp32+fp8+graph
      for i in 1 2 3; do
        TAIL=10 run "${step}_2048_$i" 300 python examples/toy_glm5_train.py --steps 30 \
          --share-steps 0 --profile-steps 2 --host-steps 3 --configs $configs $pack \
          --out "$LOGS/${step}_2048_$i.json"
      done
      TAIL=10 run "${step}_8192" 300 python examples/toy_glm5_train.py --seq 8192 --topk 2048 \
        --steps 8 --share-steps 0 --profile-steps 1 --host-steps 2 --configs $configs $pack \
        --out "$LOGS/${step}_8192.json" ;;
    toy3-8192)  # issue 33: three runs in a row at S = 8192, top-2048, packed THD and BSHD
      # (TOY_LAYOUTS), the default FP8 step beside the baseline, TOY_STEPS steps each (the median
      # of all but the first three); per run each Python collector mode of TOY_GC ("auto": the
      # automatic one; a number N: --manual-gc N, Megatron's manual collection)
      for i in 1 2 3; do
        for layout in ${TOY_LAYOUTS:-packed bshd}; do
          for gcm in ${TOY_GC:-auto}; do
            pack=$([ $layout = packed ] && echo "--packed 4 --stock-steps 0" || echo "--stock-steps 0")
            gcarg=$([ $gcm = auto ] || echo "--manual-gc $gcm")
            name=toy_8192_${layout}_$i$([ $gcm = auto ] || echo "_gc$gcm")
            TAIL=8 run "$name" 300 python examples/toy_glm5_train.py --seq 8192 --topk 2048 \
              --steps ${TOY_STEPS:-16} --share-steps 0 --profile-steps 1 --host-steps 1 \
              --configs baseline,rope_fp32+fp8 $pack $gcarg --out "$LOGS/$name.json"
          done
        done
      done ;;
    host-profile)  # issue 19: host us of each piece of the owned top-k, the step's phases, the
      # package's host time per layer split by function (S 2048, then 8192)
      TAIL=80 run host_profile_2048 300 python tools/host_profile.py
      TAIL=60 run host_profile_8192 300 python tools/host_profile.py --seq 8192 --topk 2048 ;;
    step-gaps)  # issue 19: the step's phases, and where the device waits for the host (S 2048)
      TAIL=70 run step_gaps 300 python tools/step_phases.py --gaps --steps 10 ;;
    toy-long)  # issue 20: S = 32768 top-2048 with 2 attention heads (Megatron's unfused sparse
      # attention holds B x heads x S x S float32 scores and their softmax per layer: 4 heads ran
      # out of memory on the H200, 16 need 64 GiB each): FP8 beside its picks handed in (no
      # indexer: its share), then Megatron's BF16 baseline (its indexer materialises S x 32 heads
      # x S float32 scores, 128 GiB: out of memory on one H200)
      TAIL=10 run toy_32768_fp8 600 python examples/toy_glm5_train.py --seq 32768 --topk 2048 \
        --attention-heads 2 --steps 4 --share-steps 0 --profile-steps 1 --host-steps 1 \
        --stock-steps 0 --configs rope_fp32+fp8,replay --out "$LOGS/toy_32768_fp8.json"
      TAIL=10 run toy_32768_baseline 300 python examples/toy_glm5_train.py --seq 32768 \
        --topk 2048 --attention-heads 2 --steps 2 --share-steps 0 --profile-steps 1 --host-steps 1 \
        --stock-steps 0 --configs baseline --out "$LOGS/toy_32768_baseline.json" ;;
    toy-long-fused)  # issue 20: S = 32768 top-2048 on Megatron's fused kernels (after `flashmla`):
      # the baseline's cuDNN BF16 indexer and FlashMLA's sparse attention, no S x S scores, so the
      # toy's 16 attention heads fit; FP8 (the package's scoring, FlashMLA's attention) beside it
      # and beside its picks handed in (no indexer: its share)
      TAIL=12 run toy_32768_fused 600 python examples/toy_glm5_train.py --seq 32768 --topk 2048 \
        --kernel-backend cudnn --steps ${TOY_LONG_STEPS:-6} --share-steps 0 --stock-steps 0 \
        --profile-steps 1 --host-steps 1 --top-kernels 12 --configs baseline,rope_fp32+fp8,replay \
        --out "$LOGS/toy_32768_fused.json" ;;
    logprobs)  # issue 32: RL log-prob mismatch of each configuration against the rollout's
      # picks (vLLM's own kernels, layer by layer; after `deepgemm`, the engines' files in
      # DSA_ENGINE_KERNELS), at step 0 and after warm-up steps; S 2048, then 8192
      export DSA_ENGINE_KERNELS=${DSA_ENGINE_KERNELS:-$ENGINE_ROOTS}
      TAIL=30 run logprobs_2048 400 python examples/logprob_mismatch.py --rollout engine-kernels \
        --out "$LOGS/logprobs_2048.json"
      TAIL=30 run logprobs_8192 400 python examples/logprob_mismatch.py --rollout engine-kernels \
        --seq 8192 --topk 2048 --steps ${LOGPROB_STEPS_8192:-10} --out "$LOGS/logprobs_8192.json" ;;
    layer-conformance)  # issue 29: Megatron's DSA layer against the engines' own RoPE code and
      # kernels (after `deepgemm`; the engines' files in DSA_ENGINE_KERNELS, default .engine-kernels;
      # LAYER_ARGS for the tool's flags, e.g. "--profiles sglang-unfused --models v32")
      export DSA_ENGINE_KERNELS=${DSA_ENGINE_KERNELS:-$ENGINE_ROOTS}
      TAIL=20 run layer_conformance 900 python tools/layer_conformance.py \
        --out "$LOGS/layer_conformance" ${LAYER_ARGS:-} ;;
    torch213)  # issue 29: torch 2.13.0 and Triton 3.7.1 (vLLM 0.28.0's pins) from .bigcarry/,
      # installed with --target into $HOME/torch213 (the host's torch stays where it is)
      TAIL=5 run torch213_install 600 bash -c "for w in $TORCH213_WHEELS; do \
        bash .bigcarry/bin/join.sh \$w \$HOME/t213w || exit 1; done && \
        python -m pip install --no-deps --no-index --target \$HOME/torch213 \$HOME/t213w/*.whl && \
        PYTHONPATH=\$HOME/torch213 python -c 'import os, sys; \
        sys.setdlopenflags(os.RTLD_LAZY); import torch, triton; \
        print(torch.__version__, torch.__file__, triton.__version__, torch.cuda.is_available())'" ;;
    layer-legacy)  # issue 29: vllm-legacy's layer cells (after `deepgemm` and `vllm-legacy`):
      # vLLM 0.28.0's key path compiled in a child by the host's torch, then by torch 2.13.0
      # (after `torch213`), both models, use_cpu_initialization both ways
      export DSA_ENGINE_KERNELS=${DSA_ENGINE_KERNELS:-$ENGINE_ROOTS}
      if [ "${LEGACY_HOST:-1}" = 1 ]; then  # LEGACY_HOST=0: torch 2.13's run only
        TAIL=12 run layer_legacy_host 600 python tools/layer_conformance.py \
          --profiles vllm-legacy --out "$LOGS/layer_legacy_host" ${LAYER_ARGS:-}
      fi
      if [ -d "$HOME/torch213/torch" ]; then
        TAIL=12 run layer_legacy_torch213 600 python tools/layer_conformance.py \
          --profiles vllm-legacy --engine-torch "$HOME/torch213" \
          --out "$LOGS/layer_legacy_torch213" ${LAYER_ARGS:-}
      fi ;;
    triton38)  # issue 29: vLLM 0.33's / LMDeploy 0.18's Triton kernels compiled by Triton 3.8
      # (vLLM 0.33's pin) in a child process, beside the host's Triton (after `deepgemm`; the
      # wheel from .bigcarry/, installed with --target so torch keeps the host's triton)
      export DSA_ENGINE_KERNELS=${DSA_ENGINE_KERNELS:-$ENGINE_ROOTS}
      w=triton-3.8.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
      TAIL=5 run triton38_install 600 bash -c "bash .bigcarry/bin/join.sh $w \$HOME/t38w && \
        python -m pip install --no-deps --no-index --target \$HOME/triton38 \$HOME/t38w/$w && \
        PYTHONPATH=\$HOME/triton38 python -c 'import triton; print(triton.__version__, triton.__file__)'"
      for t in 38 host; do  # the same inputs and arguments, the engines' kernels by 3.8, then here
        flag=$([ $t = 38 ] && echo "--engine-triton $HOME/triton38")
        TAIL=12 run "conformance_triton$t" 600 python tools/engine_conformance.py --seq 8192 \
          --models 2 --profiles vllm vllm-eager lmdeploy $flag --out "$LOGS/conformance_triton$t"
      done ;;
    replay)
      TAIL=20 run replay 900 python examples/replay_verify.py --steps 10 \
        --out "$LOGS/replay.json" ;;
    parity)  # two GPUs (nvidia-h200-x2); S = 32768 may report OOM (Megatron's unfused attention)
      TAIL=40 run parity 900 torchrun --nproc-per-node 2 examples/parallel_parity.py \
        --json "$LOGS/parity.json"
      TAIL=20 run replay_parity 600 python -m pytest -m gpu -q -rs -p no:cacheprovider \
        tests/megatron/test_replay_parallel.py
      TAIL=20 run parity_throughput 900 torchrun --nproc-per-node 2 examples/parallel_parity.py \
        --throughput --throughput-seqs ${THROUGHPUT_SEQS:-16384,32768} \
        --json "$LOGS/throughput.json" ;;
    megatron-tests)
      # MEGATRON_LM: the Megatron-LM tests export (tests/megatron_lm/slim.sh makes one small
      # enough to carry)
      TAIL=30 run megatron_tests 900 python tests/megatron_lm/run.py \
        --megatron-lm "${MEGATRON_LM:-.megatron-lm}" --timeout "${MEGATRON_TIMEOUT:-600}" \
        --jobs "${MEGATRON_JOBS:-1}" --out "$LOGS/megatron_tests" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$OUT" logs
