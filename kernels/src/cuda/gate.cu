// KDA forget gate (spec 3.6 step 3), elementwise:
//   g[n, h, c] = -exp(a_log[h]) * softplus(raw[n, h*dk + c] + dt_bias[h*dk + c])
// with softplus(x) = x above 20, log1p(exp(x)) otherwise, then the optional
// clamp g = max(g, lower_bound). All in f32, output f32.
//
// KDA write strength, elementwise: beta = 1 / (exp(-b) + 1) in f32.
//
// The per-channel formulas are gate.cuh's, which the fused decode step of
// recurrence.cu computes too.
#include "common.cuh"
#include "gate.cuh"

namespace berrylm::gate {

template <typename T>
__global__ void kda_gate_kernel(const T* __restrict__ raw, const float* __restrict__ a_log,
                                const float* __restrict__ dt_bias, float* __restrict__ out,
                                long long total, int width, int head_dim, int has_lower_bound,
                                float lower_bound) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += stride) {
        const int channel = static_cast<int>(i % width);
        out[i] = forget_gate(berrylm::to_f32(raw[i]), dt_bias[channel], a_log[channel / head_dim],
                             has_lower_bound != 0, lower_bound);
    }
}

// `b` as rows of `width`, `b_stride` elements apart; `out` contiguous.
template <typename T>
__global__ void kda_beta_kernel(const T* __restrict__ b, long long b_stride,
                                float* __restrict__ out, long long total, int width) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
         i += stride) {
        const long long row = i / width;
        out[i] = write_strength(berrylm::to_f32(b[row * b_stride + (i - row * width)]));
    }
}

}  // namespace berrylm::gate

using namespace berrylm::gate;

extern "C" int berrylm_kda_gate(int raw_dtype, const void* raw, const float* a_log,
                                const float* dt_bias, float* out, long long tokens, int width,
                                int head_dim, int has_lower_bound, float lower_bound,
                                void* stream) {
    const long long total = tokens * width;
    if (total == 0) return 0;
    const int threads = 256;
    const unsigned int blocks = berrylm::elementwise_blocks(total, threads);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(raw_dtype, T, {
        kda_gate_kernel<T><<<blocks, threads, 0, s>>>(static_cast<const T*>(raw), a_log, dt_bias,
                                                      out, total, width, head_dim,
                                                      has_lower_bound, lower_bound);
    });
    return berrylm::launch_status();
}

// `b`: `rows` rows of `width` elements, row r starting `b_stride` >= width
// elements after row r - 1 (the b columns of a KDA layer's stacked input
// projection are read in place).
extern "C" int berrylm_kda_beta(int b_dtype, const void* b, long long b_stride, float* out,
                                long long rows, int width, void* stream) {
    const long long total = rows * width;
    if (total == 0) return 0;
    if (b_stride < width) return static_cast<int>(cudaErrorInvalidValue);
    const int threads = 256;
    const unsigned int blocks = berrylm::elementwise_blocks(total, threads);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(b_dtype, T, {
        kda_beta_kernel<T><<<blocks, threads, 0, s>>>(static_cast<const T*>(b), b_stride, out,
                                                      total, width);
    });
    return berrylm::launch_status();
}
