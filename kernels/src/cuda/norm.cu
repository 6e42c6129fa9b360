// The RMSNorms of spec 3.1.
//
// Gated RMSNorm, norm before gate, SiLU (BerryLMRMSNormGated):
//   x  = round_x(x)                             (x read as f32 or in the dtype)
//   n  = round_x(x / sqrt(mean(x^2) + eps))     (f32)
//   wn = round_x(weight * n)
//   y  = round_x(wn * silu(z))                  (z in f32)
// One warp per row; each lane strides over the row (coalesced); the row's
// arithmetic is gated_norm.cuh's (the fused KDA decode step shares it).
//
// (1 + w) RMSNorm (BerryLMRMSNorm), `scale` = 1 + w in f32:
//   y  = round_x(x / sqrt(sum(x^2) * inv_width + eps) * scale)    (f32)
// optionally of a residual sum x = round_x(x + delta), also written out.
// evaluated with the operations and rounding points of the CPU reference
// (candle's sqr, mean_keepdim = sum times the f32 `1/D`, + eps, sqrt,
// division, product): every square is rounded to f32 before it is summed, the
// mean is the sum times `inv_width` (not a division by D), and x is divided by
// the root (not multiplied by its reciprocal), so for the same sum of squares
// the f32 value before the final rounding is the CPU's bit for bit. Only the
// order of the sum differs (lanes, then warps, vs. candle's sequential or
// SIMD-lane sum). Rows of a multiple of 8 up to 4096 wide (BerryLM's hidden
// size) take a block each, 8 elements a thread in 16-byte vectors; others
// one to eight warps per row, by width.
#include "common.cuh"
#include "gated_norm.cuh"
#include "norm_rows.cuh"
#include "weight_rows.cuh"

namespace berrylm::norm {

constexpr int kWarpsPerBlock = 8;

// TX: the output dtype; TIn: x's (TX or f32); TZ: z's (TX or f32).
template <typename TX, typename TIn, typename TZ>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gated_rms_norm_kernel(const TIn* __restrict__ x, const TZ* __restrict__ z,
                          const float* __restrict__ weight, TX* __restrict__ out, long long rows,
                          int width, float eps) {
    const int lane = threadIdx.x & 31;
    const long long row = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
    if (row >= rows) return;
    const TIn* xr = x + row * width;
    const TZ* zr = z + row * width;
    TX* yr = out + row * width;
    auto value = [&](int i) { return berrylm::round_to<TX>(berrylm::to_f32(xr[i])); };
    const float inv_rms = berrylm::gated_norm::inverse_rms(value, width, eps, lane);
    for (int i = lane; i < width; i += 32) {
        yr[i] = berrylm::gated_norm::gated_output<TX>(value(i), inv_rms, weight[i],
                                                      berrylm::to_f32(zr[i]));
    }
}

// (1 + w) RMSNorm in norm_rows.cuh's layout, of x or of round_x(x + delta)
// (then also written to `sum_out`).
template <typename T>
__global__ void __launch_bounds__(berrylm::norm_rows::kRowThreads)
    offset_rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ delta,
                           const float* __restrict__ scale, T* __restrict__ sum_out,
                           T* __restrict__ out, long long rows, int width, int warps_per_row,
                           float inv_width, float eps) {
    const berrylm::norm_rows::RowLanes lanes = berrylm::norm_rows::row_lanes(rows, warps_per_row);
    const long long offset = (lanes.active ? lanes.row : 0) * width;
    auto value = [&](int i) {
        const float v = berrylm::to_f32(x[offset + i]);
        return delta == nullptr
                   ? v
                   : berrylm::round_to<T>(__fadd_rn(v, berrylm::to_f32(delta[offset + i])));
    };
    berrylm::norm_rows::LaneValues values;
    const float rms =
        berrylm::norm_rows::row_root(lanes, width, warps_per_row, inv_width, eps, value, values);
    if (!lanes.active) return;
    values.for_each(lanes, width, value, [&](int i, float v) {
        if (sum_out != nullptr) sum_out[offset + i] = berrylm::from_f32<T>(v);
        out[offset + i] = berrylm::from_f32<T>(__fmul_rn(__fdiv_rn(v, rms), scale[i]));
    });
}

// The same norm where a row's width is a multiple of 8 and at most 4096 and
// every pointer is 16-byte aligned: one block a row, thread t owning the
// elements [8t, 8t + 8), read (with its scale) and written as 16-byte
// vectors, so that a row waits for memory once before its sum (the scale is
// loaded with x) instead of for scalar loads on both sides of it. The sum of
// squares runs over a thread's 8 values, then the warp, then the warps in
// order.
using berrylm::norm_rows::kVecElements;
constexpr int kVecMaxThreads = 512;

template <typename T>
__global__ void __launch_bounds__(kVecMaxThreads)
    offset_rms_norm_vec_kernel(const T* __restrict__ x, const T* __restrict__ delta,
                               const float* __restrict__ scale, T* __restrict__ sum_out,
                               T* __restrict__ out, int width, float inv_width, float eps) {
    __shared__ float partial[kVecMaxThreads / 32];
    const long long offset = static_cast<long long>(blockIdx.x) * width;
    const int first = static_cast<int>(threadIdx.x) * kVecElements;
    const bool active = first < width;
    float v[kVecElements] = {};
    float w[kVecElements] = {};
    if (active) {
        berrylm::rows::load_vec<T, kVecElements>(x + offset + first, v);
        if (delta != nullptr) {
            float d[kVecElements];
            berrylm::rows::load_vec<T, kVecElements>(delta + offset + first, d);
#pragma unroll
            for (int i = 0; i < kVecElements; ++i) {
                v[i] = berrylm::round_to<T>(__fadd_rn(v[i], d[i]));
            }
        }
        berrylm::rows::load_vec<float, kVecElements>(scale + first, w);
    }
    const float rms = berrylm::norm_rows::vec_row_root(v, partial, inv_width, eps);
    if (!active) return;
    if (sum_out != nullptr) berrylm::store8(sum_out + offset + first, v);
    float y[kVecElements];
    berrylm::norm_rows::vec_row_normed(v, rms, w, y);
    berrylm::store8(out + offset + first, y);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The norm above of a decode step's residual sums, projected by a dense
// weight [out_dim, width] (the MoE block's input projection after the
// post-attention norm): the sums, the normed rows and their products, each
// the value the vector norm kernel and quantized_matmul.cu's dense GEMV give
// (the same operations in the same order), in one launch. A block of
// kProjectThreads threads has one output column a warp, as the GEMV; it
// first issues the loads of its warps' first kHeldPieces weight pieces (a
// whole 2048-wide bf16 row), which do not depend on the norm, then norms
// every row of the step in the vector layout (width <= 8 * kProjectThreads)
// into shared memory, block 0 writing the sums and normed rows out, and
// takes the products' activations from there.
constexpr int kProjectThreads = 256;
constexpr int kProjectWarps = kProjectThreads / 32;
constexpr int kHeldPieces = 8;

template <typename T, int TOKENS>
__global__ void __launch_bounds__(kProjectThreads)
    add_offset_rms_norm_matmul_kernel(const T* __restrict__ x, const T* __restrict__ delta,
                                      const float* __restrict__ scale, T* __restrict__ sum_out,
                                      T* __restrict__ normed_out, const T* __restrict__ weight,
                                      T* __restrict__ y, int tokens, int width, int out_dim,
                                      float inv_width, float eps) {
    constexpr int kVec = berrylm::rows::kPerVector<T>;
    extern __shared__ uint4 staged[];  // [tokens][width] of T, normed
    __shared__ float partial[kProjectWarps];
    const int lane = threadIdx.x & 31;
    const int column = blockIdx.x * kProjectWarps + (threadIdx.x >> 5);
    const bool has_column = column < out_dim;
    const int pieces = width / kVec;
    const uint4* row = reinterpret_cast<const uint4*>(weight) +
                       static_cast<long long>(has_column ? column : 0) * pieces;
    uint4 held[kHeldPieces];
#pragma unroll
    for (int k = 0; k < kHeldPieces; ++k) {
        const int piece = lane + 32 * k;
        if (has_column && piece < pieces) held[k] = __ldg(row + piece);
    }

    const int first = static_cast<int>(threadIdx.x) * kVecElements;
    const bool active = first < width;
    float w[kVecElements] = {};
    if (active) berrylm::rows::load_vec<float, kVecElements>(scale + first, w);
    T* staged_rows = reinterpret_cast<T*>(staged);
    for (int t = 0; t < tokens; ++t) {
        const long long offset = static_cast<long long>(t) * width + first;
        float v[kVecElements] = {};
        if (active) {
            berrylm::rows::load_vec<T, kVecElements>(x + offset, v);
            float d[kVecElements];
            berrylm::rows::load_vec<T, kVecElements>(delta + offset, d);
#pragma unroll
            for (int i = 0; i < kVecElements; ++i) {
                v[i] = berrylm::round_to<T>(__fadd_rn(v[i], d[i]));
            }
        }
        const float rms = berrylm::norm_rows::vec_row_root(v, partial, inv_width, eps);
        if (active) {
            float normed[kVecElements];
            berrylm::norm_rows::vec_row_normed(v, rms, w, normed);
            berrylm::store8(staged_rows + offset, normed);
            if (blockIdx.x == 0) {
                berrylm::store8(sum_out + offset, v);
                berrylm::store8(normed_out + offset, normed);
            }
        }
        __syncthreads();  // the staged row is complete; `partial` is free again
    }
    if (!has_column) return;

    // DenseRows' products: pieces lane, lane + 32, ... in order, each one's
    // elements in order, then the warp's sum.
    float sum[TOKENS];
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) sum[t] = 0.0f;
    auto accumulate = [&](const uint4& raw, int piece) {
        float wv[kVec];
        berrylm::rows::unpack_vector<T>(raw, wv);
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            if (t < tokens) {
                float xv[kVec];
                berrylm::rows::unpack_vector<T>(staged[t * pieces + piece], xv);
#pragma unroll
                for (int i = 0; i < kVec; ++i) sum[t] = fmaf(wv[i], xv[i], sum[t]);
            }
        }
    };
#pragma unroll
    for (int k = 0; k < kHeldPieces; ++k) {
        const int piece = lane + 32 * k;
        if (piece < pieces) accumulate(held[k], piece);
    }
    for (int piece = lane + 32 * kHeldPieces; piece < pieces; piece += 32) {
        accumulate(__ldg(row + piece), piece);
    }
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
        if (t < tokens) {
            const float total = berrylm::warp_sum(sum[t]);
            if (lane == 0) {
                y[static_cast<long long>(t) * out_dim + column] = berrylm::from_f32<T>(total);
            }
        }
    }
}

template <typename TX, typename TIn, typename TZ>
void launch_gated(const void* x, const void* z, const float* weight, void* out, long long rows,
                  int width, float eps, unsigned int blocks, cudaStream_t stream) {
    gated_rms_norm_kernel<TX, TIn, TZ><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        static_cast<const TIn*>(x), static_cast<const TZ*>(z), weight, static_cast<TX*>(out),
        rows, width, eps);
}

}  // namespace berrylm::norm

using namespace berrylm::norm;

// `x_dtype` and `z_dtype` must each equal `out_dtype` or be f32.
extern "C" int berrylm_gated_rms_norm(int out_dtype, int x_dtype, int z_dtype, const void* x,
                                      const void* z, const float* weight, void* out,
                                      long long rows, int width, float eps, void* stream) {
    if (rows == 0 || width == 0) return 0;
    for (const int dtype : {x_dtype, z_dtype}) {
        if (dtype != out_dtype && dtype != berrylm::kF32) {
            return static_cast<int>(cudaErrorInvalidValue);
        }
    }
    const long long blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    if (blocks > 0x7fffffffll) return static_cast<int>(cudaErrorInvalidValue);
    const unsigned int grid = static_cast<unsigned int>(blocks);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool x_wide = x_dtype != out_dtype, z_wide = z_dtype != out_dtype;
    BERRYLM_DISPATCH_DTYPE(out_dtype, TX, {
        if (x_wide && z_wide) {
            launch_gated<TX, float, float>(x, z, weight, out, rows, width, eps, grid, s);
        } else if (x_wide) {
            launch_gated<TX, float, TX>(x, z, weight, out, rows, width, eps, grid, s);
        } else if (z_wide) {
            launch_gated<TX, TX, float>(x, z, weight, out, rows, width, eps, grid, s);
        } else {
            launch_gated<TX, TX, TX>(x, z, weight, out, rows, width, eps, grid, s);
        }
    });
    return berrylm::launch_status();
}

// `inv_width` is 1/width rounded to f32 (what candle's mean multiplies by).
// With `delta` (else null), the row normed is round_x(x + delta), which is
// also written to `sum_out`.
extern "C" int berrylm_offset_rms_norm(int x_dtype, const void* x, const void* delta,
                                       const float* scale, void* sum_out, void* out,
                                       long long rows, int width, float inv_width, float eps,
                                       void* stream) {
    if (rows == 0 || width == 0) return 0;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool vector = width % kVecElements == 0 && width / kVecElements <= kVecMaxThreads &&
                        rows <= 0x7fffffffll && aligned16(x) && aligned16(delta) &&
                        aligned16(scale) && aligned16(sum_out) && aligned16(out);
    if (vector) {
        const int threads = (width / kVecElements + 31) / 32 * 32;
        BERRYLM_DISPATCH_DTYPE(x_dtype, T, {
            offset_rms_norm_vec_kernel<T><<<static_cast<unsigned int>(rows), threads, 0, s>>>(
                static_cast<const T*>(x), static_cast<const T*>(delta), scale,
                static_cast<T*>(sum_out), static_cast<T*>(out), width, inv_width, eps);
        });
        return berrylm::launch_status();
    }
    const unsigned int blocks = berrylm::norm_rows::row_blocks(rows, width);
    if (blocks == 0) return static_cast<int>(cudaErrorInvalidValue);
    BERRYLM_DISPATCH_DTYPE(x_dtype, T, {
        offset_rms_norm_kernel<T><<<blocks, berrylm::norm_rows::kRowThreads, 0, s>>>(
            static_cast<const T*>(x), static_cast<const T*>(delta), scale,
            static_cast<T*>(sum_out), static_cast<T*>(out), rows, width,
            berrylm::norm_rows::warps_per_row(width), inv_width, eps);
    });
    return berrylm::launch_status();
}

// The residual sums `x + delta` [tokens, width], their norm (as
// berrylm_offset_rms_norm) and its product with `weight` [out_dim, width]
// (as berrylm_dense_matmul), all in `dtype`, in one kernel. Returns
// cudaErrorNotSupported, launching nothing, unless the step has at most 8
// rows whose widths are a multiple of 8 up to 2048, staged within 48 KiB,
// with every pointer 16-byte aligned.
extern "C" int berrylm_add_offset_rms_norm_matmul(int dtype, const void* x, const void* delta,
                                                  const float* scale, void* sum_out,
                                                  void* normed_out, const void* weight, void* y,
                                                  int tokens, int width, int out_dim,
                                                  float inv_width, float eps, void* stream) {
    if (tokens == 0 || out_dim == 0) return 0;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        const size_t staged_bytes = static_cast<size_t>(tokens) * width * sizeof(T);
        const bool taken = tokens <= berrylm::rows::kTokens && width > 0 &&
                           width % kVecElements == 0 &&
                           width <= kVecElements * kProjectThreads &&
                           staged_bytes <= 48 * 1024 && aligned16(x) && aligned16(delta) &&
                           aligned16(scale) && aligned16(sum_out) && aligned16(normed_out) &&
                           aligned16(weight) && aligned16(y);
        if (!taken) return static_cast<int>(cudaErrorNotSupported);
        const unsigned int blocks =
            static_cast<unsigned int>((out_dim + kProjectWarps - 1) / kProjectWarps);
        berrylm::rows::with_group_size(tokens, [&](auto group) {
            add_offset_rms_norm_matmul_kernel<T, decltype(group)::value>
                <<<blocks, kProjectThreads, staged_bytes, s>>>(
                    static_cast<const T*>(x), static_cast<const T*>(delta), scale,
                    static_cast<T*>(sum_out), static_cast<T*>(normed_out),
                    static_cast<const T*>(weight), static_cast<T*>(y), tokens, width, out_dim,
                    inv_width, eps);
        });
        return berrylm::launch_status();
    });
    return 0;
}
