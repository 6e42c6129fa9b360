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
// writing a rotated channel recomputes its partner's `n` from x (the same
// operations, so the same value) instead of exchanging it through shared
// memory.
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
    const berrylm::norm_rows::RowLanes lanes = berrylm::norm_rows::row_lanes(rows, warps_per_row);
    const T* xr = x + (lanes.active ? lanes.row : 0) * x_row_stride;
    auto value = [&](int i) { return berrylm::to_f32(xr[i]); };
    berrylm::norm_rows::LaneValues values;
    const float rms =
        berrylm::norm_rows::row_root(lanes, width, warps_per_row, inv_width, eps, value, values);
    if (!lanes.active) return;
    const int half = rotary / 2;
    const long long token = lanes.row / heads;
    const T* cr = cos_table + token * rotary;
    const T* sr = sin_table + token * rotary;
    T* yr = out + lanes.row * width;
    values.for_each(lanes, width, value, [&](int i, float x_i) {
        const float n = normed<T>(x_i, scale[i], rms);
        if (i >= rotary) {
            yr[i] = berrylm::from_f32<T>(n);
            return;
        }
        const int j = i < half ? i + half : i - half;
        const float partner_n = normed<T>(value(j), scale[j], rms);
        const float partner = i < half ? -partner_n : partner_n;
        const float cos_term = berrylm::round_to<T>(__fmul_rn(n, berrylm::to_f32(cr[i])));
        const float sin_term = berrylm::round_to<T>(__fmul_rn(partner, berrylm::to_f32(sr[i])));
        yr[i] = berrylm::from_f32<T>(__fadd_rn(cos_term, sin_term));
    });
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
