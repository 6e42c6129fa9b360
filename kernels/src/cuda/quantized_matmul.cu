// y = x W^T for a few rows of x (decode) and W in GGUF blocks: one warp per
// output column j streams row j of W once per group of up to TOKENS rows of
// x (1 for a single row, else kTokens), decoding its blocks on the fly
// (weight_rows.cuh), and writes y[n, j] = round_x(the f32 dot product). One
// launch, x and y in the activation dtype: no cast of x, no quantized copy of
// it, no f32 output.
#include "common.cuh"
#include "weight_rows.cuh"

namespace berrylm::quantized_matmul {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename T, typename Rows, int TOKENS>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ weight, T* __restrict__ y,
                int tokens, int in_dim, int out_dim) {
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (j >= out_dim) return;
    const uint8_t* row = Rows::row(weight, j, in_dim);
    for (int t0 = 0; t0 < tokens; t0 += TOKENS) {
        const int count = min(TOKENS, tokens - t0);
        float sum[TOKENS];
        berrylm::rows::stream_row<Rows, TOKENS>(row, in_dim, count, sum, [&](int t) {
            return x + static_cast<long long>(t0 + t) * in_dim;
        });
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            if (t < count) {
                const float total = berrylm::warp_sum(sum[t]);
                if (lane == 0) {
                    y[static_cast<long long>(t0 + t) * out_dim + j] = berrylm::from_f32<T>(total);
                }
            }
        }
    }
}

}  // namespace berrylm::quantized_matmul

using namespace berrylm::quantized_matmul;

// `x` [tokens, in_dim] (16-byte aligned), `weight` [out_dim, in_dim] in GGUF
// blocks of the format `format` (`GgufCode`; in_dim a multiple of its block),
// `y` [tokens, out_dim].
extern "C" int berrylm_quantized_matmul(int dtype, int format, const void* x, const void* weight,
                                        void* y, int tokens, int in_dim, int out_dim,
                                        void* stream) {
    if (tokens == 0 || out_dim == 0) return 0;
    if (in_dim <= 0 || (reinterpret_cast<uintptr_t>(x) & 15u) != 0) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const unsigned int blocks = static_cast<unsigned int>((out_dim + kWarps - 1) / kWarps);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        BERRYLM_DISPATCH_GGUF(format, Rows, {
            if (in_dim % Rows::kBlockWeights != 0) return static_cast<int>(cudaErrorInvalidValue);
            berrylm::rows::with_group_size(tokens, [&](auto group) {
                gemv_kernel<T, Rows, decltype(group)::value><<<blocks, kThreads, 0, s>>>(
                    static_cast<const T*>(x), static_cast<const uint8_t*>(weight),
                    static_cast<T*>(y), tokens, in_dim, out_dim);
            });
            return berrylm::launch_status();
        });
    });
    return 0;
}
