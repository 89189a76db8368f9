#!/usr/bin/env bash
# outcore developer entry point. On a fresh Debian 12 machine (as root, or with sudo):
#   ./dev.sh demo   install what is missing, build (Release), run the training demo
#   ./dev.sh test   install what is missing, build (Release), run the whole test suite
#   ./dev.sh build  install and build only
#   ./dev.sh gpu    on a machine with a GPU: doctor, the GPU tests, the demo and benchmarks on it
#   ./dev.sh gpu-check  the same verdicts on a tree already built (no install, no build)
#   ./dev.sh gpu-large  on a built tree with a GPU: a 5.2B model larger than a 24 GB device budget,
#                   at the tokens per step outcore estimate recommends there, with a trace
#                   (about 60 GiB of swap under OUTCORE_SWAP_DIR, default $BUILD_DIR/gpu_large)
set -euo pipefail
cd "$(dirname "$0")"

BUILD_DIR=${OUTCORE_BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

PACKAGES=(
  build-essential cmake pkg-config git
  liburing-dev libtbb-dev libisal-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev
  libcli11-dev libspdlog-dev libfmt-dev
  libopenmpi-dev openmpi-bin
  fio python3 python3-torch python3-numpy python3-dev pybind11-dev
  libpcre2-dev libutf8proc-dev libsentencepiece-dev python3-sentencepiece
)

install_deps() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
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

# build [TARGET...]: configure, then build the targets named (default: everything).
build() {
  echo "==> configuring and building (Release) in ${BUILD_DIR}/"
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release
  local targets=()
  for t in "$@"; do targets+=(--target "$t"); done
  cmake --build "$BUILD_DIR" -j "$JOBS" "${targets[@]}"
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

# Every GPU verdict in one run (under 8 minutes on one H100 with 16 cores): the machine check,
# the GPU tests, the demo on the GPU, and the GPU benchmarks with their ratios. Each part is
# bounded by a timeout; the exit status is 1 when any part failed.
run_gpu() {
  local rc=0 out="$BUILD_DIR/gpu_check"
  mkdir -p "$out"
  echo "==> outcore doctor"
  timeout 120 "$BUILD_DIR/bin/outcore" doctor --nvme-path "$out" || rc=1
  echo "==> ctest -L gpu"
  OUTCORE_REQUIRE_ORACLES=1 timeout 240 ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure || rc=1
  echo "==> the demo on the GPU"
  timeout 180 "$BUILD_DIR/bin/outcore" demo --device cuda --work-dir "$out/demo" || rc=1
  echo "==> zero_bench on the GPU (NVMe-streamed stage 3 against everything in GPU memory)"
  timeout 180 "$BUILD_DIR/bench/zero/zero_bench" --device cuda --steps 4 --nvme "$out" || rc=1
  echo "==> the same with the gathered parameters kept on the GPU through each step"
  timeout 180 "$BUILD_DIR/bench/zero/zero_bench" --device cuda --steps 4 --keep-params \
    --nvme "$out" || rc=1
  echo "==> model_bench on the GPU: one Llama 3 8B layer in bf16 compute against the bf16 GEMM peak,"
  echo "    and where one step's time goes per operation"
  timeout 120 "$BUILD_DIR/bench/model/model_bench" --device cuda --compute bf16 --hidden 4096 \
    --intermediate 14336 --heads 32 --kv-heads 8 --layers 1 --vocab 256 --seq 4096 --batch 1 \
    --steps 3 --profile || rc=1
  echo "==> the same layer at 16384 tokens (the fused attention's share and TFLOP/s at length)"
  timeout 120 "$BUILD_DIR/bench/model/model_bench" --device cuda --compute bf16 --hidden 4096 \
    --intermediate 14336 --heads 32 --kv-heads 8 --layers 1 --vocab 256 --seq 16384 --batch 1 \
    --steps 2 --profile || rc=1
  echo "==> the same layer with Llama 3's 128256-token head (the head's GEMMs and cross-entropy)"
  timeout 120 "$BUILD_DIR/bench/model/model_bench" --device cuda --compute bf16 --hidden 4096 \
    --intermediate 14336 --heads 32 --kv-heads 8 --layers 1 --vocab 128256 --seq 4096 --batch 1 \
    --steps 2 --profile || rc=1
  echo "==> zero_large_bench on the GPU: ZeRO-3 streamed from NVMe under a 1000 MiB device budget,"
  echo "    4 micro-batches per step, against the compute, PCIe and drive bounds of the same run"
  timeout 180 "$BUILD_DIR/bench/zero/zero_large_bench" --device cuda --device-mb 1000 --hidden 1024 \
    --intermediate 2816 --layers 8 --heads 16 --kv-heads 4 --vocab 32000 --seq 1024 --micro 1 \
    --gas 4 --grads host --steps 3 --ref-gib 2 --nvme "$out/zero_large" || rc=1
  echo "==> the same with the gathered parameters kept on the GPU through each step's micro-batches"
  timeout 180 "$BUILD_DIR/bench/zero/zero_large_bench" --device cuda --device-mb 1000 --hidden 1024 \
    --intermediate 2816 --layers 8 --heads 16 --kv-heads 4 --vocab 32000 --seq 1024 --micro 1 \
    --gas 4 --grads host --steps 3 --ref-gib 2 --keep-params --nvme "$out/zero_large" || rc=1
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

run_demo() {
  "$BUILD_DIR/bin/outcore" demo --work-dir "$BUILD_DIR/demo"
}

case "${1:-}" in
  demo) install_deps; build outcore; run_demo ;;  # only what the demo runs: no tests, no benchmarks
  test) install_deps; install_node_oracle; build; run_tests ;;
  build) install_deps; install_node_oracle; build ;;
  gpu) install_deps; install_node_oracle; build; run_gpu ;;
  gpu-check) run_gpu ;;
  gpu-large) run_gpu_large ;;
  *) echo "usage: $0 demo|test|build|gpu|gpu-check|gpu-large" >&2; exit 2 ;;
esac
