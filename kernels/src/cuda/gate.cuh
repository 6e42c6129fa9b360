// The KDA forget gate and write strength of one channel (spec 3.6 step 3),
// shared by gate.cu's elementwise kernels and the fused decode step of
// recurrence.cu, so that both compute them with the same operations:
//   g    = -exp(a_log[h]) * softplus(raw + dt_bias)   (optionally max(g, lb))
//   beta = 1 / (exp(-b) + 1)
// with softplus(x) = x above 20, log1p(exp(x)) otherwise; all in f32.
#pragma once

#include "common.cuh"

namespace berrylm::gate {

__device__ __forceinline__ float forget_gate(float raw, float dt_bias, float a_log,
                                             bool has_lower_bound, float lower_bound) {
    const float x = __fadd_rn(raw, dt_bias);
    const float softplus = x > 20.0f ? x : log1pf(expf(x));
    const float decay_rate = -expf(a_log);
    const float g = __fmul_rn(decay_rate, softplus);
    return has_lower_bound && g < lower_bound ? lower_bound : g;
}

__device__ __forceinline__ float write_strength(float b) {
    return __fdiv_rn(1.0f, __fadd_rn(expf(-b), 1.0f));
}

}  // namespace berrylm::gate
