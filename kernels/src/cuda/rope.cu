// The q/k path of the gated full attention (spec 3.5 steps 2-3): the (1 + w)
// RMSNorm of each head, then the partial NeoX rotary embedding, with the
// rounding points of the CPU reference (round_x: to the dtype of x, RNE):
//
//   n[i] = round_x(x[i] / sqrt(sum(x^2) * inv_width + eps) * scale[i])
//   y[i] = round_x(round_x(n[i] * cos[i]) + round_x(-n[i + R/2] * sin[i]))   i < R/2
//   y[i] = round_x(round_x(n[i] * cos[i]) + round_x(n[i - R/2] * sin[i]))    R/2 <= i < R
//   y[i] = n[i]                                                              i >= R
//
// The norm is norm.cu's (1 + w) kernel: squares rounded to f32 and summed
// (lanes, then the row's warps in warp order), times the f32 `1/D`, + eps,
// the root, a division and the product, each an IEEE f32 operation as on
// the CPU; only the order of the sum differs. Every product and sum of the
// rotation is a separate f32 operation (`__fmul_rn`/`__fadd_rn`: no FMA
// contraction) on values rounded to the dtype, as candle's CPU ops compute
// them.
//
// A row is one head of one token (`D` channels of x, at `x_row_stride`
// elements from the previous row, so that the query half of the per-head
// interleaved q_proj output is read in place); its token, row / heads,
// selects the cos/sin row. One to eight warps per row, by width. A lane
// loads the scales and the cos/sin entries of its channels with its values
// (one round trip to memory before the root, not one after it). A rotated
// channel's partner i -+ R/2 is a value of the same lane where R/2 is a
// multiple of the lanes' stride over the row (BerryLM-OS: R/2 = 32 and 64 at
// head dim 256); otherwise the lane recomputes the partner's `n` from x (the
// same operations, so the same value) instead of exchanging it through
// shared memory.
#include "common.cuh"
#include "norm_rows.cuh"

namespace berrylm::rope {

// n[i] of the value x = x[i] of a row whose root is `rms`.
template <typename T>
__device__ __forceinline__ float normed(float x, float scale, float rms) {
    return berrylm::round_to<T>(__fmul_rn(__fdiv_rn(x, rms), scale));
}

// norm_rows.cuh's layout, a row at a time.
template <typename T>
__global__ void __launch_bounds__(berrylm::norm_rows::kRowThreads)
    offset_rms_norm_rope_kernel(const T* __restrict__ x, long long x_row_stride,
                                const float* __restrict__ scale, const T* __restrict__ cos_table,
                                const T* __restrict__ sin_table, T* __restrict__ out, long long rows,
                                int heads, int width, int rotary, int warps_per_row,
                                float inv_width, float eps) {
    constexpr int kCached = berrylm::norm_rows::kCachedValues;
    const berrylm::norm_rows::RowLanes lanes = berrylm::norm_rows::row_lanes(rows, warps_per_row);
    const long long row = lanes.active ? lanes.row : 0;
    const T* xr = x + row * x_row_stride;
    const long long token = row / heads;
    const T* cr = cos_table + token * rotary;
    const T* sr = sin_table + token * rotary;
    // The scales, cos and sin of the lane's cached channels.
    float lane_scale[kCached];
    float lane_cos[kCached];
    float lane_sin[kCached];
#pragma unroll
    for (int c = 0; c < kCached; ++c) {
        const int i = lanes.first + c * lanes.stride;
        lane_scale[c] = lanes.active && i < width ? scale[i] : 0.0f;
        const bool rotated = lanes.active && i < rotary;
        lane_cos[c] = rotated ? berrylm::to_f32(cr[i]) : 0.0f;
        lane_sin[c] = rotated ? berrylm::to_f32(sr[i]) : 0.0f;
    }
    auto value = [&](int i) { return berrylm::to_f32(xr[i]); };
    berrylm::norm_rows::LaneValues values;
    const float rms =
        berrylm::norm_rows::row_root(lanes, width, warps_per_row, inv_width, eps, value, values);
    if (!lanes.active) return;
    const int half = rotary / 2;
    T* yr = out + lanes.row * width;
    // y[i] from n[i], its partner's n and the rotary entries of channel i.
    auto rotate = [&](int i, float n, float partner_n, float cos_i, float sin_i) {
        const float partner = i < half ? -partner_n : partner_n;
        const float cos_term = berrylm::round_to<T>(__fmul_rn(n, cos_i));
        const float sin_term = berrylm::round_to<T>(__fmul_rn(partner, sin_i));
        yr[i] = berrylm::from_f32<T>(__fadd_rn(cos_term, sin_term));
    };
    // n of a channel j read again from x.
    auto normed_at = [&](int j) { return normed<T>(value(j), scale[j], rms); };

    float n[kCached];
#pragma unroll
    for (int c = 0; c < kCached; ++c) n[c] = normed<T>(values.cached[c], lane_scale[c], rms);
    const bool partners_cached = half % lanes.stride == 0;
    const int shift = half / lanes.stride;
#pragma unroll
    for (int c = 0; c < kCached; ++c) {
        const int i = lanes.first + c * lanes.stride;
        if (i >= width) break;
        if (i >= rotary) {
            yr[i] = berrylm::from_f32<T>(n[c]);
            continue;
        }
        const int partner_c = i < half ? c + shift : c - shift;
        float partner_n = 0.0f;
        if (partners_cached && partner_c < kCached) {
#pragma unroll
            for (int k = 0; k < kCached; ++k) {
                if (k == partner_c) partner_n = n[k];
            }
        } else {
            partner_n = normed_at(i < half ? i + half : i - half);
        }
        rotate(i, n[c], partner_n, lane_cos[c], lane_sin[c]);
    }
    // Channels past the cached ones (rows wider than kCached lanes' strides).
    for (int i = lanes.first + kCached * lanes.stride; i < width; i += lanes.stride) {
        const float n_i = normed_at(i);
        if (i >= rotary) {
            yr[i] = berrylm::from_f32<T>(n_i);
        } else {
            rotate(i, n_i, normed_at(i < half ? i + half : i - half), berrylm::to_f32(cr[i]),
                   berrylm::to_f32(sr[i]));
        }
    }
}

}  // namespace berrylm::rope

using namespace berrylm::rope;

// x: rows of `width` elements at `x_row_stride` (>= width) elements, rows =
// B * T * heads; cos_table, sin_table: contiguous [B * T, rotary]; out:
// contiguous [rows, width]. `inv_width` is 1/width rounded to f32 (what
// candle's mean multiplies by).
extern "C" int berrylm_offset_rms_norm_rope(int dtype, const void* x, long long x_row_stride,
                                            const float* scale, const void* cos_table,
                                            const void* sin_table, void* out, long long rows,
                                            int heads, int width, int rotary, float inv_width,
                                            float eps, void* stream) {
    if (rows == 0) return 0;
    if (heads <= 0 || width <= 0 || x_row_stride < width || rotary <= 0 || rotary % 2 != 0 ||
        rotary > width) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    const unsigned int blocks = berrylm::norm_rows::row_blocks(rows, width);
    if (blocks == 0) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        offset_rms_norm_rope_kernel<T><<<blocks, berrylm::norm_rows::kRowThreads, 0, s>>>(
            static_cast<const T*>(x), x_row_stride, scale, static_cast<const T*>(cos_table),
            static_cast<const T*>(sin_table), static_cast<T*>(out), rows, heads, width, rotary,
            berrylm::norm_rows::warps_per_row(width), inv_width, eps);
    });
    return berrylm::launch_status();
}
