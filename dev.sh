#!/usr/bin/env bash
# outcore developer entry point. On a fresh Debian 12 machine (as root, or with sudo):
#   ./dev.sh demo   install what is missing, build (Release), run the training demo
#   ./dev.sh test   install what is missing, build (Release), run the whole test suite
#   ./dev.sh build  install and build only
#   ./dev.sh gpu    on a machine with a GPU: doctor, the GPU tests, the demo and benchmarks on it
#   ./dev.sh gpu-check  the same verdicts on a tree already built (no install, no build)
#   ./dev.sh gpu-pack   on a built tree: the GPU verdicts' programs and libraries in one archive
#   ./dev.sh gpu-unpack ARCHIVE [check|profile|large]  on a GPU machine without the build's
#                   packages: ./dev.sh gpu-check (or gpu-profile, gpu-large) on that archive's programs
#   ./dev.sh gpu-profile  on a built tree with a GPU: Nsight Compute on the fused attention's
#                   kernels at Llama 3 8B's shape (occupancy, throughput, stalls), one summary
#   ./dev.sh gpu-large  on a built tree with a GPU: a 5.2B model larger than a 24 GB device budget,
#                   at the tokens per step outcore estimate recommends there, with a trace
#                   (about 60 GiB of swap under OUTCORE_SWAP_DIR, default $BUILD_DIR/gpu_large)
set -euo pipefail
cd "$(dirname "$0")"

BUILD_DIR=${OUTCORE_BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

# What the outcore binary builds from (the demo installs only these). python3-dev and
# pybind11-dev are here although only the Python module uses them: with them found, the
# libraries are compiled position-independent, so a later full build reuses the demo's objects.
# ocl-icd-opencl-dev: Debian's oneDNN is built with OpenCL, and its CMake package requires
# OpenCL's headers and library (a recommendation of libdnnl-dev, which installs skip).
BUILD_PACKAGES=(
  build-essential cmake pkg-config git
  liburing-dev libtbb-dev libisal-dev nlohmann-json3-dev
  libopenblas-dev libdnnl-dev ocl-icd-opencl-dev
  libcli11-dev libspdlog-dev libfmt-dev
  libopenmpi-dev openmpi-bin
  python3 python3-dev pybind11-dev
  libpcre2-dev libutf8proc-dev libsentencepiece-dev
)
# What the tests, the benchmarks and their references need besides (PyTorch is the largest:
# about a third of the download).
TEST_PACKAGES=(
  libgtest-dev libgmock-dev libbenchmark-dev
  fio python3-torch python3-numpy python3-sentencepiece
)

# install_deps [PACKAGE...]: installs those of the packages (default: all of the above) that are
# missing.
install_deps() {
  local wanted=("$@") missing=()
  if ((${#wanted[@]} == 0)); then wanted=("${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}"); fi
  for p in "${wanted[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$p")
    fi
  done
  if ((${#missing[@]} == 0)); then
    return
  fi
  echo "==> installing Debian packages: ${missing[*]}"
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# The tokenizer tests' reference: Hugging Face tokenizers under Node (tests/data/oracle). Node
# from Debian only when no node is installed; `npm ci` only when node_modules is missing or
# older than package-lock.json.
install_node_oracle() {
  if ! command -v node > /dev/null; then
    echo "==> installing Debian packages: nodejs npm"
    local sudo=""
    if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends nodejs npm
  fi
  local oracle=tests/data/oracle
  if [[ ! -f $oracle/node_modules/.package-lock.json ||
        $oracle/package-lock.json -nt $oracle/node_modules/.package-lock.json ]]; then
    echo "==> npm ci in $oracle"
    (cd "$oracle" && npm ci --no-audit --no-fund --loglevel=error > /dev/null)
  fi
}

# build: configure with the tests, benchmarks and examples, and build everything.
build() {
  echo "==> configuring and building (Release) in ${BUILD_DIR}/"
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DOUTCORE_BUILD_TESTS=ON \
    -DOUTCORE_BUILD_BENCH=ON -DOUTCORE_BUILD_EXAMPLES=ON
  cmake --build "$BUILD_DIR" -j "$JOBS"
}

# build_demo: the outcore binary alone, configured without the tests, benchmarks and examples
# (whose packages the demo does not install). The same objects serve a later `build`.
build_demo() {
  echo "==> configuring and building the outcore binary (Release) in ${BUILD_DIR}/"
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DOUTCORE_BUILD_TESTS=OFF \
    -DOUTCORE_BUILD_BENCH=OFF -DOUTCORE_BUILD_EXAMPLES=OFF
  cmake --build "$BUILD_DIR" -j "$JOBS" --target outcore
}

# The oracles (PyTorch references run by /usr/bin/python3) are installed above, so a test
# that cannot run its oracle fails here instead of skipping (tests/common/oracle_unavailable.hpp).
# Other skips (hardware, kernel features) stay skips and are counted after the run.
run_tests() {
  echo "==> running the test suite (OUTCORE_REQUIRE_ORACLES=1)"
  export OUTCORE_REQUIRE_ORACLES=1
  local log="$BUILD_DIR/ctest.log" rc=0 skipped
  ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$JOBS" 2>&1 | tee "$log" || rc=$?
  skipped=$(grep -cE '^[[:space:]]+[0-9]+ - .* \(Skipped\)$' "$log" || true)
  echo "==> ${skipped} tests skipped (listed above under \"The following tests did not run\")"
  return "$rc"
}

# part NAME SECONDS CMD...: one part of the GPU verdict. CMD runs under a timeout, its output
# shown and kept in $GPU_OUT/NAME.log; NAME's verdict is kept for the summary. With
# GPU_DEADLINE set (seconds since the epoch), the timeout is cut to what is left before it, and a
# part with under 20 s left is not started (its verdict says so): the parts run in their order of
# importance, and the whole verdict keeps its time limit whatever each part takes.
GPU_PARTS=()
GPU_DEADLINE=""
part() {
  local name=$1 secs=$2 rc verdict left
  shift 2
  if [[ -n $GPU_DEADLINE ]]; then
    left=$((GPU_DEADLINE - $(date +%s)))
    if ((left < 20)); then
      echo "==> ${name}: not run (the time limit of the verdicts is spent)"
      : > "$GPU_OUT/$name.log"
      GPU_PARTS+=("${name}|NOT RUN: the time limit was spent (run it alone)")
      return 1
    fi
    ((secs > left)) && secs=$left
  fi
  echo "==> ${name}"
  set +e
  timeout "$secs" "$@" 2>&1 | tee "$GPU_OUT/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  case $rc in
    0) verdict="ok" ;;
    124) verdict="TIMED OUT after ${secs} s" ;;
    *) verdict="FAILED (exit ${rc})" ;;
  esac
  GPU_PARTS+=("${name}|${verdict}")
  [[ $rc -eq 0 ]]
}

# The summary of the parts run: each verdict, with the lines of its log that carry the figures
# (the GPU, the rates, every failed test, every ratio against its reference).
gpu_summary() {
  local entry name verdict pattern
  echo
  echo "==> summary"
  for entry in "${GPU_PARTS[@]}"; do
    name=${entry%%|*}
    verdict=${entry#*|}
    printf '%-28s %s\n' "$name" "$verdict"
    [[ $verdict == "NOT RUN"* ]] && continue
    case $name in
      doctor) pattern='^(gpu |gemm bf16 TFLOPS|attention bf16 TFLOPS|pinned copies|verdict)' ;;
      gpu-tests*)
        pattern='tests passed|\((Failed|Timeout|SEGFAULT|Subprocess aborted)\)|Not Run'
        echo "    $(grep -cE '\(Skipped\)$' "$GPU_OUT/$name.log" || true) skipped (a GPU runs them all)"
        ;;
      demo*) pattern='^(trained|stopped after|loss )' ;;
      zero_bench*) pattern='^(shape |model:|tokens/s ratio|losses bit-identical|drive.s time)' ;;
      model_bench*) pattern='ratio model/peak|^head \(|attention' ;;
      attention_bench*) pattern='^(attention seq|reference seq|seq |cuda)' ;;
      attention-ncu)
        pattern='tiles_|Duration|Compute \(SM\) Throughput|Memory Throughput|Occupancy  |Registers Per Thread|Warp Cycles Per Issued|Issue Slots Busy|Block Limit|Bank'
        ;;
      zero_large_bench*)
        pattern='^(step / max|planned compute|model TFLOP/s|summary over|engine CPU threads)'
        ;;
      *) pattern='^$^' ;;
    esac
    grep -E "$pattern" "$GPU_OUT/$name.log" | sed 's/^/    /' || true
    if [[ $verdict != ok ]]; then tail -n 1 "$GPU_OUT/$name.log" | sed 's/^/    /'; fi
  done
}

# Every GPU verdict in one run: the machine check, the GPU tests, the demo on the GPU, and the
# GPU benchmarks with their ratios, then one summary. Each part is bounded by a timeout and the
# whole by OUTCORE_GPU_CHECK_SECONDS (default 450: with the summary, under 8 minutes); parts
# left when it is spent are listed as not run. The exit status is 1 when any part failed or did
# not run.
run_gpu() {
  local rc=0 out="$BUILD_DIR/gpu_check"
  GPU_OUT="$out"
  GPU_DEADLINE=$(($(date +%s) + ${OUTCORE_GPU_CHECK_SECONDS:-450}))
  mkdir -p "$out"
  local layer_shape=(--device cuda --compute bf16 --hidden 4096 --intermediate 14336 --heads 32
    --kv-heads 8 --layers 1 --profile)
  local layer=("${layer_shape[@]}" --batch 1)
  local large=(--device cuda --device-mb 1000 --hidden 1024 --intermediate 2816 --layers 8
    --heads 16 --kv-heads 4 --vocab 32000 --seq 1024 --micro 1 --gas 4 --grads host --steps 3
    --ref-gib 2 --nvme "$out/zero_large")
  # In order of importance: correctness first, then each goal's figure once, then the variants.
  part doctor 120 "$BUILD_DIR/bin/outcore" doctor --nvme-path "$out" || rc=1
  # ctest -L gpu: every CUDA test against the CPU reference; the same binaries' cases on the
  # host and the simulated devices (48 of them) run in every `./dev.sh test`, not on the lease
  part gpu-tests 360 env OUTCORE_REQUIRE_ORACLES=1 ctest --test-dir "$BUILD_DIR" -L gpu \
    -E '/(simulated_discrete|cpu)' --output-on-failure || rc=1
  part demo 180 "$BUILD_DIR/bin/outcore" demo --device cuda --work-dir "$out/demo" || rc=1
  # and in bf16 compute: the GEMMs on the tensor cores, the fused attention in training
  part demo-bf16 180 "$BUILD_DIR/bin/outcore" demo --device cuda --bf16 \
    --work-dir "$out/demo-bf16" || rc=1
  # One Llama 3 8B layer in bf16 compute against the bf16 GEMM peak, where one step's time goes
  # per operation, and the head alone (4096 tokens)
  part model_bench-4096 120 "$BUILD_DIR/bench/model/model_bench" "${layer[@]}" --vocab 256 \
    --seq 4096 --steps 3 || rc=1
  # The fused attention alone at 4096 and 16384 tokens: forward and backward against the bf16
  # GEMM peak, and PyTorch's attention backends (FlashAttention-2, cuDNN) timed at the same
  # shapes where the machine's python3 has PyTorch
  part attention_bench 150 "$BUILD_DIR/bench/model/attention_bench" --device cuda \
    --seq 4096,16384 --reference "python3 bench/python/attention_reference.py" || rc=1
  # The layer with Llama 3's 128256-token head
  part model_bench-vocab128256 120 "$BUILD_DIR/bench/model/model_bench" "${layer[@]}" \
    --vocab 128256 --seq 4096 --steps 2 || rc=1
  # NVMe-streamed stage 3 against everything in GPU memory, the gathered parameters kept on the
  # GPU through each step, at the tokens per step `outcore estimate` recommends for it (the
  # transfers under the GPU's compute): the shape where the issue's 0.97 can be judged
  part zero_bench-recommended 180 "$BUILD_DIR/bench/zero/zero_bench" --device cuda --steps 4 \
    --keep-params --recommended-shape --nvme "$out" || rc=1
  # ZeRO-3 streamed from NVMe under a 1000 MiB device budget, 4 micro-batches per step, the
  # gathered parameters kept, against the compute, PCIe and drive bounds of the same run
  part zero_large_bench-keep-params 180 "$BUILD_DIR/bench/zero/zero_large_bench" "${large[@]}" \
    --keep-params || rc=1
  # The same with CPU Adam on half the hardware threads (offload_optimizer.cpuadam_cores_perc
  # 0.5; the data path keeps its own pool over all of them, decision 038): against the run
  # above, the measurement that sets the key's default
  part zero_large_bench-keep-params-adam-half 180 "$BUILD_DIR/bench/zero/zero_large_bench" \
    "${large[@]}" --keep-params --cpuadam-cores-perc 0.5 || rc=1
  # The same with the NVMe optimizer step during the backward (outcore.step_in_backward): CPU
  # Adam and the optimizer's I/O under the GPU's backward
  part zero_large_bench-keep-params-in-backward 180 "$BUILD_DIR/bench/zero/zero_large_bench" \
    "${large[@]}" --keep-params --step-in-backward || rc=1
  # The same with the last unit's optimizer state (offload_optimizer.ratio 0.9: the head's) on the
  # GPU and stepped there by Adam on the device (decision 036)
  part zero_large_bench-keep-params-ratio-0.9 180 "$BUILD_DIR/bench/zero/zero_large_bench" \
    "${large[@]}" --keep-params --offload-ratio 0.9 || rc=1
  # The layer at 16384 and 32768 tokens (the longest sequence the issue asks for on one GPU),
  # and at micro-batch 4
  part model_bench-16384 120 "$BUILD_DIR/bench/model/model_bench" "${layer[@]}" --vocab 256 \
    --seq 16384 --steps 2 || rc=1
  part model_bench-32768 150 "$BUILD_DIR/bench/model/model_bench" "${layer[@]}" --vocab 256 \
    --seq 32768 --steps 2 || rc=1
  part model_bench-4096-batch4 120 "$BUILD_DIR/bench/model/model_bench" "${layer_shape[@]}" \
    --batch 4 --vocab 256 --seq 4096 --steps 2 || rc=1
  # zero_bench at its default 2048 tokens per step, with and without the gathered parameters
  # kept; zero_large_bench without them
  part zero_bench 180 "$BUILD_DIR/bench/zero/zero_bench" --device cuda --steps 4 \
    --nvme "$out" || rc=1
  part zero_bench-keep-params 180 "$BUILD_DIR/bench/zero/zero_bench" --device cuda --steps 4 \
    --keep-params --nvme "$out" || rc=1
  part zero_large_bench 180 "$BUILD_DIR/bench/zero/zero_large_bench" "${large[@]}" || rc=1
  # The layer and the head with a 32 MiB cuBLASLt workspace (decision 032): each against the
  # defaults above
  part model_bench-4096-ws32 120 env OUTCORE_CUBLASLT_WORKSPACE_MB=32 \
    "$BUILD_DIR/bench/model/model_bench" "${layer[@]}" --vocab 256 --seq 4096 --steps 3 || rc=1
  part model_bench-vocab128256-ws32 120 env OUTCORE_CUBLASLT_WORKSPACE_MB=32 \
    "$BUILD_DIR/bench/model/model_bench" "${layer[@]}" --vocab 128256 --seq 4096 --steps 2 || rc=1
  gpu_summary
  return "$rc"
}

# Nsight Compute (ncu, where the machine has it) on the fused attention's kernels at Llama 3 8B's
# shape, 4096 tokens: the first five launches of attention_bench (three forwards, then the
# backward's dq and dkv), each with its throughput, occupancy, launch limits and warp stalls;
# the whole report in $BUILD_DIR/gpu_check/attention-ncu.log.
run_gpu_profile() {
  local out="$BUILD_DIR/gpu_check" ncu
  GPU_OUT="$out"
  mkdir -p "$out"
  ncu=$(command -v ncu || find /usr/local/cuda/bin /opt/nvidia -name ncu -type f 2>/dev/null |
    head -n 1 || true)
  if [[ -z $ncu ]]; then
    echo "gpu-profile: no ncu (Nsight Compute) on this machine" >&2
    return 1
  fi
  local rc=0
  part attention-ncu 240 "$ncu" --clock-control none -k regex:tiles_ -c 5 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    "$BUILD_DIR/bench/model/attention_bench" --device cuda --seq 4096 --reps 1 || rc=1
  gpu_summary
  return "$rc"
}

# The issue's large run: ZeRO-3, bf16 compute and moments, parameters and optimizer state in swap
# files, gradient sums in host memory, the gathered parameters kept through each step, at the
# shape zero::choose_shape picks from the rates measured first; step time against the compute,
# PCIe and drive bounds of the same run; the trace of its steps for tools/trace_svg.py.
run_gpu_large() {
  local out=${OUTCORE_SWAP_DIR:-$BUILD_DIR/gpu_large}
  mkdir -p "$out"
  timeout 540 "$BUILD_DIR/bench/zero/zero_large_bench" --device cuda --device-mb 24000 \
    --hidden 4096 --intermediate 11008 --layers 28 --heads 32 --kv-heads 8 --vocab 24000 \
    --seq 2048 --grads host --bf16-moments --keep-params --recommended-shape --steps 1 \
    --ref-gib 2 --compute-reps 1 --trace "$out/large_trace.json" --nvme "$out/swap"
}

# The GPU verdicts' programs (outcore, the benchmarks, the GPU tests), every ctest file and the
# shared libraries they load from outside glibc, libstdc++ and CUDA, in one archive: for a GPU
# machine that has CUDA but not the build's packages. gpu-unpack, in a checkout of the same tree
# there, puts them back (linking the path the tree was built at to that checkout when they
# differ, since ctest and the tests name it) and runs the verdicts.
GPU_PROGRAMS=(bin/outcore bench/zero/zero_bench bench/zero/zero_large_bench bench/model/model_bench
  bench/model/attention_bench
  tests/device/test_cuda_device tests/device/test_backend_conformance
  tests/device/test_cuda_kernels tests/trainer/test_trainer_gpu tests/zero/test_zero_gpu
  tests/comm/test_comm_nccl tests/dp/test_dp_gpu tests/dp/dp_worker)
gpu_pack() {
  local staged p
  staged=$(mktemp -d)
  mkdir -p "$staged/$BUILD_DIR/gpu_libs"
  for p in "${GPU_PROGRAMS[@]}"; do
    mkdir -p "$staged/$BUILD_DIR/$(dirname "$p")"
    strip -o "$staged/$BUILD_DIR/$p" "$BUILD_DIR/$p"
    ldd "$BUILD_DIR/$p" | awk '/=> \//{print $3}'
  done | sort -u |
    grep -vE '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libstdc\+\+|libgcc_s)\.so|/cuda' |
    xargs -r cp -L -t "$staged/$BUILD_DIR/gpu_libs"
  (cd "$BUILD_DIR" && find . -name CTestTestfile.cmake -o -name '*_tests.cmake' -o \
    -name '*_include.cmake') | (cd "$BUILD_DIR" && tar cf - -T -) | tar xf - -C "$staged/$BUILD_DIR"
  pwd > "$staged/$BUILD_DIR/gpu_source_dir"
  tar cJf "$BUILD_DIR/gpu_pack.tar.xz" -C "$staged" .
  rm -rf "$staged"
  echo "==> $BUILD_DIR/gpu_pack.tar.xz ($(du -h "$BUILD_DIR/gpu_pack.tar.xz" | cut -f1)):" \
    "./dev.sh gpu-unpack ARCHIVE [check|profile|large] in a checkout of this tree on the GPU machine"
}
gpu_unpack() {
  local archive=${1:?usage: ./dev.sh gpu-unpack ARCHIVE [check|profile|large]} verb=${2:-check}
  local built
  tar xJf "$archive"
  built=$(cat "$BUILD_DIR/gpu_source_dir")
  if [[ $built != "$PWD" && ! -e $built ]]; then
    mkdir -p "$(dirname "$built")"
    ln -s "$PWD" "$built"
  fi
  export LD_LIBRARY_PATH=$PWD/$BUILD_DIR/gpu_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  case $verb in
    check) run_gpu ;;
    profile) run_gpu_profile ;;
    large) run_gpu_large ;;
    *) echo "gpu-unpack: $verb: check, profile or large" >&2; return 2 ;;
  esac
}

run_demo() {
  "$BUILD_DIR/bin/outcore" demo --work-dir "$BUILD_DIR/demo"
}

case "${1:-}" in
  demo) install_deps "${BUILD_PACKAGES[@]}"; build_demo; run_demo ;;  # only what the demo runs
  test) install_deps; install_node_oracle; build; run_tests ;;
  build) install_deps; install_node_oracle; build ;;
  gpu) install_deps; install_node_oracle; build; run_gpu ;;
  gpu-check) run_gpu ;;
  gpu-large) run_gpu_large ;;
  gpu-profile) run_gpu_profile ;;
  gpu-pack) gpu_pack ;;
  gpu-unpack) shift; gpu_unpack "$@" ;;
  *)
    echo "usage: $0 demo|test|build|gpu|gpu-check|gpu-large|gpu-profile|gpu-pack|gpu-unpack" \
      "ARCHIVE [check|profile|large]" >&2
    exit 2
    ;;
esac
