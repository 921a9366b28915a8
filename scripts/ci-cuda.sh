#!/usr/bin/env bash
# CI for the GPU path (issue 9), on a machine without a GPU: the `nccl` and `cuda` features
# build and lint at the workspace level (cudarc loads libcuda/libnccl/libcublas at run time,
# so no CUDA toolkit is needed), their no-GPU tests check that asking for a device returns a
# typed `Unavailable` error instead of a panic, and the crate's CUDA C kernels really compile
# through NVRTC (pip's `nvidia-cuda-nvrtc-cu12` wheel, unpacked under the target folder) for
# sm_80 and sm_90. HYPERSHARD_TEST_GPU stays unset: the device tests run on a GPU machine
# through `cargo xtask gpu-check`.
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
# nn's device layers: the cuda:: unit tests and tests/cuda_mlp (Unavailable without a GPU, no panic).
cargo test -p hypershard-nn --features cuda --locked --lib --test cuda_mlp -- cuda::
echo "ci-cuda: ok"
