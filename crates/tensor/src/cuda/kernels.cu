// The device kernels of hypershard-tensor's `cuda` feature, compiled at run time by NVRTC
// (src/cuda/kernels.rs) once per device, with `--fmad=false --ftz=false` so that every result
// rounds exactly as the CPU path of the crate does: one rounding per operation, subnormals
// kept, no fused multiply-add.
//
// The source needs no headers (NVRTC ships none by default): bf16 is converted with integer
// bit operations that match the `half` crate (round to nearest even, NaN made quiet), and f16
// with the PTX `cvt` instructions, which round to nearest even as well.
//
// Every kernel is a grid-stride loop over `n` elements (64-bit counts), so any grid size
// covers any length; the host clamps the grid and checks every length before the launch.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x0040u);
    }
    u32 lsb = (x >> 16) & 1u;
    return (u16)((x + 0x7fffu + lsb) >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

#define GRID_STRIDE(i, n)                                                                  \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                      \
         i += (u64)gridDim.x * blockDim.x)

// Loads and stores through the compute type: f32 for f32/bf16/f16, f64 for f64.
__device__ __forceinline__ float load_f32(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ void store_f32(float* p, u64 i, float v) { p[i] = v; }
__device__ __forceinline__ float load_bf16(const u16* p, u64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store_bf16(u16* p, u64 i, float v) { p[i] = f32_to_bf16(v); }
__device__ __forceinline__ float load_f16(const u16* p, u64 i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ void store_f16(u16* p, u64 i, float v) { p[i] = f32_to_f16(v); }
__device__ __forceinline__ double load_f64(const double* p, u64 i) { return p[i]; }
__device__ __forceinline__ void store_f64(double* p, u64 i, double v) { p[i] = v; }

// dst = src converted, element by element.
#define CAST(FROM, FROM_T, TO, TO_T)                                                       \
    extern "C" __global__ void cast_##FROM##_##TO(TO_T* dst, const FROM_T* src, u64 n) {   \
        GRID_STRIDE(i, n) { store_##TO(dst, i, load_##FROM(src, i)); }                     \
    }

CAST(f32, float, bf16, u16)
CAST(bf16, u16, f32, float)
CAST(f32, float, f16, u16)
CAST(f16, u16, f32, float)
CAST(bf16, u16, f16, u16)
CAST(f16, u16, bf16, u16)

extern "C" __global__ void cast_f32_f64(double* dst, const float* src, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = (double)src[i]; }
}

extern "C" __global__ void cast_f64_f32(float* dst, const double* src, u64 n) {
    GRID_STRIDE(i, n) { dst[i] = (float)src[i]; }
}

// dst += src; dst += alpha * x; dst *= alpha. Computed in the compute type (COMPUTE), with
// alpha already rounded to it on the host, exactly as the CPU ops do.
#define ARITH(NAME, T, COMPUTE)                                                            \
    extern "C" __global__ void add_##NAME(T* dst, const T* src, u64 n) {                   \
        GRID_STRIDE(i, n) { store_##NAME(dst, i, load_##NAME(dst, i) + load_##NAME(src, i)); } \
    }                                                                                      \
    extern "C" __global__ void axpy_##NAME(T* dst, COMPUTE alpha, const T* x, u64 n) {     \
        GRID_STRIDE(i, n) {                                                                \
            COMPUTE product = alpha * load_##NAME(x, i);                                   \
            store_##NAME(dst, i, load_##NAME(dst, i) + product);                           \
        }                                                                                  \
    }                                                                                      \
    extern "C" __global__ void scale_##NAME(T* dst, COMPUTE alpha, u64 n) {                \
        GRID_STRIDE(i, n) { store_##NAME(dst, i, load_##NAME(dst, i) * alpha); }           \
    }

ARITH(f32, float, float)
ARITH(bf16, u16, float)
ARITH(f16, u16, float)
ARITH(f64, double, double)

// Copy-in and copy-out of flat buffers, for elements of 1, 2, 4 or 8 bytes. `table` holds one
// entry of three u64 per part: the part's device address, its offset in the flat buffer and
// its length, both in elements. Block row `blockIdx.y` copies part `first + blockIdx.y`.
#define FLAT_COPY(NAME, T)                                                                 \
    extern "C" __global__ void copy_in_##NAME(T* flat, const u64* table, u32 first) {      \
        const u64* entry = table + 3 * ((u64)first + blockIdx.y);                          \
        const T* part = (const T*)entry[0];                                                \
        u64 offset = entry[1];                                                             \
        GRID_STRIDE(i, entry[2]) { flat[offset + i] = part[i]; }                           \
    }                                                                                      \
    extern "C" __global__ void copy_out_##NAME(const T* flat, const u64* table, u32 first) { \
        const u64* entry = table + 3 * ((u64)first + blockIdx.y);                          \
        T* part = (T*)entry[0];                                                            \
        u64 offset = entry[1];                                                             \
        GRID_STRIDE(i, entry[2]) { part[i] = flat[offset + i]; }                           \
    }

FLAT_COPY(b1, u8)
FLAT_COPY(b2, u16)
FLAT_COPY(b4, u32)
FLAT_COPY(b8, u64)

// ReLU for hypershard-nn's device layers, in place: x = x > 0 ? x : 0 (NaN gives 0, as the CPU
// `Relu`); and its backward, in place on the gradient: g = y > 0 ? g : 0, where y is the ReLU's
// output (y > 0 exactly where its input was). Values are only kept or zeroed, so every dtype
// matches the CPU bit for bit.
#define RELU(NAME, T)                                                                      \
    extern "C" __global__ void relu_##NAME(T* x, u64 n) {                                  \
        GRID_STRIDE(i, n) {                                                                \
            if (!(load_##NAME(x, i) > 0)) { x[i] = (T)0; }                                 \
        }                                                                                  \
    }                                                                                      \
    extern "C" __global__ void relu_grad_##NAME(T* g, const T* y, u64 n) {                 \
        GRID_STRIDE(i, n) {                                                                \
            if (!(load_##NAME(y, i) > 0)) { g[i] = (T)0; }                                 \
        }                                                                                  \
    }

RELU(f32, float)
RELU(bf16, u16)
RELU(f16, u16)
RELU(f64, double)
