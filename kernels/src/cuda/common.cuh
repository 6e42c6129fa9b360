// Shared helpers of the BerryLM CUDA kernels: dtype codes, conversions with
// round-to-nearest-even (the rounding candle's CPU conversions use), warp
// reductions and launch-error reporting.
//
// Every exported symbol of this library is `extern "C"` and prefixed
// `berrylm_`, so that it never clashes with other CUDA static libraries linked
// into the same binary.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace berrylm {

// Must match `DTYPE_*` in src/cuda/mod.rs.
enum DTypeCode : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f32<__half>(float x) {
    return __float2half_rn(x);
}

// Rounds an f32 value to the nearest value of T (RNE) and widens it back.
template <typename T> __device__ __forceinline__ float round_to(float x) {
    return to_f32(from_f32<T>(x));
}

// `x / (1 + exp(-x))` in f32 with IEEE division (as the CPU reference).
__device__ __forceinline__ float silu(float x) {
    return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x)));
}

// The residual stream after a MoE block whose shared expert is gated, with
// the reference's rounding points (spec 3.7; `routed` and `shared` are the
// rounded outputs of the routed and shared experts):
//   gate = round_x(sigmoid(gate_logit))     sigmoid(x) = 1 / (exp(-x) + 1)
//   y    = round_x(residual + round_x(routed + round_x(gate * shared)))
template <typename T>
__device__ __forceinline__ T moe_residual(float residual, float routed, float shared,
                                          float gate_logit) {
    const float gate = round_to<T>(__fdiv_rn(1.0f, __fadd_rn(expf(-gate_logit), 1.0f)));
    const float gated = round_to<T>(__fmul_rn(gate, shared));
    const float moe = round_to<T>(__fadd_rn(routed, gated));
    return from_f32<T>(__fadd_rn(residual, moe));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        x += __shfl_xor_sync(0xffffffffu, x, offset);
    }
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    }
    return x;
}

// Two values rounded to T (RNE) in one 32-bit word, `lo` at the lower address.
template <typename T> __device__ __forceinline__ unsigned int pair_bits(float lo, float hi);
template <> __device__ __forceinline__ unsigned int pair_bits<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    return static_cast<unsigned int>(__bfloat16_as_ushort(pair.x)) |
           (static_cast<unsigned int>(__bfloat16_as_ushort(pair.y)) << 16);
}
template <> __device__ __forceinline__ unsigned int pair_bits<__half>(float lo, float hi) {
    const __half2 pair = __floats2half2_rn(lo, hi);
    return static_cast<unsigned int>(__half_as_ushort(pair.x)) |
           (static_cast<unsigned int>(__half_as_ushort(pair.y)) << 16);
}

// Stores eight values converted to T (RNE) as 16-byte vectors; `p` must be
// 16-byte aligned.
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
    float4* vectors = reinterpret_cast<float4*>(p);
    vectors[0] = make_float4(v[0], v[1], v[2], v[3]);
    vectors[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pair_bits<T>(v[0], v[1]), pair_bits<T>(v[2], v[3]),
                                              pair_bits<T>(v[4], v[5]), pair_bits<T>(v[6], v[7]));
}

// Grid size for grid-stride elementwise kernels.
inline unsigned int elementwise_blocks(long long total, int threads) {
    long long blocks = (total + threads - 1) / threads;
    const long long cap = 1ll << 20;
    if (blocks > cap) blocks = cap;
    if (blocks < 1) blocks = 1;
    return static_cast<unsigned int>(blocks);
}

inline int launch_status() { return static_cast<int>(cudaGetLastError()); }

}  // namespace berrylm

// Dispatches a dtype code to a C++ type alias `NAME` for BODY; yields
// cudaErrorInvalidValue for an unknown code.
#define BERRYLM_DISPATCH_DTYPE(CODE, NAME, ...)                     \
    switch (CODE) {                                                 \
        case berrylm::kF32: {                                       \
            using NAME = float;                                     \
            __VA_ARGS__;                                            \
            break;                                                  \
        }                                                           \
        case berrylm::kBF16: {                                      \
            using NAME = __nv_bfloat16;                             \
            __VA_ARGS__;                                            \
            break;                                                  \
        }                                                           \
        case berrylm::kF16: {                                       \
            using NAME = __half;                                    \
            __VA_ARGS__;                                            \
            break;                                                  \
        }                                                           \
        default:                                                    \
            return static_cast<int>(cudaErrorInvalidValue);         \
    }
