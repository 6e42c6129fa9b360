// The gated RMSNorm of one row (spec 3.1, BerryLMRMSNormGated), shared by
// norm.cu's kernel and the fused KDA decode step of recurrence.cu, so that
// both round at the same points and sum in the same order:
//   x  = round_x(x)
//   n  = round_x(x / sqrt(mean(x^2) + eps))     (f32)
//   wn = round_x(weight * n)
//   y  = round_x(wn * silu(z))                  (z in f32)
// One warp owns a row: lane l sums the squares of elements l, l + 32, ...
// in order, then the warp adds its lanes' sums.
#pragma once

#include "common.cuh"

namespace berrylm::gated_norm {

// 1 / sqrt(mean(x^2) + eps) of the row whose i-th (rounded) value is
// value(i), in every lane of the calling warp.
template <typename Value>
__device__ __forceinline__ float inverse_rms(Value value, int width, float eps, int lane) {
    float sum_sq = 0.0f;
    for (int i = lane; i < width; i += 32) {
        const float v = value(i);
        sum_sq += v * v;
    }
    sum_sq = berrylm::warp_sum(sum_sq);
    const float mean_sq = __fdiv_rn(sum_sq, static_cast<float>(width));
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_sq, eps)));
}

// y of one element: its rounded value v, its weight and gate z.
template <typename TX>
__device__ __forceinline__ TX gated_output(float v, float inv_rms, float weight, float z) {
    const float n = berrylm::round_to<TX>(__fmul_rn(v, inv_rms));
    const float wn = berrylm::round_to<TX>(__fmul_rn(weight, n));
    return berrylm::from_f32<TX>(__fmul_rn(wn, berrylm::silu(z)));
}

}  // namespace berrylm::gated_norm
