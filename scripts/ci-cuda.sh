#!/usr/bin/env bash
# CI for the GPU path (issue 9), on a machine without a GPU: the `nccl` and `cuda` features
# build and lint at the workspace level (cudarc loads libcuda/libnccl/libcublas at run time,
# so no CUDA toolkit is needed), their no-GPU tests check that asking for a device returns a
# typed `Unavailable` error instead of a panic, and the crate's CUDA C kernels really compile
# through NVRTC for sm_80 and sm_90, with CUDA 12.9's (pip's `nvidia-cuda-nvrtc-cu12`) and
# CUDA 13.0's (pip's `nvidia-cuda-nvrtc`), each wheel unpacked under the target folder. The
# `bench-nccl` sweep (hypershard-benches, feature `nccl`) is linted.
# HYPERSHARD_TEST_GPU stays unset: the device tests run on a GPU machine through
# `cargo xtask gpu-check`.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"

cargo clippy --workspace --all-targets --features nccl,cuda --locked -- -D warnings

# One invocation: the lib's nccl:: unit tests and tests/nccl_gpu (its own main ignores the filter).
cargo test -p hypershard-collectives --features nccl --locked --lib --test nccl_gpu -- nccl::

nvrtc="$target/ci-nvrtc"
if ! ls "$nvrtc"/nvidia/cuda_nvrtc/lib/libnvrtc.so* >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --disable-pip-version-check --target "$nvrtc" \
        "nvidia-cuda-nvrtc-cu12==12.9.*"
fi
# HYPERSHARD_TEST_NVRTC=1: a libnvrtc that cannot be loaded is a failure here, not a note.
LD_LIBRARY_PATH="$(cd "$nvrtc/nvidia/cuda_nvrtc/lib" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
HYPERSHARD_TEST_NVRTC=1 \
    cargo test -p hypershard-tensor --features cuda --locked --lib --test cuda -- cuda::
# CUDA 13 (the lent H200's driver 580 and nvcc 13.0): the same kernels through pip's NVRTC
# 13.0 (`nvidia-cuda-nvrtc`, the cu13 layout `nvidia/cu13/lib`), exposed the way
# `cargo xtask gpu-check` exposes it. CUDA 13 ships only `libnvrtc.so.13`, a name cudarc 0.19
# (built with its cuda-12080 bindings) does not try, so a `libnvrtc.so` link in a folder of its
# own goes first on LD_LIBRARY_PATH. First every NVRTC function the tensor crate and cudarc's
# `result` layer call must be exported by it (cudarc looks each up by name at its first call
# and panics when one is missing), then kernels_compile must build PTX and CUBIN for sm_80 and
# sm_90 through it. The wheel and the link are cached under the target folder, and the test
# binary is the one built above (no rebuild).
nvrtc13="$target/ci-nvrtc13"
if ! ls "$nvrtc13"/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --disable-pip-version-check --target "$nvrtc13" \
        "nvidia-cuda-nvrtc==13.0.*"
fi
nvrtc13_lib="$(cd "$nvrtc13/nvidia/cu13/lib" && pwd)"
nvrtc13_links="$target/ci-nvrtc13-links"
mkdir -p "$nvrtc13_links"
ln -sfn "$nvrtc13_lib/libnvrtc.so.13" "$nvrtc13_links/libnvrtc.so"
python3 - "$nvrtc13_links/libnvrtc.so" <<'PY'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
calls = ["nvrtcVersion", "nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetPTXSize",
         "nvrtcGetPTX", "nvrtcGetCUBINSize", "nvrtcGetCUBIN", "nvrtcGetProgramLogSize",
         "nvrtcGetProgramLog", "nvrtcDestroyProgram"]
missing = [c for c in calls if not hasattr(lib, c)]
if missing:
    sys.exit(f"ci-cuda: NVRTC 13 lacks {missing}")
major, minor = ctypes.c_int(), ctypes.c_int()
lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
print(f"ci-cuda: NVRTC {major.value}.{minor.value} through {sys.argv[1]} exports all {len(calls)} calls")
PY
LD_LIBRARY_PATH="$(cd "$nvrtc13_links" && pwd):$nvrtc13_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
HYPERSHARD_TEST_NVRTC=1 \
    cargo test -p hypershard-tensor --features cuda --locked --test cuda
# nn on CUDA tensors: tests/cuda_devices (its bodies on the host and the emulated device; a
# typed error, no panic, for a GPU that is not there).
cargo test -p hypershard-nn --features cuda --locked --test cuda_devices
# The layer kernels' arithmetic and block synchronisation, emulated on the host: the layer
# section of kernels.cu compiled as C++ (g++ -std=c++20), checked against host references, then
# again under ThreadSanitizer (about two minutes on 2 cores).
if ! command -v g++ >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++
fi
bash crates/tensor/tests/cuda_emulate/run.sh
# bench-nccl (hypershard-benches, feature `nccl`) is linted by the workspace clippy above. Its
# unit tests are not run here: with the feature, collectives and every crate above it in the
# benches' tree recompile (about a minute); its sweep logic is tested in the benches' lib.
echo "ci-cuda: ok"
