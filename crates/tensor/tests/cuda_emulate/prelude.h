// Host emulation of the CUDA built-ins kernels.cu's GPT section uses: one OS thread per CUDA
// thread, one block at a time, __syncthreads as a std::barrier, __shared__ as a function
// static (shared by the block's threads).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
struct dim3 { unsigned x, y, z; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
std::barrier<>* g_barrier;
inline void __syncthreads() { g_barrier->arrive_and_wait(); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(u32 u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
#include <math.h>
#define GRID_STRIDE(i, n)                                                                  \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                      \
         i += (u64)gridDim.x * blockDim.x)
inline void launch(unsigned grid, unsigned block, const std::function<void()>& f) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> bar(block);
        g_barrier = &bar;
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; ++t) {
            threads.emplace_back([=] { blockIdx = {b, 0, 0}; threadIdx = {t, 0, 0}; f(); });
        }
        for (auto& th : threads) th.join();
    }
}
