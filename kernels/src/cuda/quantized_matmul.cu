// y = x [W; D]^T for a few rows of x (decode): W [quantized_rows, in] in GGUF
// blocks, then D [dense_rows, in] in the activation dtype (none when
// dense_rows is 0): the full-precision projections of the same input, which
// a model keeps unquantized beside the quantized ones, in the same launch.
// One warp per output column j streams its weight row once per group of up
// to TOKENS rows of x (1 for a single row, else kTokens), decoding blocks on
// the fly (weight_rows.cuh), and writes y[n, j] = round_x(the f32 dot
// product). x and y in the activation dtype: no cast of x, no quantized copy
// of it, no f32 output.
#include "common.cuh"
#include "weight_rows.cuh"

namespace berrylm::quantized_matmul {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Column j of y: `row` (in the format `Rows`) against every row of x.
template <typename T, typename Rows, int TOKENS>
__device__ __forceinline__ void write_column(const typename Rows::Weight* row, const T* x, T* y,
                                             int tokens, int in_dim, int out_dim, int j) {
    const int lane = threadIdx.x & 31;
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

template <typename T, typename Rows, typename Dense, int TOKENS>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ weight,
                const T* __restrict__ dense, T* __restrict__ y, int tokens, int in_dim,
                int quantized_rows, int out_dim) {
    const int j = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (j >= out_dim) return;
    if (j < quantized_rows) {
        write_column<T, Rows, TOKENS>(Rows::row(weight, j, in_dim), x, y, tokens, in_dim,
                                      out_dim, j);
    } else {
        write_column<T, Dense, TOKENS>(Dense::row(dense, j - quantized_rows, in_dim), x, y,
                                       tokens, in_dim, out_dim, j);
    }
}

// The dense rows alone: one warp per output column, as above.
template <typename T, typename Dense, int TOKENS>
__global__ void __launch_bounds__(kThreads)
    dense_gemv_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ y,
                      int tokens, int in_dim, int out_dim) {
    const int j = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (j >= out_dim) return;
    write_column<T, Dense, TOKENS>(Dense::row(weight, j, in_dim), x, y, tokens, in_dim, out_dim, j);
}

template <typename T, typename Dense>
void launch_dense(const T* x, const T* weight, T* y, int tokens, int in_dim, int out_dim,
                  cudaStream_t stream) {
    const unsigned int blocks = static_cast<unsigned int>((out_dim + kWarps - 1) / kWarps);
    berrylm::rows::with_group_size(tokens, [&](auto group) {
        dense_gemv_kernel<T, Dense, decltype(group)::value><<<blocks, kThreads, 0, stream>>>(
            x, weight, y, tokens, in_dim, out_dim);
    });
}

template <typename T, typename Rows, typename Dense>
void launch(const T* x, const uint8_t* weight, const T* dense, T* y, int tokens, int in_dim,
            int quantized_rows, int out_dim, cudaStream_t stream) {
    const unsigned int blocks = static_cast<unsigned int>((out_dim + kWarps - 1) / kWarps);
    berrylm::rows::with_group_size(tokens, [&](auto group) {
        gemv_kernel<T, Rows, Dense, decltype(group)::value><<<blocks, kThreads, 0, stream>>>(
            x, weight, dense, y, tokens, in_dim, quantized_rows, out_dim);
    });
}

}  // namespace berrylm::quantized_matmul

using namespace berrylm::quantized_matmul;

// `x` [tokens, in_dim] (16-byte aligned), `weight` [quantized_rows, in_dim]
// in GGUF blocks of the format `format` (`GgufCode`; in_dim a multiple of its
// block), `dense` [dense_rows, in_dim] contiguous in the dtype of x (ignored
// when dense_rows is 0), `y` [tokens, quantized_rows + dense_rows].
extern "C" int berrylm_quantized_matmul(int dtype, int format, const void* x, const void* weight,
                                        const void* dense, void* y, int tokens, int in_dim,
                                        int quantized_rows, int dense_rows, void* stream) {
    const long long out_dim = static_cast<long long>(quantized_rows) + dense_rows;
    if (tokens == 0 || out_dim == 0) return 0;
    if (in_dim <= 0 || quantized_rows < 0 || dense_rows < 0 || out_dim > INT_MAX ||
        (reinterpret_cast<uintptr_t>(x) & 15u) != 0) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        constexpr int kVec = 16 / static_cast<int>(sizeof(T));
        const bool vectorized =
            in_dim % kVec == 0 && (reinterpret_cast<uintptr_t>(dense) & 15u) == 0;
        BERRYLM_DISPATCH_GGUF(format, Rows, {
            if (in_dim % Rows::kBlockWeights != 0) return static_cast<int>(cudaErrorInvalidValue);
            const auto* xp = static_cast<const T*>(x);
            const auto* wp = static_cast<const uint8_t*>(weight);
            const auto* dp = static_cast<const T*>(dense);
            auto* yp = static_cast<T*>(y);
            if (vectorized) {
                launch<T, Rows, berrylm::rows::DenseRows<T, kVec>>(
                    xp, wp, dp, yp, tokens, in_dim, quantized_rows, static_cast<int>(out_dim), s);
            } else {
                launch<T, Rows, berrylm::rows::DenseRows<T, 1>>(
                    xp, wp, dp, yp, tokens, in_dim, quantized_rows, static_cast<int>(out_dim), s);
            }
            return berrylm::launch_status();
        });
    });
    return 0;
}

// `x` [tokens, in_dim] and `weight` [out_dim, in_dim], both contiguous in
// `dtype`; `y` [tokens, out_dim]: the full-precision projection of a decode
// step in the kernel above (f32 products and sums, each output rounded once).
extern "C" int berrylm_dense_matmul(int dtype, const void* x, const void* weight, void* y,
                                    int tokens, int in_dim, int out_dim, void* stream) {
    if (tokens == 0 || out_dim == 0) return 0;
    if (in_dim <= 0) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        constexpr int kVec = 16 / static_cast<int>(sizeof(T));
        const bool vectorized = in_dim % kVec == 0 &&
                                (reinterpret_cast<uintptr_t>(x) & 15u) == 0 &&
                                (reinterpret_cast<uintptr_t>(weight) & 15u) == 0;
        const auto* xp = static_cast<const T*>(x);
        const auto* wp = static_cast<const T*>(weight);
        auto* yp = static_cast<T*>(y);
        if (vectorized) {
            launch_dense<T, berrylm::rows::DenseRows<T, kVec>>(xp, wp, yp, tokens, in_dim, out_dim,
                                                              s);
        } else {
            launch_dense<T, berrylm::rows::DenseRows<T, 1>>(xp, wp, yp, tokens, in_dim, out_dim, s);
        }
        return berrylm::launch_status();
    });
    return 0;
}
