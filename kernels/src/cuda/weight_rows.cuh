// How the GEMV kernels (moe.cu's decode kernels, quantized_matmul.cu) walk
// the rows of a weight matrix `[rows, width]`: in full precision (elements of
// the activation dtype) or in GGUF blocks (ggml's q8_0 and q4_K, laid out as
// candle stores them: a row's blocks end to end, rows end to end).
//
// A warp reads a row as pieces, lane `l` taking pieces l, l + 32, ...; a
// piece is kRuns runs of kRunLen consecutive columns, and a format gives
//   Weight                 the element type of the matrix's memory,
//   row(matrix, i, width)  the address of row i,
//   pieces(width)          the pieces of a row,
//   column(p, r)           the first column of run r of piece p,
//   load(row, p)           piece p decoded,
//   accumulate(piece, x, acc)
//                          acc plus the piece's share of the dot product with
//                          x[r][v], the activations at the piece's columns.
// A quantized weight is read as ggml defines its value (d * q for q8_0,
// d * sc * q - dmin * m for q4_K, in f32); the dot product factors the block
// scales out of the sums of the piece's runs.
#pragma once

#include "common.cuh"

namespace berrylm::rows {

// VEC consecutive elements of T into f32, with 16-byte loads when VEC > 1
// (`p` 16-byte aligned).
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[VEC]) {
    if constexpr (VEC == 1) {
        out[0] = berrylm::to_f32(*p);
    } else {
        constexpr int kPerLoad = 16 / static_cast<int>(sizeof(T));
        static_assert(VEC % kPerLoad == 0, "whole 16-byte vectors");
#pragma unroll
        for (int chunk = 0; chunk < VEC / kPerLoad; ++chunk) {
            const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p) + chunk);
            const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int i = 0; i < kPerLoad; ++i) out[chunk * kPerLoad + i] = berrylm::to_f32(values[i]);
        }
    }
}

// Rows of T (the activation dtype), VEC consecutive elements a piece; the
// dot product is one f32 fma per element, in column order within a lane.
template <typename T, int VEC>
struct DenseRows {
    using Weight = T;
    static constexpr int kRuns = 1;
    static constexpr int kRunLen = VEC;
    struct Piece {
        float w[VEC];
    };
    __device__ static const T* row(const T* matrix, long long index, int width) {
        return matrix + index * width;
    }
    __device__ static int pieces(int width) { return width / VEC; }
    __device__ static int column(int piece, int) { return piece * VEC; }
    __device__ static Piece load(const T* row, int piece) {
        Piece p;
        load_vec<T, VEC>(row + piece * VEC, p.w);
        return p;
    }
    __device__ static float accumulate(const Piece& p, const float (&x)[kRuns][kRunLen],
                                       float acc) {
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc = fmaf(p.w[v], x[0][v], acc);
        return acc;
    }
};

__device__ __forceinline__ float half_at(const uint8_t* p) {
    return __half2float(*reinterpret_cast<const __half*>(p));
}

// Rows of GGUF blocks of BLOCK_WEIGHTS weights in BLOCK_BYTES bytes each.
template <int BLOCK_WEIGHTS, int BLOCK_BYTES>
struct GgufBlocks {
    using Weight = uint8_t;
    static constexpr int kBlockWeights = BLOCK_WEIGHTS;
    static constexpr int kBlockBytes = BLOCK_BYTES;
    __device__ static const uint8_t* row(const uint8_t* matrix, long long index, int width) {
        return matrix + index * (width / kBlockWeights) * kBlockBytes;
    }
};

// q8_0: blocks of 32 weights, 34 bytes (f16 d, then 32 int8 q); a piece is 8
// weights of one block (a quarter), read as 2-byte words (a row of blocks is
// only 2-byte aligned).
struct Q8_0Rows : GgufBlocks<32, 34> {
    static constexpr int kRuns = 1;
    static constexpr int kRunLen = 8;
    struct Piece {
        float q[8];
        float d;
    };
    __device__ static int pieces(int width) { return width / kRunLen; }
    __device__ static int column(int piece, int) { return piece * kRunLen; }
    __device__ static Piece load(const uint8_t* row, int piece) {
        const uint8_t* block = row + (piece >> 2) * kBlockBytes;
        const uint16_t* words = reinterpret_cast<const uint16_t*>(block + 2 + (piece & 3) * 8);
        Piece p;
        p.d = half_at(block);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint16_t word = __ldg(words + i);
            p.q[2 * i] = static_cast<float>(static_cast<int8_t>(word & 0xff));
            p.q[2 * i + 1] = static_cast<float>(static_cast<int8_t>(word >> 8));
        }
        return p;
    }
    __device__ static float accumulate(const Piece& p, const float (&x)[kRuns][kRunLen],
                                       float acc) {
        float sum = 0.0f;
#pragma unroll
        for (int v = 0; v < kRunLen; ++v) sum = fmaf(p.q[v], x[0][v], sum);
        return fmaf(p.d, sum, acc);
    }
};

// q4_K: super-blocks of 256 weights, 144 bytes (f16 d, f16 dmin, 12 bytes of
// eight 6-bit scales and mins, 128 bytes of 4-bit q). Byte b of q-chunk jj
// (32 bytes) holds weight 64 jj + b (low nibble, sub-block 2 jj) and
// 64 jj + 32 + b (high nibble, sub-block 2 jj + 1). A piece is 8 bytes of one
// chunk: runs of 8 weights in its two sub-blocks. Blocks are 16-byte aligned.
struct Q4KRows : GgufBlocks<256, 144> {
    static constexpr int kRuns = 2;
    static constexpr int kRunLen = 8;
    struct Piece {
        float q[2][8];
        float scale[2];
        float min[2];
    };
    __device__ static int pieces(int width) { return width / 16; }
    __device__ static int column(int piece, int run) {
        const int in_block = piece & 15;
        return (piece >> 4) * kBlockWeights + (in_block >> 2) * 64 + run * 32 + (in_block & 3) * 8;
    }
    // ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j.
    __device__ static void scale_min(const uint8_t* scales, int j, int& scale, int& min) {
        if (j < 4) {
            scale = scales[j] & 63;
            min = scales[j + 4] & 63;
        } else {
            scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
            min = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        }
    }
    __device__ static Piece load(const uint8_t* row, int piece) {
        const uint8_t* block = row + (piece >> 4) * kBlockBytes;
        const uint4 header_words = __ldg(reinterpret_cast<const uint4*>(block));
        const uint8_t* header = reinterpret_cast<const uint8_t*>(&header_words);
        const int in_block = piece & 15;
        const int chunk = in_block >> 2;
        const uint2 q_words =
            __ldg(reinterpret_cast<const uint2*>(block + 16 + chunk * 32 + (in_block & 3) * 8));
        const uint8_t* q = reinterpret_cast<const uint8_t*>(&q_words);
        const float d = half_at(header);
        const float dmin = half_at(header + 2);
        Piece p;
#pragma unroll
        for (int run = 0; run < 2; ++run) {
            int scale;
            int min;
            scale_min(header + 4, 2 * chunk + run, scale, min);
            p.scale[run] = d * static_cast<float>(scale);
            p.min[run] = dmin * static_cast<float>(min);
        }
#pragma unroll
        for (int v = 0; v < 8; ++v) {
            p.q[0][v] = static_cast<float>(q[v] & 0xF);
            p.q[1][v] = static_cast<float>(q[v] >> 4);
        }
        return p;
    }
    __device__ static float accumulate(const Piece& p, const float (&x)[kRuns][kRunLen],
                                       float acc) {
#pragma unroll
        for (int run = 0; run < kRuns; ++run) {
            float sum_qx = 0.0f;
            float sum_x = 0.0f;
#pragma unroll
            for (int v = 0; v < kRunLen; ++v) {
                sum_qx = fmaf(p.q[run][v], x[run][v], sum_qx);
                sum_x += x[run][v];
            }
            acc = fmaf(p.scale[run], sum_qx, fmaf(-p.min[run], sum_x, acc));
        }
        return acc;
    }
};

// Must match `GGUF_*` in src/cuda/quantized.rs.
enum GgufCode : int { kQ8_0 = 0, kQ4K = 1 };

// The activations of piece p of `Rows` in one row of x (16-byte loads:
// x 16-byte aligned, runs of 16-byte multiples).
template <typename Rows, typename T>
__device__ __forceinline__ void load_activations(const T* x, int piece,
                                                 float (&out)[Rows::kRuns][Rows::kRunLen]) {
#pragma unroll
    for (int run = 0; run < Rows::kRuns; ++run) {
        load_vec<T, Rows::kRunLen>(x + Rows::column(piece, run), out[run]);
    }
}

// The rows of activations a warp streams a weight row against at once.
constexpr int kTokens = 8;

// sum[t] = this lane's share of the dot product of `row` (`width` weights in
// the format `Rows`) with the activation row activations(t), for t < count
// (at most kTokens): the weight row is read once for all of them; the
// caller adds the lanes' shares (warp_sum).
template <typename Rows, typename Activations>
__device__ __forceinline__ void stream_row(const typename Rows::Weight* row, int width, int count,
                                           float (&sum)[kTokens], Activations activations) {
#pragma unroll
    for (int t = 0; t < kTokens; ++t) sum[t] = 0.0f;
    const int lane = threadIdx.x & 31;
#pragma unroll 2
    for (int p = lane; p < Rows::pieces(width); p += 32) {
        const typename Rows::Piece w = Rows::load(row, p);
#pragma unroll
        for (int t = 0; t < kTokens; ++t) {
            if (t < count) {
                float xv[Rows::kRuns][Rows::kRunLen];
                load_activations<Rows>(activations(t), p, xv);
                sum[t] = Rows::accumulate(w, xv, sum[t]);
            }
        }
    }
}

}  // namespace berrylm::rows

// Dispatches a GGUF format code to a row format alias `NAME` for BODY;
// yields cudaErrorInvalidValue for an unknown code.
#define BERRYLM_DISPATCH_GGUF(CODE, NAME, ...)                      \
    switch (CODE) {                                                 \
        case berrylm::rows::kQ8_0: {                                \
            using NAME = berrylm::rows::Q8_0Rows;                   \
            __VA_ARGS__;                                            \
            break;                                                  \
        }                                                           \
        case berrylm::rows::kQ4K: {                                 \
            using NAME = berrylm::rows::Q4KRows;                    \
            __VA_ARGS__;                                            \
            break;                                                  \
        }                                                           \
        default:                                                    \
            return static_cast<int>(cudaErrorInvalidValue);         \
    }
