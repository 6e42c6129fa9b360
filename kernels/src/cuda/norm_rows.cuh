// The row layout and root of the (1 + w) RMSNorm (spec 3.1), shared by
// norm.cu (`offset_rms_norm`, `add_offset_rms_norm`) and rope.cu (the q/k
// norms before the rotary embedding).
//
// `warps_per_row` (1, 2, 4 or 8) warps per row, so kRowWarpsPerBlock /
// warps_per_row rows per block; the lanes of a row's warps stride over it
// together (coalesced), and the row's warp sums are added in warp order. The
// root is sqrt(sum(v^2) * inv_width + eps) evaluated with the CPU
// reference's operations (each square rounded to f32 before it is summed,
// the sum times the f32 `1/D`, + eps, sqrt), so for the same sum of squares
// it is the CPU's bit for bit; only the order of the sum differs.
//
// A lane keeps its first kCachedValues values in registers (all of them up
// to width 2048), loaded together rather than one after another, so a
// row's second pass reads no memory for them.
//
// Rows of a multiple of 8 up to 4096 wide may instead take the vector
// layout: one block a row, thread t owning the elements [8t, 8t + 8)
// (vec_row_root, vec_row_normed), which norm.cu's vector kernel and
// attn_res.cu's fused norm share.
#pragma once

#include "common.cuh"

namespace berrylm::norm_rows {

constexpr int kRowWarpsPerBlock = 8;
constexpr int kRowThreads = kRowWarpsPerBlock * 32;

// At most 8 values per thread up to width 2048; a whole block per row from
// width 1025 on.
inline int warps_per_row(int width) {
    return width <= 256 ? 1 : width <= 512 ? 2 : width <= 1024 ? 4 : 8;
}

// Blocks of kRowThreads threads for `rows` rows of `width`; 0 when the
// grid would exceed the launch limit.
inline unsigned int row_blocks(long long rows, int width) {
    const int rows_per_block = kRowWarpsPerBlock / warps_per_row(width);
    const long long blocks = (rows + rows_per_block - 1) / rows_per_block;
    return blocks > 0x7fffffffll ? 0u : static_cast<unsigned int>(blocks);
}

// This thread's place in the layout: its row (`active` unless the block
// runs past the last row), its first element and the stride over the row.
struct RowLanes {
    long long row;
    bool active;
    int first;
    int stride;
};

__device__ __forceinline__ RowLanes row_lanes(long long rows, int warps_per_row) {
    const int warp = static_cast<int>(threadIdx.x >> 5);
    const int rows_per_block = kRowWarpsPerBlock / warps_per_row;
    const long long row =
        static_cast<long long>(blockIdx.x) * rows_per_block + warp / warps_per_row;
    const int lane = static_cast<int>(threadIdx.x & 31);
    return RowLanes{row, row < rows, (warp % warps_per_row) * 32 + lane, warps_per_row * 32};
}

constexpr int kCachedValues = 8;

// A lane's values of its row: the j-th is value(first + j * stride), the
// first kCachedValues of them in `cached`.
struct LaneValues {
    float cached[kCachedValues];

    // visit(i, value(i)) for each of the lane's i in order, the cached
    // values taken from the registers.
    template <typename Value, typename Visit>
    __device__ __forceinline__ void for_each(const RowLanes& lanes, int width, Value value,
                                             Visit visit) const {
#pragma unroll
        for (int j = 0; j < kCachedValues; ++j) {
            const int i = lanes.first + j * lanes.stride;
            if (i < width) visit(i, cached[j]);
        }
        for (int i = lanes.first + kCachedValues * lanes.stride; i < width; i += lanes.stride) {
            visit(i, value(i));
        }
    }
};

// The root of the row whose i-th value is `value(i)` (f32), the lane's
// values kept in `values`. Every thread of the block calls it (it
// synchronises the block when a row spans warps); inactive lanes contribute
// nothing.
template <typename Value>
__device__ __forceinline__ float row_root(const RowLanes& lanes, int width, int warps_per_row,
                                          float inv_width, float eps, Value value,
                                          LaneValues& values) {
    __shared__ float partial[kRowWarpsPerBlock];
    float sum_sq = 0.0f;
    if (lanes.active) {
#pragma unroll
        for (int j = 0; j < kCachedValues; ++j) {
            const int i = lanes.first + j * lanes.stride;
            values.cached[j] = i < width ? value(i) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kCachedValues; ++j) {
            const float v = values.cached[j];
            if (lanes.first + j * lanes.stride < width) sum_sq = __fadd_rn(sum_sq, __fmul_rn(v, v));
        }
        for (int i = lanes.first + kCachedValues * lanes.stride; i < width; i += lanes.stride) {
            const float v = value(i);
            sum_sq = __fadd_rn(sum_sq, __fmul_rn(v, v));
        }
    }
    sum_sq = berrylm::warp_sum(sum_sq);
    if (warps_per_row > 1) {  // uniform over the block
        const int warp = static_cast<int>(threadIdx.x >> 5);
        const int group = warp / warps_per_row;
        if ((threadIdx.x & 31) == 0) partial[warp] = sum_sq;
        __syncthreads();
        sum_sq = 0.0f;
        for (int w = 0; w < warps_per_row; ++w) {
            sum_sq = __fadd_rn(sum_sq, partial[group * warps_per_row + w]);
        }
    }
    return __fsqrt_rn(__fadd_rn(__fmul_rn(sum_sq, inv_width), eps));
}

// Elements a thread owns in the vector layout (berrylm::store8's).
constexpr int kVecElements = 8;

// The root of a row in the vector layout from each thread's values `v`
// (zeros past the row's end): the squares summed over the thread's 8, then
// the warp, then the block's warps in order. Every thread of the block calls
// it; `partial` is shared memory of one float a warp.
__device__ __forceinline__ float vec_row_root(const float (&v)[kVecElements], float* partial,
                                              float inv_width, float eps) {
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecElements; ++i) sum_sq = __fadd_rn(sum_sq, __fmul_rn(v[i], v[i]));
    sum_sq = berrylm::warp_sum(sum_sq);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum_sq;
    __syncthreads();
    float total = 0.0f;
    for (int k = 0; k < static_cast<int>(blockDim.x >> 5); ++k) total = __fadd_rn(total, partial[k]);
    return __fsqrt_rn(__fadd_rn(__fmul_rn(total, inv_width), eps));
}

// A thread's normed values v / rms * scale (rounded when stored).
__device__ __forceinline__ void vec_row_normed(const float (&v)[kVecElements], float rms,
                                               const float (&scale)[kVecElements],
                                               float (&y)[kVecElements]) {
#pragma unroll
    for (int i = 0; i < kVecElements; ++i) y[i] = __fmul_rn(__fdiv_rn(v[i], rms), scale[i]);
}

}  // namespace berrylm::norm_rows
