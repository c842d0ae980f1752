// scaler-core: fused unscale + non-finite detection over many gradient arrays.
//
// One launch per dtype covers every contiguous gradient of that dtype. The host
// splits the arrays into chunks of at most CHUNK_BYTES and uploads a table of
// (pointer, element count) pairs; blocks walk the table with a grid-stride loop,
// so 2000 small arrays cost one launch, not 2000. Each block ORs its threads'
// findings with __syncthreads_or and writes the flag with at most one atomic.
//
// Semantics (the rules of docs/reference.md#backends, identical to the NumPy backend):
//   inv_scale = f32(1 / f64(scale)), read from device memory when a device
//   scale is passed (no host synchronisation) or taken from host_inv;
//   float16/bfloat16 are computed in float32 and written back rounded to
//   nearest even; float32 is multiplied in float32; float64 in float64;
//   an element counts as non-finite if its stored result is NaN or +-inf.
//   With inv_scale == 1 nothing is written (the values cannot change), which
//   keeps NaN payloads intact exactly as the NumPy backend does.
//
// Norm and clipping (unscale_norm, unscale_clip) reuse the same walk over the
// table. The norm is the square root of the sum of squares of the values as
// stored after unscaling, accumulated in float64 and rounded once to float32.
// It is deterministic: every block writes its partial sum (a fixed tree
// reduction of its threads' sums) to its own slot, and sc_norm_finish adds the
// slots up in a fixed order; no floating-point atomics, whose order would vary.
// The clip pass reads the skip flag and the norm from device memory, so the
// host never waits, and computes PyTorch's clip_grad_norm_ coefficient in
// float32: coef = min(1, f32(f32(1 / f32(norm + f32(1e-6))) * f32(max_norm))).
//
// No headers are included, so NVRTC (cupy.RawModule) and `nvcc -ptx` compile
// this file alike. CuPy compiles with -ftz=true, which would flush float32
// subnormals to zero in ordinary float arithmetic; every float32 operation here
// is therefore written as PTX without .ftz, so subnormals survive exactly as
// on the CPU (tests/backends/test_cupy_cpu.py checks the PTX for .ftz).

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

#define SC_BLOCK 512
#define SC_ILP 4

// IEEE float32 multiply and float32 <-> float64 conversions, immune to -ftz=true.
static __device__ __forceinline__ float mul_rn_f32(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

static __device__ __forceinline__ double f32_to_f64(float x) {
    double r;
    asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(x));
    return r;
}

static __device__ __forceinline__ float f64_to_f32_rn(double x) {
    float r;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x));
    return r;
}

static __device__ __forceinline__ float add_rn_f32(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

static __device__ __forceinline__ float div_rn_f32(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// min(1, x) that keeps a NaN (as torch.clamp does; PTX min.f32 would return 1).
static __device__ __forceinline__ float min_one_f32(float x) {
    float r;
    asm("{\n\t.reg .pred p;\n\tsetp.gt.f32 p, %1, 0f3F800000;\n\t"
        "selp.f32 %0, 0f3F800000, %1, p;\n\t}"
        : "=f"(r)
        : "f"(x));
    return r;
}

// float64 arithmetic of the norm, each operation rounded once (never contracted).
static __device__ __forceinline__ double fma_rn_f64(double a, double b, double c) {
    double r;
    asm("fma.rn.f64 %0, %1, %2, %3;" : "=d"(r) : "d"(a), "d"(b), "d"(c));
    return r;
}

static __device__ __forceinline__ double add_rn_f64(double a, double b) {
    double r;
    asm("add.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
    return r;
}

static __device__ __forceinline__ double sqrt_rn_f64(double x) {
    double r;
    asm("sqrt.rn.f64 %0, %1;" : "=d"(r) : "d"(x));
    return r;
}

// PyTorch's clip_grad_norm_: max_norm / (norm + 1e-6) is reciprocal(norm + 1e-6) *
// max_norm on a float32 tensor, then clamp(max=1).
static __device__ __forceinline__ float clip_coef(float norm, float max_norm) {
    return min_one_f32(mul_rn_f32(div_rn_f32(1.0f, add_rn_f32(norm, 1e-6f)), max_norm));
}

// ------------------------------------------------------------ element types
struct Float32 {
    typedef float S;
    static __device__ __forceinline__ bool bad(S x) {
        return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
    }
    static __device__ __forceinline__ S mul(S x, float inv) { return mul_rn_f32(x, inv); }
    static __device__ __forceinline__ double wide(S x) { return f32_to_f64(x); }
};

struct Float64 {
    typedef double S;
    static __device__ __forceinline__ bool bad(S x) {
        return (__double_as_longlong(x) & 0x7ff0000000000000ll) == 0x7ff0000000000000ll;
    }
    static __device__ __forceinline__ S mul(S x, float inv) { return __dmul_rn(x, f32_to_f64(inv)); }
    static __device__ __forceinline__ double wide(S x) { return x; }
};

struct Float16 {
    typedef u16 S;
    static __device__ __forceinline__ bool bad(S x) { return (x & 0x7c00u) == 0x7c00u; }
    static __device__ __forceinline__ S mul(S x, float inv) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        f = mul_rn_f32(f, inv);
        S h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
    static __device__ __forceinline__ double wide(S x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f32_to_f64(f);
    }
};

struct BFloat16 {
    typedef u16 S;
    static __device__ __forceinline__ bool bad(S x) { return (x & 0x7f80u) == 0x7f80u; }
    static __device__ __forceinline__ S mul(S x, float inv) {
        float f = mul_rn_f32(__uint_as_float(((u32)x) << 16), inv);
        u32 u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            return (S)((u >> 16) & 0x8000u ? 0xffc0u : 0x7fc0u);  // quiet NaN, as ml_dtypes
        }
        return (S)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
    }
    static __device__ __forceinline__ double wide(S x) {
        return f32_to_f64(__uint_as_float(((u32)x) << 16));
    }
};

// 16 bytes of one element type, loaded and stored as one vector.
template <typename S>
union Vec16 {
    uint4 u;
    S s[16 / sizeof(S)];
};

// ------------------------------------------------------------------- bodies
// What a pass does to each element x, in this order (OPS is a sum of these):
#define SC_MUL 1     // x = x * inv, rounded to the dtype (what unscale stores)
#define SC_DETECT 2  // flag x if it is NaN or +-inf
#define SC_NORM 4    // add x * x to the thread's float64 sum
#define SC_CLIP 8    // x = x * coef, rounded to the dtype (float64: in float64)
#define SC_STORE 16  // write x back

template <typename T, int OPS>
__device__ __forceinline__ typename T::S element(typename T::S x, float inv, float coef,
                                                 bool& bad, double& acc) {
    if (OPS & SC_MUL) x = T::mul(x, inv);
    if (OPS & SC_DETECT) bad |= T::bad(x);
    if (OPS & SC_NORM) {
        const double w = T::wide(x);
        acc = fma_rn_f64(w, w, acc);
    }
    if (OPS & SC_CLIP) x = T::mul(x, coef);
    return x;
}

template <typename T, int OPS>
__device__ __forceinline__ bool process_chunk(typename T::S* __restrict__ p, long long n,
                                              float inv, float coef, double& acc) {
    typedef typename T::S S;
    const int W = 16 / sizeof(S);
    bool bad = false;
    long long done = 0;
    if ((reinterpret_cast<u64>(p) & 15u) == 0) {
        const long long nv = n / W;
        uint4* __restrict__ pv = reinterpret_cast<uint4*>(p);
        const long long step = (long long)blockDim.x * SC_ILP;
        for (long long j = threadIdx.x; j < nv; j += step) {
            Vec16<S> v[SC_ILP];
#pragma unroll
            for (int k = 0; k < SC_ILP; ++k) {
                const long long jj = j + (long long)k * blockDim.x;
                if (jj < nv) v[k].u = __ldcs(pv + jj);  // streamed: every byte is used once
            }
#pragma unroll
            for (int k = 0; k < SC_ILP; ++k) {
                const long long jj = j + (long long)k * blockDim.x;
                if (jj < nv) {
#pragma unroll
                    for (int e = 0; e < W; ++e) {
                        v[k].s[e] = element<T, OPS>(v[k].s[e], inv, coef, bad, acc);
                    }
                    if (OPS & SC_STORE) __stcs(pv + jj, v[k].u);
                }
            }
        }
        done = nv * W;
    }
    for (long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        const S x = element<T, OPS>(p[i], inv, coef, bad, acc);
        if (OPS & SC_STORE) p[i] = x;
    }
    return bad;
}

// The block's threads' sums added in a fixed tree order; every thread must call it.
// Returns the block's sum in thread 0.
static __device__ __forceinline__ double block_sum(double acc) {
    __shared__ double sums[SC_BLOCK];
    sums[threadIdx.x] = acc;
    __syncthreads();
#pragma unroll
    for (int s = SC_BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) sums[threadIdx.x] = add_rn_f64(sums[threadIdx.x], sums[threadIdx.x + s]);
        __syncthreads();
    }
    return sums[0];
}

template <typename T, int OPS>
__device__ __forceinline__ void run_table(const u64* __restrict__ table, int n_chunks, float inv,
                                          float coef, u32* __restrict__ found,
                                          double* __restrict__ partials) {
    bool bad = false;
    double acc = 0.0;
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        typename T::S* p = reinterpret_cast<typename T::S*>(table[2 * c]);
        const long long n = (long long)table[2 * c + 1];
        bad |= process_chunk<T, OPS>(p, n, inv, coef, acc);
    }
    // Every thread of the block reaches these (the loop bounds are per block).
    if (OPS & SC_DETECT) {
        if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(found, 1u);
    }
    if (OPS & SC_NORM) {
        const double sum = block_sum(acc);
        if (threadIdx.x == 0) partials[blockIdx.x] = sum;  // one slot per block: no atomics
    }
}

static __device__ __forceinline__ float inv_scale(const float* __restrict__ scale,
                                                  float host_inv) {
    // The device scale is read here, so the host never waits for it.
    return scale != nullptr ? f64_to_f32_rn(__ddiv_rn(1.0, f32_to_f64(*scale))) : host_inv;
}

static __device__ __forceinline__ bool is_one(float x) {
    return __float_as_uint(x) == 0x3f800000u;  // exactly 1.0
}

// unscale (STORE) or the read-only first pass of clipping (no STORE), with detection
// and, with SC_NORM, the block's partial sum of squares.
template <typename T, int OPS>
__device__ __forceinline__ void unscale_table(const u64* __restrict__ table, int n_chunks,
                                              const float* __restrict__ scale, float host_inv,
                                              u32* __restrict__ found,
                                              double* __restrict__ partials) {
    const float inv = inv_scale(scale, host_inv);
    if (is_one(inv)) {  // the values cannot change: nothing is written
        run_table<T, OPS & ~(SC_MUL | SC_STORE)>(table, n_chunks, inv, 1.0f, found, partials);
    } else {
        run_table<T, OPS>(table, n_chunks, inv, 1.0f, found, partials);
    }
}

// The second pass of clipping: nothing is written on a skipped step, and nothing
// either when neither factor changes a value (both exactly 1).
template <typename T>
__device__ __forceinline__ void clip_table(const u64* __restrict__ table, int n_chunks,
                                           const float* __restrict__ scale, float host_inv,
                                           const unsigned char* __restrict__ skip,
                                           const float* __restrict__ norm, float max_norm) {
    if (*skip) return;
    const float inv = inv_scale(scale, host_inv);
    const float coef = clip_coef(*norm, max_norm);
    if (is_one(coef)) {
        if (!is_one(inv)) {  // exactly unscale's result
            run_table<T, SC_MUL | SC_STORE>(table, n_chunks, inv, coef, nullptr, nullptr);
        }
    } else if (is_one(inv)) {
        run_table<T, SC_CLIP | SC_STORE>(table, n_chunks, inv, coef, nullptr, nullptr);
    } else {
        run_table<T, SC_MUL | SC_CLIP | SC_STORE>(table, n_chunks, inv, coef, nullptr, nullptr);
    }
}

// ------------------------------------------------------------------ kernels
#define SC_KERNELS(SUFFIX, TYPE)                                                              \
    extern "C" __global__ void __launch_bounds__(SC_BLOCK)                                   \
        sc_unscale_##SUFFIX(const u64* __restrict__ table, int n_chunks,                      \
                            const float* __restrict__ scale, float host_inv,                  \
                            u32* __restrict__ found) {                                        \
        unscale_table<TYPE, SC_MUL | SC_DETECT | SC_STORE>(table, n_chunks, scale, host_inv,  \
                                                           found, nullptr);                   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(SC_BLOCK)                                   \
        sc_detect_##SUFFIX(const u64* __restrict__ table, int n_chunks,                       \
                           u32* __restrict__ found) {                                         \
        run_table<TYPE, SC_DETECT>(table, n_chunks, 1.0f, 1.0f, found, nullptr);              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(SC_BLOCK)                                   \
        sc_unscale_norm_##SUFFIX(const u64* __restrict__ table, int n_chunks,                 \
                                 const float* __restrict__ scale, float host_inv,             \
                                 u32* __restrict__ found, double* __restrict__ partials) {    \
        unscale_table<TYPE, SC_MUL | SC_DETECT | SC_NORM | SC_STORE>(                         \
            table, n_chunks, scale, host_inv, found, partials);                               \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(SC_BLOCK)                                   \
        sc_norm_##SUFFIX(const u64* __restrict__ table, int n_chunks,                         \
                         const float* __restrict__ scale, float host_inv,                     \
                         u32* __restrict__ found, double* __restrict__ partials) {            \
        unscale_table<TYPE, SC_MUL | SC_DETECT | SC_NORM>(table, n_chunks, scale, host_inv,   \
                                                          found, partials);                   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(SC_BLOCK)                                   \
        sc_clip_##SUFFIX(const u64* __restrict__ table, int n_chunks,                         \
                         const float* __restrict__ scale, float host_inv,                     \
                         const unsigned char* __restrict__ skip,                              \
                         const float* __restrict__ norm, float max_norm) {                    \
        clip_table<TYPE>(table, n_chunks, scale, host_inv, skip, norm, max_norm);             \
    }

SC_KERNELS(float16, Float16)
SC_KERNELS(bfloat16, BFloat16)
SC_KERNELS(float32, Float32)
SC_KERNELS(float64, Float64)

// The norm from the blocks' partial sums: one block, a fixed order of additions
// (so the same partials give the same bits), one rounding to float32 at the end.
extern "C" __global__ void __launch_bounds__(SC_BLOCK)
    sc_norm_finish(const double* __restrict__ partials, int n, float* __restrict__ norm) {
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += SC_BLOCK) acc = add_rn_f64(acc, partials[i]);
    const double sum = block_sum(acc);
    if (threadIdx.x == 0) *norm = f64_to_f32_rn(sqrt_rn_f64(sum));
}
