#!/usr/bin/env bash
# Host emulation of the GPT kernels of src/cuda/kernels.cu, for machines without a GPU.
#
# The GPT section of the CUDA C is compiled as C++ (g++, no FMA contraction) against
# prelude.h, which runs one OS thread per CUDA thread, one block at a time, with __syncthreads
# as a std::barrier; main.cpp checks every GPT kernel against a host reference (the GELUs,
# SiLU and dropout bit for bit against the Rust CPU's, dumped by nn's `pointwise_reference`
# example), with grids smaller than the work so the grid-stride and row loops run. Then the same checks run under
# ThreadSanitizer, which fails on any race on the shared memory of the block reductions.
# This checks the kernels' arithmetic and synchronisation, not the GPU itself.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The layer section starts at its heading comment; a renamed heading must fail here, not
# leave the emulation with nothing to compile.
awk '/^\/\/ The CUDA side of hypershard-nn.s layers/ { p = 1 } p' \
    "$root/crates/tensor/src/cuda/kernels.cu" > "$work/gpt_kernels.inc"
test -s "$work/gpt_kernels.inc" || {
    echo "cuda_emulate: no layer section heading in kernels.cu" >&2
    exit 1
}
(cd "$root" && cargo run --quiet --locked -p hypershard-nn --example pointwise_reference -- "$work/pointwise.bin")
cp "$here/prelude.h" "$here/main.cpp" "$work/"
flags=(-std=c++20 -O1 -ffp-contract=off -fno-fast-math -pthread)
g++ "${flags[@]}" -o "$work/emulate" "$work/main.cpp"
(cd "$work" && ./emulate)
g++ "${flags[@]}" -g -fsanitize=thread -o "$work/emulate-tsan" "$work/main.cpp"
(cd "$work" && TSAN_OPTIONS="halt_on_error=1 exitcode=66" ./emulate-tsan > tsan.log 2>&1) || {
    cat "$work/tsan.log"
    echo "cuda_emulate: FAILED under ThreadSanitizer" >&2
    exit 1
}
echo "cuda_emulate: ok (and no data race under ThreadSanitizer)"
