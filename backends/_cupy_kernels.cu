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
// No headers are included, so NVRTC (cupy.RawModule) and `nvcc -ptx` compile
// this file alike. CuPy compiles with -ftz=true, which would flush float32
// subnormals to zero in ordinary float arithmetic; every float32 operation here
// is therefore written as PTX without .ftz, so subnormals survive exactly as
// on the CPU (tests/test_cupy_cpu.py checks the PTX for .ftz).

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

// ------------------------------------------------------------ element types
struct Float32 {
    typedef float S;
    static __device__ __forceinline__ bool bad(S x) {
        return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
    }
    static __device__ __forceinline__ S mul(S x, float inv) { return mul_rn_f32(x, inv); }
};

struct Float64 {
    typedef double S;
    static __device__ __forceinline__ bool bad(S x) {
        return (__double_as_longlong(x) & 0x7ff0000000000000ll) == 0x7ff0000000000000ll;
    }
    static __device__ __forceinline__ S mul(S x, float inv) { return __dmul_rn(x, f32_to_f64(inv)); }
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
};

// 16 bytes of one element type, loaded and stored as one vector.
template <typename S>
union Vec16 {
    uint4 u;
    S s[16 / sizeof(S)];
};

// ------------------------------------------------------------------- bodies
template <typename T, bool MUL>
__device__ __forceinline__ bool process_chunk(typename T::S* __restrict__ p, long long n,
                                              float inv) {
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
                        if (MUL) v[k].s[e] = T::mul(v[k].s[e], inv);
                        bad |= T::bad(v[k].s[e]);
                    }
                    if (MUL) __stcs(pv + jj, v[k].u);
                }
            }
        }
        done = nv * W;
    }
    for (long long i = done + threadIdx.x; i < n; i += blockDim.x) {
        S x = p[i];
        if (MUL) {
            x = T::mul(x, inv);
            p[i] = x;
        }
        bad |= T::bad(x);
    }
    return bad;
}

template <typename T, bool MUL>
__device__ __forceinline__ void run_table(const u64* __restrict__ table, int n_chunks, float inv,
                                          u32* __restrict__ found) {
    bool bad = false;
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        typename T::S* p = reinterpret_cast<typename T::S*>(table[2 * c]);
        const long long n = (long long)table[2 * c + 1];
        bad |= process_chunk<T, MUL>(p, n, inv);
    }
    // Every thread of the block reaches this (the loop bounds are per block).
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(found, 1u);
}

template <typename T>
__device__ __forceinline__ void unscale_table(const u64* __restrict__ table, int n_chunks,
                                              const float* __restrict__ scale, float host_inv,
                                              u32* __restrict__ found) {
    // The device scale is read here, so the host never waits for it.
    const float inv =
        scale != nullptr ? f64_to_f32_rn(__ddiv_rn(1.0, f32_to_f64(*scale))) : host_inv;
    if (__float_as_uint(inv) == 0x3f800000u) {  // exactly 1.0
        run_table<T, false>(table, n_chunks, inv, found);
    } else {
        run_table<T, true>(table, n_chunks, inv, found);
    }
}

// ------------------------------------------------------------------ kernels
#define SC_KERNELS(SUFFIX, TYPE)                                                              \
    extern "C" __global__ void __launch_bounds__(SC_BLOCK)                                   \
        sc_unscale_##SUFFIX(const u64* __restrict__ table, int n_chunks,                      \
                            const float* __restrict__ scale, float host_inv,                  \
                            u32* __restrict__ found) {                                        \
        unscale_table<TYPE>(table, n_chunks, scale, host_inv, found);                         \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(SC_BLOCK)                                   \
        sc_detect_##SUFFIX(const u64* __restrict__ table, int n_chunks,                       \
                           u32* __restrict__ found) {                                         \
        run_table<TYPE, false>(table, n_chunks, 1.0f, found);                                 \
    }

SC_KERNELS(float16, Float16)
SC_KERNELS(bfloat16, BFloat16)
SC_KERNELS(float32, Float32)
SC_KERNELS(float64, Float64)
