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

// ---------------------------------------------------------------------------------------------
// The CUDA side of hypershard-nn's layers (f32 only). They follow the CPU code of crates/nn
// (norm.rs, activation.rs, attention.rs, embedding.rs, gpt.rs, loss.rs) operation by
// operation, in the same order, so that with `--fmad=false` each element rounds as on the
// CPU; only the order of the sums differs (a tree across the block here; on the CPU, lanes
// and blocks of rows), so sums agree to rounding, not bit for bit.
//
// Row kernels run one block of exactly ROW_THREADS threads per row (a grid-stride loop over
// rows, so every thread of a block runs the same number of iterations and every
// `__syncthreads` is reached by all of them). Their reductions are shared-memory trees over
// ROW_THREADS slots (a power of two), with a barrier after every level and after the result
// is read, so nothing depends on the warp size.
// ---------------------------------------------------------------------------------------------

#define ROW_THREADS 256

typedef long long i64;

__device__ __forceinline__ float f32_inf() { return __int_as_float(0x7f800000); }

// The CPU's `exp_in_range` (crates/nn/src/kernels/math.rs), step for step: Cody-Waite
// reduction by ln 2, Cephes' degree-6 polynomial in fused multiply-adds (`mul_add` there,
// `fmaf` here: one rounding each on both), 2^n built in the exponent bits. `clamped` lies in
// [-87, 88].
__device__ float cpu_exp_in_range_f32(float clamped) {
    const float round_magic = 12582912.0f;
    const float log2_e = 1.4426950408889634f;
    const float ln2_hi = 0.6933594f;
    const float ln2_lo = -2.1219444e-4f;
    float shifted = clamped * log2_e + round_magic;
    float n = shifted - round_magic;
    int n_int = (int)(__float_as_uint(shifted) - __float_as_uint(round_magic));
    float r = clamped - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691e-4f;
    p = fmaf(p, r, 1.3981999e-3f);
    p = fmaf(p, r, 8.333452e-3f);
    p = fmaf(p, r, 4.1665796e-2f);
    p = fmaf(p, r, 1.6666665e-1f);
    p = fmaf(p, r, 0.5f);
    float er = fmaf(p * r, r, r) + 1.0f;
    float scale = __uint_as_float(((u32)(n_int + 127)) << 23);
    return er * scale;
}

// The CPU's `exp_f32`: the above, with +inf above 88, 0 below -87 and NaN kept.
__device__ float cpu_exp_f32(float x) {
    float value = cpu_exp_in_range_f32(fminf(fmaxf(x, -87.0f), 88.0f));
    if (x > 88.0f) {
        return f32_inf();
    } else if (x < -87.0f) {
        return 0.0f;
    } else if (x != x) {
        return x;
    }
    return value;
}

// The CPU's `exp_nonpositive_f32`: an argument that is never positive, clamped at -87.
__device__ float cpu_exp_nonpositive_f32(float x) {
    return cpu_exp_in_range_f32(fminf(fmaxf(x, -87.0f), 0.0f));
}

// The CPU's `erfc_ratio`: erfc(a) e^(a²) for a >= 0 by Abramowitz and Stegun 7.1.26.
__device__ float cpu_erfc_ratio_f32(float a) {
    float t = 1.0f / (1.0f + 0.3275911f * a);
    return t * (0.2548296f + t * (-0.28449674f + t * (1.4214137f + t * (-1.453152f + t * 1.0614054f))));
}

// The CPU's `erf_series`: erf a for 0 <= a < 0.5 by its Maclaurin series, in fused
// multiply-adds.
__device__ float cpu_erf_series_f32(float a) {
    float x2 = a * a;
    float series = -1.0f / 1320.0f;
    series = fmaf(series, x2, 1.0f / 216.0f);
    series = fmaf(series, x2, -1.0f / 42.0f);
    series = fmaf(series, x2, 0.1f);
    series = fmaf(series, x2, -1.0f / 3.0f);
    series = fmaf(series, x2, 1.0f);
    return 1.1283791670955126f * a * series;
}

// The CPU's `one_plus_erf_and_gauss_f32`: 1 + erf x from erfc |x| directly (erfc below zero,
// 2 − erfc above), and `*gauss` = e^(−x²).
__device__ float cpu_one_plus_erf_gauss_f32(float x, float* gauss) {
    float a = fabsf(x);
    *gauss = cpu_exp_nonpositive_f32(-a * a);
    float erfc = a < 0.5f ? 1.0f - cpu_erf_series_f32(a) : cpu_erfc_ratio_f32(a) * *gauss;
    return x < 0.0f ? erfc : 2.0f - erfc;
}

// The sum of every thread's `v` over the block (ROW_THREADS threads), as a fixed tree.
__device__ float block_sum(float v, float* shared) {
    u32 tid = threadIdx.x;
    shared[tid] = v;
    __syncthreads();
    for (u32 s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            shared[tid] = shared[tid] + shared[tid + s];
        }
        __syncthreads();
    }
    float total = shared[0];
    // Every thread reads the result before any thread writes `shared` again.
    __syncthreads();
    return total;
}

// The largest of every thread's `v` over the block (fmaxf ignores NaN, as the CPU's f32::max).
__device__ float block_max(float v, float* shared) {
    u32 tid = threadIdx.x;
    shared[tid] = v;
    __syncthreads();
    for (u32 s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) {
            shared[tid] = fmaxf(shared[tid], shared[tid + s]);
        }
        __syncthreads();
    }
    float total = shared[0];
    __syncthreads();
    return total;
}

// LayerNorm over rows of width d (norm.rs `ForwardRows`, Centering::Mean): mean = Σx · inv_d,
// var = Σ(x − mean)² · inv_d, r = 1 / √(var + eps), x̂ = (x − mean) · r, out = x̂ · w (+ b).
// With `center` 0 it is RMSNorm (Centering::None): mean = 0, as on the host.
// Writes out, x̂ and r (what backward needs). `b` is read only when `has_bias`.
extern "C" __global__ void layer_norm_f32(float* out, float* xhat, float* rstd, const float* x,
                                          const float* w, const float* b, u32 has_bias,
                                          u32 center, u64 rows, u64 d, float inv_d, float eps) {
    __shared__ float shared[ROW_THREADS];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + row * d;
        float partial = 0.0f;
        float mean = 0.0f;
        // `center` is the same for the whole grid, so every thread of a block reaches the
        // reduction's barriers or none does.
        if (center) {
            for (u64 j = threadIdx.x; j < d; j += ROW_THREADS) {
                partial = partial + xr[j];
            }
            mean = block_sum(partial, shared) * inv_d;
        }
        partial = 0.0f;
        for (u64 j = threadIdx.x; j < d; j += ROW_THREADS) {
            float dev = xr[j] - mean;
            partial = partial + dev * dev;
        }
        float var = block_sum(partial, shared) * inv_d;
        float r = 1.0f / sqrtf(var + eps);
        if (threadIdx.x == 0) {
            rstd[row] = r;
        }
        for (u64 j = threadIdx.x; j < d; j += ROW_THREADS) {
            float n = (xr[j] - mean) * r;
            xhat[row * d + j] = n;
            float o = n * w[j];
            if (has_bias) {
                o = o + b[j];
            }
            out[row * d + j] = o;
        }
    }
}

// LayerNorm's input gradient (norm.rs `norm_backward`): with ĝ = g · w,
// dx = r · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)); with `center` 0 (RMSNorm) without mean(ĝ).
extern "C" __global__ void layer_norm_backward_f32(float* dx, const float* g, const float* xhat,
                                                   const float* rstd, const float* w, u32 center,
                                                   u64 rows, u64 d, float inv_d) {
    __shared__ float shared[ROW_THREADS];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* gr = g + row * d;
        const float* xr = xhat + row * d;
        float partial_g = 0.0f;
        float partial_gx = 0.0f;
        for (u64 j = threadIdx.x; j < d; j += ROW_THREADS) {
            float gh = gr[j] * w[j];
            partial_g = partial_g + gh;
            partial_gx = partial_gx + gh * xr[j];
        }
        // Both reductions run either way (`center` is uniform over the grid); RMSNorm drops
        // mean(ĝ), as the host does.
        float sum_g = block_sum(partial_g, shared);
        float mean_g = center ? sum_g * inv_d : 0.0f;
        float mean_gx = block_sum(partial_gx, shared) * inv_d;
        float r = rstd[row];
        for (u64 j = threadIdx.x; j < d; j += ROW_THREADS) {
            dx[row * d + j] = r * (gr[j] * w[j] - mean_g - xr[j] * mean_gx);
        }
    }
}

// LayerNorm's parameter gradients, one thread per column summing the rows in order from zero
// (as the CPU does), then added to the accumulated gradient: dw += Σ g · x̂, db += Σ g.
// `db` is written only when `has_bias`.
extern "C" __global__ void layer_norm_param_grad_f32(float* dw, float* db, const float* g,
                                                     const float* xhat, u32 has_bias, u64 rows,
                                                     u64 d) {
    GRID_STRIDE(j, d) {
        float acc_w = 0.0f;
        float acc_b = 0.0f;
        for (u64 row = 0; row < rows; ++row) {
            float gv = g[row * d + j];
            acc_w = acc_w + gv * xhat[row * d + j];
            acc_b = acc_b + gv;
        }
        dw[j] = dw[j] + acc_w;
        if (has_bias) {
            db[j] = db[j] + acc_b;
        }
    }
}

// The exact GELU (activation.rs `gelu_exact`): 0.5 x (1 + erf(x / √2)).
extern "C" __global__ void gelu_f32(float* y, const float* x, u64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        float gauss;
        y[i] = 0.5f * v * cpu_one_plus_erf_gauss_f32(v * 0.7071067811865476f, &gauss);
    }
}

// Its backward (activation.rs `gelu_exact_grad`): dx = g · (Φ(x) + x φ(x)).
extern "C" __global__ void gelu_grad_f32(float* dx, const float* g, const float* x, u64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        // e^(−z²) at z = x/√2 is the density's e^(−x²/2): one exponential for both terms.
        float gauss;
        float cdf = 0.5f * cpu_one_plus_erf_gauss_f32(v * 0.7071067811865476f, &gauss);
        float pdf = gauss * 0.3989422804014327f;
        dx[i] = g[i] * (cdf + v * pdf);
    }
}

// The CPU's `tanh_f32` (math.rs): 1 − 2 / (e^{2x} + 1).
__device__ float cpu_tanh_f32(float x) {
    return 1.0f - 2.0f / (cpu_exp_f32(2.0f * x) + 1.0f);
}

// The f32 constants of the tanh GELU as the CPU rounds them from f64 (activation.rs):
// √(2/π) and 0.044715.
__device__ __forceinline__ float gelu_tanh_c() { return __uint_as_float(0x3f4c422au); }
__device__ __forceinline__ float gelu_tanh_coeff() { return __uint_as_float(0x3d372713u); }

// The tanh GELU (activation.rs `gelu_tanh`): 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³))).
extern "C" __global__ void gelu_tanh_f32(float* y, const float* x, u64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        float inner = gelu_tanh_c() * (v + gelu_tanh_coeff() * v * v * v);
        y[i] = 0.5f * v * (1.0f + cpu_tanh_f32(inner));
    }
}

// Its backward (activation.rs `gelu_tanh_grad`): dx = g · (½(1 + t) + ½x(1 − t²)·c(1 + 3kx²))
// with t = tanh(c(x + kx³)).
extern "C" __global__ void gelu_tanh_grad_f32(float* dx, const float* g, const float* x, u64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        float c = gelu_tanh_c();
        float k = gelu_tanh_coeff();
        float t = cpu_tanh_f32(c * (v + k * v * v * v));
        float d_inner = c * (1.0f + 3.0f * k * v * v);
        dx[i] = g[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * d_inner);
    }
}

// The CPU's `sigmoid` (activation.rs): 1 / (1 + e^{−x}).
__device__ float cpu_sigmoid_f32(float x) {
    return 1.0f / (1.0f + cpu_exp_f32(-x));
}

// SiLU (activation.rs `Silu`): x · σ(x).
extern "C" __global__ void silu_f32(float* y, const float* x, u64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        y[i] = v * cpu_sigmoid_f32(v);
    }
}

// Its backward: dx = g · σ(x)(1 + x(1 − σ(x))).
extern "C" __global__ void silu_grad_f32(float* dx, const float* g, const float* x, u64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        float s = cpu_sigmoid_f32(v);
        dx[i] = g[i] * (s * (1.0f + v * (1.0f - s)));
    }
}

// The tensor crate's counter-based generator (random.rs): SplitMix64's finaliser applied to a
// hashed seed plus (counter + 1)·GAMMA, and a uniform in [0, 1) from the top 53 bits.
__device__ u64 splitmix_finalise(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ double random_unit(u64 seed, u64 counter) {
    u64 bits = splitmix_finalise(splitmix_finalise(seed) + (counter + 1) * 0x9E3779B97F4A7C15ull);
    return (double)(bits >> 11) * (1.0 / 9007199254740992.0);
}

// Dropout (dropout.rs `DropMask::scale_at`): element i is dropped when the uniform of
// (seed, i) is below p, else scaled by keep_scale = 1/(1 − p); the scale rounds to f32 and
// y = x · scale, as on the host. The backward runs the same kernel on the gradient.
extern "C" __global__ void dropout_f32(float* y, const float* x, u64 n, u64 seed, double p,
                                       double keep_scale) {
    GRID_STRIDE(i, n) {
        double scale = random_unit(seed, i) < p ? 0.0 : keep_scale;
        y[i] = x[i] * (float)scale;
    }
}

// The causal softmax of attention scores in place (attention.rs `causal_softmax`), over
// `rows` rows of length t (batch · heads · t rows): row r is query position i = r mod t and
// sees columns 0..=i; p = exp(s·scale − max) / Σ, the masked columns are set to exactly 0.
extern "C" __global__ void causal_softmax_f32(float* s, u64 rows, u64 t, float scale) {
    __shared__ float shared[ROW_THREADS];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        float* sr = s + row * t;
        u64 visible = row % t + 1;
        // Column 0 is always visible, so every thread starts its maximum from it, as the
        // CPU's fold does.
        float partial_max = sr[0] * scale;
        for (u64 j = threadIdx.x; j < visible; j += ROW_THREADS) {
            partial_max = fmaxf(partial_max, sr[j] * scale);
        }
        float mx = block_max(partial_max, shared);
        float partial = 0.0f;
        for (u64 j = threadIdx.x; j < visible; j += ROW_THREADS) {
            float e = cpu_exp_f32(sr[j] * scale - mx);
            sr[j] = e;
            partial = partial + e;
        }
        float inv = 1.0f / block_sum(partial, shared);
        for (u64 j = threadIdx.x; j < t; j += ROW_THREADS) {
            sr[j] = j < visible ? sr[j] * inv : 0.0f;
        }
    }
}

// Its backward in place on the gradient (attention.rs `softmax_backward`):
// dS = scale · P ⊙ (dP − Σ_row dP ⊙ P), over whole rows (P is 0 on the masked columns).
extern "C" __global__ void causal_softmax_backward_f32(float* g, const float* p, u64 rows, u64 t,
                                                       float scale) {
    __shared__ float shared[ROW_THREADS];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        float* gr = g + row * t;
        const float* pr = p + row * t;
        float partial = 0.0f;
        for (u64 j = threadIdx.x; j < t; j += ROW_THREADS) {
            partial = partial + pr[j] * gr[j];
        }
        float dot = block_sum(partial, shared);
        for (u64 j = threadIdx.x; j < t; j += ROW_THREADS) {
            gr[j] = scale * pr[j] * (gr[j] - dot);
        }
    }
}

// Cross-entropy over rows of `classes` logits (loss.rs `cross_entropy_rows`). `targets[row]`
// is the class, or negative for an ignored row (zero gradient, zero loss). Per counted row:
// e = exp(x − max), loss = ln Σe + max − x[class] in f64, grad = e · (scale / Σe), and
// grad[class] −= scale. The per-row losses are summed on the host in f64, in row order.
extern "C" __global__ void cross_entropy_f32(float* grad, double* row_loss, const float* logits,
                                             const i64* targets, u64 rows, u64 classes,
                                             float scale) {
    __shared__ float shared[ROW_THREADS];
    for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = logits + row * classes;
        float* gr = grad + row * classes;
        i64 target = targets[row];
        if (target < 0) {
            for (u64 j = threadIdx.x; j < classes; j += ROW_THREADS) {
                gr[j] = 0.0f;
            }
            if (threadIdx.x == 0) {
                row_loss[row] = 0.0;
            }
            // `target` is the same for the whole block, so every thread skips the barriers
            // below together.
            continue;
        }
        float partial_max = xr[0];
        for (u64 j = threadIdx.x; j < classes; j += ROW_THREADS) {
            partial_max = fmaxf(partial_max, xr[j]);
        }
        float mx = block_max(partial_max, shared);
        float partial = 0.0f;
        for (u64 j = threadIdx.x; j < classes; j += ROW_THREADS) {
            float e = cpu_exp_f32(xr[j] - mx);
            gr[j] = e;
            partial = partial + e;
        }
        float sum = block_sum(partial, shared);
        u64 class_index = (u64)target;
        if (threadIdx.x == 0) {
            row_loss[row] = (log((double)sum) + (double)mx) - (double)xr[class_index];
        }
        float factor = scale / sum;
        for (u64 j = threadIdx.x; j < classes; j += ROW_THREADS) {
            float v = gr[j] * factor;
            if (j == class_index) {
                v = v - scale;
            }
            gr[j] = v;
        }
    }
}

// The token embedding's rows, plus the position table's when `has_pos` (gpt.rs `embed`,
// embedding.rs `Embedding::forward`): out[n] = wte[ids[n]] (+ wpe[n mod seq]), rows of width
// c. The ids were checked against the vocabulary on the host; without positions `wpe` is never
// read.
extern "C" __global__ void embedding_f32(float* out, const float* wte, const float* wpe,
                                         const i64* ids, u64 tokens, u64 seq, u64 c,
                                         u32 has_pos) {
    GRID_STRIDE(i, tokens * c) {
        u64 position = i / c;
        u64 column = i % c;
        float row = wte[(u64)ids[position] * c + column];
        out[i] = has_pos ? row + wpe[(position % seq) * c + column] : row;
    }
}

// The token embedding's gradient without atomics (embedding.rs `scatter_add_rows`): one
// thread per (vocabulary row, column) sums the gradient rows of that token's positions in
// increasing position order, from zero, as the CPU does, and adds the sum to the accumulated
// gradient. `offsets` (vocab + 1 entries) and `order` (one entry per token) list each
// vocabulary row's positions: a stable counting sort made on the host.
extern "C" __global__ void embedding_backward_f32(float* grad_wte, const float* g,
                                                  const i64* offsets, const i64* order,
                                                  u64 vocab, u64 c) {
    GRID_STRIDE(i, vocab * c) {
        u64 row = i / c;
        u64 column = i % c;
        i64 begin = offsets[row];
        i64 end = offsets[row + 1];
        if (begin == end) {
            continue;
        }
        float acc = 0.0f;
        for (i64 k = begin; k < end; ++k) {
            acc = acc + g[(u64)order[k] * c + column];
        }
        grad_wte[i] = grad_wte[i] + acc;
    }
}

// The position embedding's gradient (gpt.rs `position_grad`): dwpe[t] += Σ_b g[b, t], the
// batch rows summed in order from zero. Rows t ≥ seq of the table get nothing.
extern "C" __global__ void position_backward_f32(float* grad_wpe, const float* g, u64 batch,
                                                 u64 seq, u64 c) {
    GRID_STRIDE(i, seq * c) {
        u64 t = i / c;
        u64 column = i % c;
        float acc = 0.0f;
        for (u64 b = 0; b < batch; ++b) {
            acc = acc + g[(b * seq + t) * c + column];
        }
        grad_wpe[i] = grad_wpe[i] + acc;
    }
}

// Attention's head split and merge. `rows` is [batch][seq][parts · h · hd] (the fused q, k, v
// projection has parts = 3; the attention output has 1), `heads` is [batch][h][seq][hd], the
// part `part` of every row. Both directions are the same bijection, so no two threads write
// the same element.
#define HEAD_INDEX                                                                         \
    u64 dd = i % hd;                                                                       \
    u64 t = (i / hd) % seq;                                                                \
    u64 head = (i / (hd * seq)) % h;                                                       \
    u64 b = i / (hd * seq * h);                                                            \
    u64 src = ((b * seq + t) * parts + part) * (h * hd) + head * hd + dd;

extern "C" __global__ void split_heads_f32(float* heads, const float* rows, u64 batch, u64 seq,
                                           u64 h, u64 hd, u64 part, u64 parts) {
    GRID_STRIDE(i, batch * seq * h * hd) {
        HEAD_INDEX
        heads[i] = rows[src];
    }
}

extern "C" __global__ void merge_heads_f32(float* rows, const float* heads, u64 batch, u64 seq,
                                           u64 h, u64 hd, u64 part, u64 parts) {
    GRID_STRIDE(i, batch * seq * h * hd) {
        HEAD_INDEX
        rows[src] = heads[i];
    }
}

// One AdamW step in f32 (optim/adamw.rs, which computes in f64): p ·= 1 − lr·wd;
// m = β₁m + (1 − β₁)g; v = β₂v + (1 − β₂)g²; p −= step_size · m / (√v / √(1 − β₂ᵗ) + eps).
// The scalars are computed on the host in f64 and rounded to f32 once.
extern "C" __global__ void adamw_f32(float* p, float* m, float* v, const float* g, u64 n,
                                     float decay, float beta1, float one_minus_beta1, float beta2,
                                     float one_minus_beta2, float step_size, float bc2_sqrt,
                                     float eps) {
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float pi = p[i] * decay;
        float mi = beta1 * m[i] + one_minus_beta1 * gi;
        float vi = beta2 * v[i] + one_minus_beta2 * gi * gi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi - step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

// One SGD step with weight decay and momentum (optim/sgd.rs's general path), in f64 as the host
// computes it and rounded to f32 once per stored value: g' = g + wd·p;
// b = first ? g' : μ·b + (1 − τ)·g' (stored); g'' = nesterov ? g' + μ·b : b; p −= lr·g''.
// Without momentum (`momentum_on` 0) `buf` is not touched, and g'' = g'.
extern "C" __global__ void sgd_f32(float* p, float* buf, const float* g, u64 n, double lr,
                                   double momentum, double dampening, double weight_decay,
                                   u32 momentum_on, u32 nesterov, u32 first) {
    GRID_STRIDE(i, n) {
        double pi = (double)p[i];
        double gi = (double)g[i];
        if (weight_decay != 0.0) {
            gi = gi + weight_decay * pi;
        }
        if (momentum_on) {
            double bi = first ? gi : momentum * (double)buf[i] + (1.0 - dampening) * gi;
            buf[i] = (float)bi;
            gi = nesterov ? gi + momentum * bi : bi;
        }
        p[i] = (float)(pi - lr * gi);
    }
}

// Tiled (flash) causal attention straight from the fused projection qkv [B, T, 3C] (head h's
// q, k and v at columns h·D, C + h·D and 2C + h·D), so neither the heads nor the [T, T]
// weights are ever materialised (attention/flash.rs, the host's kernel). A block of
// FLASH_ROWS threads takes FLASH_ROWS consecutive rows of one (batch, head), one row per
// thread, and walks the keys in tiles of FLASH_KEYS staged in shared memory; all threads of a
// block run the same tile loop, so every barrier is reached by all of them. Head widths up to
// FLASH_MAX_D (the host checks).
//
// Forward: an online softmax per query row i: per tile, the scores s = (q·k)·scale of the
// visible keys, the running maximum m, l ·= exp(m_old − m) and acc ·= the same, then for
// each key l += e = exp(s − m) and acc += e·mask·v, with mask the dropout scale of weight
// (b, h, i, j) (the counter (bh·T + i)·T + j of the weights' row-major order, as
// dropout.rs's `DropMask`). out = acc / l, lse = m + ln l (what the backward needs).
#define FLASH_ROWS 64
#define FLASH_KEYS 32
#define FLASH_MAX_D 128

__device__ __forceinline__ float flash_mask(u32 dropout_on, u64 seed, double p, double keep_scale,
                                            u64 counter) {
    if (!dropout_on) {
        return 1.0f;
    }
    return (float)(random_unit(seed, counter) < p ? 0.0 : keep_scale);
}

// A block's work item w of the flash kernels: which (batch, head) and which tile of FLASH_ROWS
// rows, and the row this thread owns (active when it is below T).
struct FlashTile {
    u64 tile, bh, b, h, row;
    bool active;
};

__device__ __forceinline__ u64 flash_tiles(u64 t) { return (t + FLASH_ROWS - 1) / FLASH_ROWS; }

__device__ __forceinline__ FlashTile flash_tile(u64 w, u64 t, u64 heads) {
    FlashTile at;
    at.tile = w % flash_tiles(t);
    at.bh = w / flash_tiles(t);
    at.b = at.bh / heads;
    at.h = at.bh % heads;
    at.row = at.tile * FLASH_ROWS + threadIdx.x;
    at.active = at.row < t;
    return at;
}

// dst[0..d) = src[at..at + d) for an active row, zeros otherwise (src is not read then).
__device__ __forceinline__ void flash_row(float* dst, const float* src, u64 at, u64 d,
                                          bool active) {
    for (u64 e = 0; e < d; ++e) {
        dst[e] = active ? src[at + e] : 0.0f;
    }
}

// Stages the keys and values k0 .. k0 + FLASH_KEYS of one head (columns `col` of the k and v
// parts of `rows`, the batch's [T, 3C] rows) in shared memory, zeros past T. Called by every
// thread of the block: the first barrier lets every thread finish reading the previous tile.
__device__ void flash_load_keys(float* ks, float* vs, const float* rows, u64 k0, u64 t, u64 c,
                                u64 col, u64 d) {
    __syncthreads();
    for (u64 x = threadIdx.x; x < FLASH_KEYS * d; x += FLASH_ROWS) {
        u64 j = k0 + x / d, e = x % d;
        ks[x] = j < t ? rows[j * 3 * c + c + col + e] : 0.0f;
        vs[x] = j < t ? rows[j * 3 * c + 2 * c + col + e] : 0.0f;
    }
    __syncthreads();
}

extern "C" __global__ void flash_forward_f32(float* out, float* lse, const float* qkv, u64 batch,
                                             u64 t, u64 heads, u64 d, float scale, u64 seed,
                                             double p, double keep_scale, u32 dropout_on) {
    __shared__ float ks[FLASH_KEYS * FLASH_MAX_D];
    __shared__ float vs[FLASH_KEYS * FLASH_MAX_D];
    u64 c = heads * d;
    for (u64 w = blockIdx.x; w < batch * heads * flash_tiles(t); w += gridDim.x) {
        FlashTile at = flash_tile(w, t, heads);
        u64 tile = at.tile, bh = at.bh, b = at.b, h = at.h, i = at.row;
        bool active = at.active;
        const float* rows = qkv + b * t * 3 * c;
        float q[FLASH_MAX_D], acc[FLASH_MAX_D];
        flash_row(q, rows, i * 3 * c + h * d, d, active);
        flash_row(acc, rows, 0, d, false);
        float m = -f32_inf(), l = 0.0f;
        u64 end = (tile + 1) * FLASH_ROWS < t ? (tile + 1) * FLASH_ROWS : t;
        for (u64 k0 = 0; k0 < end; k0 += FLASH_KEYS) {
            flash_load_keys(ks, vs, rows, k0, t, c, h * d, d);
            if (!active || k0 > i) {
                continue;
            }
            u64 n = i + 1 - k0 < FLASH_KEYS ? i + 1 - k0 : FLASH_KEYS;
            float s[FLASH_KEYS];
            float tile_max = -f32_inf();
            for (u64 jj = 0; jj < n; ++jj) {
                float dot = 0.0f;
                for (u64 e = 0; e < d; ++e) {
                    dot = dot + q[e] * ks[jj * d + e];
                }
                s[jj] = dot * scale;
                tile_max = fmaxf(tile_max, s[jj]);
            }
            float m_new = fmaxf(m, tile_max);
            float correction = cpu_exp_f32(m - m_new);
            l = l * correction;
            for (u64 e = 0; e < d; ++e) {
                acc[e] = acc[e] * correction;
            }
            for (u64 jj = 0; jj < n; ++jj) {
                float weight = cpu_exp_f32(s[jj] - m_new);
                l = l + weight;
                weight = weight * flash_mask(dropout_on, seed, p, keep_scale, (bh * t + i) * t + k0 + jj);
                for (u64 e = 0; e < d; ++e) {
                    acc[e] = acc[e] + weight * vs[jj * d + e];
                }
            }
            m = m_new;
        }
        if (active) {
            float inv = 1.0f / l;
            for (u64 e = 0; e < d; ++e) {
                out[(b * t + i) * c + h * d + e] = acc[e] * inv;
            }
            lse[bh * t + i] = m + logf(l);
        }
    }
}

// delta[bh·T + i] = dO_i · O_i per query row: Σ_j P_ij·dP_ij of the softmax's backward (the
// dropout's mask included, since O = (P ⊙ mask) V).
extern "C" __global__ void flash_backward_delta_f32(float* delta, const float* out,
                                                    const float* dout, u64 batch, u64 t,
                                                    u64 heads, u64 d) {
    u64 c = heads * d;
    GRID_STRIDE(r, batch * heads * t) {
        u64 i = r % t, bh = r / t, b = bh / heads, h = bh % heads;
        u64 at = (b * t + i) * c + h * d;
        float sum = 0.0f;
        for (u64 e = 0; e < d; ++e) {
            sum = sum + dout[at + e] * out[at + e];
        }
        delta[r] = sum;
    }
}

// The queries' gradient, one thread per query row i (the forward's tiling): per visible key j,
// P_ij = exp(s_ij − lse_i), dP_ij = (dO_i · v_j)·mask_ij, dS_ij = P_ij (dP_ij − delta_i), and
// dq_i = scale · Σ_j dS_ij k_j, written to dqkv's q columns.
extern "C" __global__ void flash_backward_dq_f32(float* dqkv, const float* qkv, const float* dout,
                                                 const float* lse, const float* delta, u64 batch,
                                                 u64 t, u64 heads, u64 d, float scale, u64 seed,
                                                 double p, double keep_scale, u32 dropout_on) {
    __shared__ float ks[FLASH_KEYS * FLASH_MAX_D];
    __shared__ float vs[FLASH_KEYS * FLASH_MAX_D];
    u64 c = heads * d;
    for (u64 w = blockIdx.x; w < batch * heads * flash_tiles(t); w += gridDim.x) {
        FlashTile at = flash_tile(w, t, heads);
        u64 tile = at.tile, bh = at.bh, b = at.b, h = at.h, i = at.row;
        bool active = at.active;
        const float* rows = qkv + b * t * 3 * c;
        float q[FLASH_MAX_D], go[FLASH_MAX_D], dq[FLASH_MAX_D];
        flash_row(q, rows, i * 3 * c + h * d, d, active);
        flash_row(go, dout, (b * t + i) * c + h * d, d, active);
        flash_row(dq, dout, 0, d, false);
        float row_lse = active ? lse[bh * t + i] : 0.0f;
        float row_delta = active ? delta[bh * t + i] : 0.0f;
        u64 end = (tile + 1) * FLASH_ROWS < t ? (tile + 1) * FLASH_ROWS : t;
        for (u64 k0 = 0; k0 < end; k0 += FLASH_KEYS) {
            flash_load_keys(ks, vs, rows, k0, t, c, h * d, d);
            if (!active || k0 > i) {
                continue;
            }
            u64 n = i + 1 - k0 < FLASH_KEYS ? i + 1 - k0 : FLASH_KEYS;
            for (u64 jj = 0; jj < n; ++jj) {
                float dot = 0.0f, dp = 0.0f;
                for (u64 e = 0; e < d; ++e) {
                    dot = dot + q[e] * ks[jj * d + e];
                    dp = dp + go[e] * vs[jj * d + e];
                }
                float prob = cpu_exp_f32(dot * scale - row_lse);
                dp = dp * flash_mask(dropout_on, seed, p, keep_scale, (bh * t + i) * t + k0 + jj);
                float ds = prob * (dp - row_delta);
                for (u64 e = 0; e < d; ++e) {
                    dq[e] = dq[e] + ds * ks[jj * d + e];
                }
            }
        }
        if (active) {
            for (u64 e = 0; e < d; ++e) {
                dqkv[(b * t + i) * 3 * c + h * d + e] = dq[e] * scale;
            }
        }
    }
}

// The keys' and values' gradients, one thread per key row j, walking the queries i ≥ j in
// tiles of FLASH_KEYS staged in shared memory (with their lse and delta): per visible query,
// P_ij and dS_ij as above, dv_j += P_ij·mask_ij·dO_i and dk_j += dS_ij q_i; dk_j · scale and
// dv_j are written to dqkv's k and v columns. No atomics: each thread owns its key's rows.
extern "C" __global__ void flash_backward_dkv_f32(float* dqkv, const float* qkv, const float* dout,
                                                  const float* lse, const float* delta, u64 batch,
                                                  u64 t, u64 heads, u64 d, float scale, u64 seed,
                                                  double p, double keep_scale, u32 dropout_on) {
    __shared__ float qs[FLASH_KEYS * FLASH_MAX_D];
    __shared__ float gos[FLASH_KEYS * FLASH_MAX_D];
    __shared__ float lses[FLASH_KEYS];
    __shared__ float deltas[FLASH_KEYS];
    u64 c = heads * d;
    for (u64 w = blockIdx.x; w < batch * heads * flash_tiles(t); w += gridDim.x) {
        FlashTile at = flash_tile(w, t, heads);
        u64 tile = at.tile, bh = at.bh, b = at.b, h = at.h, j = at.row;
        bool active = at.active;
        const float* rows = qkv + b * t * 3 * c;
        float k[FLASH_MAX_D], v[FLASH_MAX_D], dk[FLASH_MAX_D], dv[FLASH_MAX_D];
        flash_row(k, rows, j * 3 * c + c + h * d, d, active);
        flash_row(v, rows, j * 3 * c + 2 * c + h * d, d, active);
        flash_row(dk, rows, 0, d, false);
        flash_row(dv, rows, 0, d, false);
        for (u64 q0 = tile * FLASH_ROWS; q0 < t; q0 += FLASH_KEYS) {
            __syncthreads();
            for (u64 x = threadIdx.x; x < FLASH_KEYS * d; x += FLASH_ROWS) {
                u64 i = q0 + x / d, e = x % d;
                qs[x] = i < t ? rows[i * 3 * c + h * d + e] : 0.0f;
                gos[x] = i < t ? dout[(b * t + i) * c + h * d + e] : 0.0f;
            }
            for (u64 x = threadIdx.x; x < FLASH_KEYS; x += FLASH_ROWS) {
                lses[x] = q0 + x < t ? lse[bh * t + q0 + x] : 0.0f;
                deltas[x] = q0 + x < t ? delta[bh * t + q0 + x] : 0.0f;
            }
            __syncthreads();
            if (!active) {
                continue;
            }
            for (u64 ii = 0; ii < FLASH_KEYS && q0 + ii < t; ++ii) {
                u64 i = q0 + ii;
                if (i < j) {
                    continue;
                }
                float dot = 0.0f, dp = 0.0f;
                for (u64 e = 0; e < d; ++e) {
                    dot = dot + qs[ii * d + e] * k[e];
                    dp = dp + gos[ii * d + e] * v[e];
                }
                float prob = cpu_exp_f32(dot * scale - lses[ii]);
                float mask = flash_mask(dropout_on, seed, p, keep_scale, (bh * t + i) * t + j);
                float ds = prob * (dp * mask - deltas[ii]);
                float dropped = prob * mask;
                for (u64 e = 0; e < d; ++e) {
                    dv[e] = dv[e] + dropped * gos[ii * d + e];
                    dk[e] = dk[e] + ds * qs[ii * d + e];
                }
            }
        }
        if (active) {
            for (u64 e = 0; e < d; ++e) {
                dqkv[(b * t + j) * 3 * c + c + h * d + e] = dk[e] * scale;
                dqkv[(b * t + j) * 3 * c + 2 * c + h * d + e] = dv[e];
            }
        }
    }
}
