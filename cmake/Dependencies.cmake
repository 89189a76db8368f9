# Every dependency is found the CMake way and exposed as an imported target. A missing
# required one stops configuration and names the Debian package that provides it.
find_package(PkgConfig)

macro(outcore_require found what package)
  if(NOT ${found})
    message(FATAL_ERROR "outcore needs ${what}: install it with `apt-get install ${package}`")
  endif()
endmacro()

outcore_require(PKG_CONFIG_FOUND "pkg-config" "pkg-config")

pkg_check_modules(URING IMPORTED_TARGET liburing)
outcore_require(URING_FOUND "liburing" "liburing-dev")

pkg_check_modules(ISAL IMPORTED_TARGET libisal)
outcore_require(ISAL_FOUND "ISA-L" "libisal-dev")

pkg_check_modules(OPENBLAS IMPORTED_TARGET openblas)
outcore_require(OPENBLAS_FOUND "OpenBLAS" "libopenblas-dev")

# engine/device/cpu: bf16 GEMMs on the CPU's bf16 dot-product units (AVX512_BF16, AMX).
find_package(dnnl CONFIG QUIET)
outcore_require(dnnl_FOUND "oneDNN" "libdnnl-dev")
# oneDNN's threads are OpenMP's (engine/device/cpu/bf16_gemm.cpp sets their number).
find_package(OpenMP REQUIRED COMPONENTS CXX)

# engine/data: the tokenizers' regular expressions, Unicode normalization and SentencePiece.
pkg_check_modules(PCRE2 IMPORTED_TARGET libpcre2-8)
outcore_require(PCRE2_FOUND "PCRE2" "libpcre2-dev")

pkg_check_modules(UTF8PROC IMPORTED_TARGET libutf8proc)
outcore_require(UTF8PROC_FOUND "utf8proc" "libutf8proc-dev")

pkg_check_modules(SENTENCEPIECE IMPORTED_TARGET sentencepiece)
outcore_require(SENTENCEPIECE_FOUND "SentencePiece" "libsentencepiece-dev")

find_package(TBB CONFIG QUIET)
outcore_require(TBB_FOUND "oneTBB" "libtbb-dev")

find_package(nlohmann_json 3.10 CONFIG QUIET)
outcore_require(nlohmann_json_FOUND "nlohmann/json" "nlohmann-json3-dev")

find_package(CLI11 CONFIG QUIET)
outcore_require(CLI11_FOUND "CLI11" "libcli11-dev")

find_package(fmt CONFIG QUIET)
outcore_require(fmt_FOUND "fmt" "libfmt-dev")

find_package(spdlog CONFIG QUIET)
outcore_require(spdlog_FOUND "spdlog" "libspdlog-dev")

find_package(Threads REQUIRED)

if(OUTCORE_BUILD_TESTS)
  find_package(GTest CONFIG QUIET)
  outcore_require(GTest_FOUND "GoogleTest" "libgtest-dev libgmock-dev")
endif()
if(OUTCORE_BUILD_BENCH)
  find_package(benchmark CONFIG QUIET)
  outcore_require(benchmark_FOUND "Google Benchmark" "libbenchmark-dev")
endif()

# Optional: CUDA and NCCL. Device code for sm_80 (A100) and sm_90 (H100/H200), plus sm_90 PTX
# that newer GPUs compile at load time.
set(OUTCORE_HAVE_CUDA OFF)
set(OUTCORE_HAVE_NCCL OFF)
if(OUTCORE_WITH_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES 80-real 90)
    set(CMAKE_CUDA_STANDARD 20)
    # CMake 3.25 has no nvcc flag for CUDA_STANDARD 20; name it (CMake also passes
    # -forward-unknown-to-host-compiler, so the project's host flags reach g++).
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(OUTCORE_HAVE_CUDA ON)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
    if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY)
      add_library(outcore_nccl_imported UNKNOWN IMPORTED)
      set_target_properties(outcore_nccl_imported PROPERTIES
        IMPORTED_LOCATION ${NCCL_LIBRARY} INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
      add_library(NCCL::nccl ALIAS outcore_nccl_imported)
      set(OUTCORE_HAVE_NCCL ON)
    endif()
  endif()
endif()

# Optional: OpenMPI for multi-process ranks.
set(OUTCORE_HAVE_MPI OFF)
if(OUTCORE_WITH_MPI)
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    set(OUTCORE_HAVE_MPI ON)
  endif()
endif()
