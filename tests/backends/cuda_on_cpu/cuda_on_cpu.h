// Test-only: what backends/_cupy_kernels.cu needs from CUDA, for g++ on the CPU.
//
// build.py compiles the kernel source unchanged, except its inline PTX: each asm
// statement is rewritten into a call of the ptx_* function below of the same
// name and operands (an unknown instruction stops the build). Every CUDA thread
// is a fiber (ucontext); a block's fibers run one after another, each up to its
// next barrier, then all of them past it, so __syncthreads and __syncthreads_or
// mean what they mean on a GPU; blocks run one after another; __shared__ is
// static storage (one block at a time uses it). Compiled with -ffp-contract=off and
// no fast-math, float and double arithmetic round to nearest even, once per
// operation, keeping subnormals: the rounding the PTX instructions name.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __restrict__ __restrict
#define __shared__ static

struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

struct sc_dim3 {
    unsigned int x, y, z;
};

namespace sc_cpu {
extern sc_dim3 thread_idx, block_idx, block_dim, grid_dim;
// Every thread of the block arrives; returns the OR of their predicates.
int barrier(int predicate);
}  // namespace sc_cpu

#define threadIdx sc_cpu::thread_idx
#define blockIdx sc_cpu::block_idx
#define blockDim sc_cpu::block_dim
#define gridDim sc_cpu::grid_dim

inline void __syncthreads() { sc_cpu::barrier(0); }
inline int __syncthreads_or(int predicate) { return sc_cpu::barrier(predicate != 0); }
inline unsigned int atomicOr(unsigned int* address, unsigned int value) {
    const unsigned int old = *address;  // one OS thread: nothing runs in between
    *address = old | value;
    return old;
}
inline uint4 __ldcs(const uint4* p) { return *p; }
inline void __stcs(uint4* p, uint4 v) { *p = v; }

template <typename To, typename From>
inline To sc_bits(From x) {
    static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
    To y;
    std::memcpy(&y, &x, sizeof(To));
    return y;
}
inline unsigned int __float_as_uint(float x) { return sc_bits<unsigned int>(x); }
inline float __uint_as_float(unsigned int x) { return sc_bits<float>(x); }
inline long long __double_as_longlong(double x) { return sc_bits<long long>(x); }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

// ------------------------------------------------ the PTX instructions used
inline float ptx_mul_rn_f32(float a, float b) { return a * b; }
inline float ptx_add_rn_f32(float a, float b) { return a + b; }
inline float ptx_div_rn_f32(float a, float b) { return a / b; }
inline double ptx_cvt_f64_f32(float x) { return static_cast<double>(x); }
inline float ptx_cvt_rn_f32_f64(double x) { return static_cast<float>(x); }
inline double ptx_fma_rn_f64(double a, double b, double c) { return std::fma(a, b, c); }
inline double ptx_add_rn_f64(double a, double b) { return a + b; }
inline double ptx_sqrt_rn_f64(double x) { return std::sqrt(x); }
// setp.gt.f32 p, x, 1.0; selp.f32 r, 1.0, x, p: 1 where x > 1, else x (a NaN stays).
inline float ptx_min_one_f32(float x) { return x > 1.0f ? 1.0f : x; }

// cvt.f32.f16: exact; a NaN keeps its sign and payload (as NumPy widens it).
inline float ptx_cvt_f32_f16(unsigned short h) {
    const unsigned int sign = (h & 0x8000u) << 16;
    const unsigned int exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        const float v = static_cast<float>(man) * 0x1p-24f;  // exact: man < 2^10
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// cvt.rn.f16.f32: round to nearest even; a NaN keeps its sign and its payload's top
// bits, as NumPy narrows a quiet NaN.
inline unsigned short ptx_cvt_rn_f16_f32(float f) {
    const unsigned int x = __float_as_uint(f);
    const unsigned short sign = static_cast<unsigned short>((x >> 16) & 0x8000u);
    const unsigned int ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        unsigned int h = 0x7c00u + ((ax & 0x7fffffu) >> 13);
        if (h == 0x7c00u) ++h;  // stays a NaN
        return static_cast<unsigned short>(sign | h);
    }
    if (ax >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);  // inf
    if (ax < 0x38800000u) {  // below 2^-14: a subnormal half, or zero
        const float scaled = __uint_as_float(ax) * 0x1p24f;  // exact
        return static_cast<unsigned short>(sign | static_cast<unsigned int>(std::nearbyint(scaled)));
    }
    unsigned int h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
    const unsigned int rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves the exponent
    return static_cast<unsigned short>(sign | h);
}
