#!/usr/bin/env bash
# The MPI backend in CI: installs Open MPI and libclang (idempotent), lints the
# `mpi` feature, runs its unit tests, and runs the whole conformance suite under
# `mpirun -np 2` and `-np 3` (tests/mpi_conformance.rs; each rank exits non-zero on failure).
# About 35 s of test time on 2 cores beyond the build.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || need+=(libopenmpi-dev)
# bindgen needs libclang itself; libclang-cpp (a C++ API some packages pull in) does not do.
ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi

cargo clippy -p hypershard-collectives --all-targets --features mpi --locked -- -D warnings
cargo test -p hypershard-collectives --features mpi --locked --lib -- mpi:: env::
cargo build -p hypershard-collectives --features mpi --locked --tests
binary=$(cargo test -p hypershard-collectives --features mpi --locked --test mpi_conformance --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*mpi_conformance[^"]*\)".*/\1/p' | tail -1)
[ -x "$binary" ] || { echo "ci-mpi: cannot find the mpi_conformance binary" >&2; exit 1; }
for ranks in 2 3; do
    echo "ci-mpi: conformance under mpirun -np $ranks"
    timeout 300 mpirun --oversubscribe --allow-run-as-root -np "$ranks" "$binary"
done
echo "ci-mpi: ok"
