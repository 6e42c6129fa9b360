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
// A quantized weight is read as ggml defines its value, d q for q8_0 (the
// dot product sums q x over a piece and scales the sum by d) and
// (d sc) q - (dmin m) for q4_K (each weight decoded to the value candle's
// dequantization gives it), in f32.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace berrylm::rows {

// The elements of T a 16-byte vector holds.
template <typename T>
constexpr int kPerVector = 16 / static_cast<int>(sizeof(T));

// The elements of T in the 16-byte vector `raw`, from out[first] on, in f32.
template <typename T, int N>
__device__ __forceinline__ void unpack_vector(const uint4& raw, float (&out)[N], int first = 0) {
    const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kPerVector<T>; ++i) out[first + i] = berrylm::to_f32(values[i]);
}

// VEC consecutive elements of T into f32, with 16-byte loads when VEC > 1
// (`p` 16-byte aligned).
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[VEC]) {
    if constexpr (VEC == 1) {
        out[0] = berrylm::to_f32(*p);
    } else {
        static_assert(VEC % kPerVector<T> == 0, "whole 16-byte vectors");
#pragma unroll
        for (int chunk = 0; chunk < VEC / kPerVector<T>; ++chunk) {
            unpack_vector<T>(__ldg(reinterpret_cast<const uint4*>(p) + chunk), out,
                             chunk * kPerVector<T>);
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

// The f32 value of byte B (0..3) of `word`, read as an unsigned integer,
// minus `zero` (a small integer): the byte becomes the low mantissa bits of
// 2^23 (one byte permute), and subtracting 2^23 + zero leaves exactly the
// difference. Avoids the integer-to-float conversion, which runs at a
// quarter of the rate of f32 arithmetic.
template <int B>
__device__ __forceinline__ float byte_value(uint32_t word, float zero = 0.0f) {
    constexpr float kTwoPow23 = 8388608.0f;
    // Result bytes: word's byte B, 0, 0, 0x4B (from 0x4B000000's bytes 4..7).
    return __int_as_float(static_cast<int>(__byte_perm(word, 0x4B000000u, 0x7440u + B))) -
           (kTwoPow23 + zero);
}

// The four bytes of `word` in order, each as byte_value.
__device__ __forceinline__ void byte_values(uint32_t word, float zero, float* out) {
    out[0] = byte_value<0>(word, zero);
    out[1] = byte_value<1>(word, zero);
    out[2] = byte_value<2>(word, zero);
    out[3] = byte_value<3>(word, zero);
}

// The f16 in the low (HIGH = 0) or high half of `word`, in f32.
template <int HIGH>
__device__ __forceinline__ float half_value(uint32_t word) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(word >> (16 * HIGH))));
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
// only 2-byte aligned). The dot product sums q x and scales the sum by d.
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
        // The int8 values offset by 128 (sign bit flipped) are unsigned bytes.
        const uint32_t low = (static_cast<uint32_t>(__ldg(words)) |
                              (static_cast<uint32_t>(__ldg(words + 1)) << 16)) ^
                             0x80808080u;
        const uint32_t high = (static_cast<uint32_t>(__ldg(words + 2)) |
                               (static_cast<uint32_t>(__ldg(words + 3)) << 16)) ^
                              0x80808080u;
        Piece p;
        p.d = half_at(block);
        byte_values(low, 128.0f, p.q);
        byte_values(high, 128.0f, p.q + 4);
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
// chunk: runs of 8 weights in its two sub-blocks, each weight decoded to its
// value as candle dequantizes it, (d sc) q - (dmin m) in f32. Blocks are
// 16-byte aligned.
struct Q4KRows : GgufBlocks<256, 144> {
    static constexpr int kRuns = 2;
    static constexpr int kRunLen = 8;
    struct Piece {
        float w[2][8];
    };
    __device__ static int pieces(int width) { return width / 16; }
    __device__ static int column(int piece, int run) {
        const int in_block = piece & 15;
        return (piece >> 4) * kBlockWeights + (in_block >> 2) * 64 + run * 32 + (in_block & 3) * 8;
    }
    // ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j, from
    // the 12 scale bytes as three little-endian words (bytes 0-3, 4-7, 8-11),
    // by shifts (no byte array, which would live in local memory).
    __device__ static void scale_min(uint32_t w0, uint32_t w1, uint32_t w2, int j, int& scale,
                                     int& min) {
        const int shift = 8 * (j & 3);
        const uint32_t b0 = (w0 >> shift) & 0xFF;  // byte j & 3
        const uint32_t b1 = (w1 >> shift) & 0xFF;  // byte 4 + (j & 3)
        const uint32_t b2 = (w2 >> shift) & 0xFF;  // byte 8 + (j & 3)
        if (j < 4) {
            scale = static_cast<int>(b0 & 63);
            min = static_cast<int>(b1 & 63);
        } else {
            scale = static_cast<int>((b2 & 0xF) | ((b0 >> 6) << 4));
            min = static_cast<int>((b2 >> 4) | ((b1 >> 6) << 4));
        }
    }
    __device__ static Piece load(const uint8_t* row, int piece) {
        const uint8_t* block = row + (piece >> 4) * kBlockBytes;
        const uint4 header = __ldg(reinterpret_cast<const uint4*>(block));
        const int in_block = piece & 15;
        const int chunk = in_block >> 2;
        const uint2 q = __ldg(
            reinterpret_cast<const uint2*>(block + 16 + chunk * 32 + (in_block & 3) * 8));
        const float d = half_value<0>(header.x);
        const float dmin = half_value<1>(header.x);
        // Run 0: the low nibbles (sub-block 2 chunk), run 1: the high ones.
        const uint32_t nibbles[2][2] = {{q.x & 0x0F0F0F0Fu, q.y & 0x0F0F0F0Fu},
                                        {(q.x >> 4) & 0x0F0F0F0Fu, (q.y >> 4) & 0x0F0F0F0Fu}};
        Piece p;
#pragma unroll
        for (int run = 0; run < 2; ++run) {
            int scale;
            int min;
            scale_min(header.y, header.z, header.w, 2 * chunk + run, scale, min);
            const float scaled = d * static_cast<float>(scale);
            const float offset = dmin * static_cast<float>(min);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                byte_values(nibbles[run][half], 0.0f, p.w[run] + 4 * half);
            }
#pragma unroll
            for (int v = 0; v < kRunLen; ++v) {
                p.w[run][v] = __fsub_rn(__fmul_rn(scaled, p.w[run][v]), offset);
            }
        }
        return p;
    }
    __device__ static float accumulate(const Piece& p, const float (&x)[kRuns][kRunLen],
                                       float acc) {
#pragma unroll
        for (int run = 0; run < kRuns; ++run) {
#pragma unroll
            for (int v = 0; v < kRunLen; ++v) acc = fmaf(p.w[run][v], x[run][v], acc);
        }
        return acc;
    }
};

// q4_K for single-row calls: a piece is 16 bytes of one chunk, runs of 16
// weights in its two sub-blocks (32 weights, one 16-byte load of codes), and
// each run's scale and min are factored out of its sums:
// (d sc) sum(q x) - (dmin m) sum(x). About 5 instructions a weight instead of
// Q4KRows' 8 (no per-weight scale and min, half the header decoding a
// weight), which pays for one activation row only: the piece is kept as it
// lies in memory and decoded in `accumulate`, once per activation row, and
// sum(x) is one more sum per row. The sums round differently from candle's
// dequantized weights (within f32 rounding of the two terms).
struct Q4KSingleRowRows : GgufBlocks<256, 144> {
    static constexpr int kRuns = 2;
    static constexpr int kRunLen = 16;
    struct Piece {
        uint4 header;
        uint4 codes;
        int chunk;
    };
    __device__ static int pieces(int width) { return width / 32; }
    __device__ static int column(int piece, int run) {
        const int in_block = piece & 7;
        return (piece >> 3) * kBlockWeights + (in_block >> 1) * 64 + run * 32 + (in_block & 1) * 16;
    }
    __device__ static Piece load(const uint8_t* row, int piece) {
        const uint8_t* block = row + (piece >> 3) * kBlockBytes;
        const int in_block = piece & 7;
        Piece p;
        p.chunk = in_block >> 1;
        p.header = __ldg(reinterpret_cast<const uint4*>(block));
        p.codes = __ldg(reinterpret_cast<const uint4*>(block + 16 + p.chunk * 32 + (in_block & 1) * 16));
        return p;
    }
    __device__ static float accumulate(const Piece& p, const float (&x)[kRuns][kRunLen],
                                       float acc) {
        const float d = half_value<0>(p.header.x);
        const float dmin = half_value<1>(p.header.x);
        const uint32_t words[4] = {p.codes.x, p.codes.y, p.codes.z, p.codes.w};
#pragma unroll
        for (int run = 0; run < kRuns; ++run) {
            int scale;
            int min;
            Q4KRows::scale_min(p.header.y, p.header.z, p.header.w, 2 * p.chunk + run, scale, min);
            // Run 0: the low nibbles (sub-block 2 chunk), run 1: the high ones.
            float codes[kRunLen];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                byte_values((words[w] >> (4 * run)) & 0x0F0F0F0Fu, 0.0f, codes + 4 * w);
            }
            float qx = 0.0f;
            float xs = 0.0f;
#pragma unroll
            for (int v = 0; v < kRunLen; ++v) {
                qx = fmaf(codes[v], x[run][v], qx);
                xs += x[run][v];
            }
            acc = fmaf(d * static_cast<float>(scale), qx, acc);
            acc = fmaf(-(dmin * static_cast<float>(min)), xs, acc);
        }
        return acc;
    }
};

// The format a single-row call reads `Rows` in: Q4KSingleRowRows for q4_K,
// `Rows` itself otherwise.
template <typename Rows>
struct SingleRow {
    using Format = Rows;
};
template <>
struct SingleRow<Q4KRows> {
    using Format = Q4KSingleRowRows;
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

// The rows of activations a warp streams a weight row against at once (a
// kernel instantiated for one row, TOKENS = 1, serves single-token steps
// with fewer registers).
constexpr int kTokens = 8;

// The rows per group a kernel is instantiated for, given the rows of the
// call: one for a single-token step, else kTokens.
template <typename F>
__host__ __forceinline__ void with_group_size(int tokens, F launch) {
    if (tokens == 1) {
        launch(std::integral_constant<int, 1>{});
    } else {
        launch(std::integral_constant<int, kTokens>{});
    }
}

// sum[t] = this lane's share of the dot product of `row` (`width` weights in
// the format `Rows`) with the activation row activations(t), for t < count
// (at most TOKENS): the weight row is read once for all of them; the
// caller adds the lanes' shares (warp_sum).
template <typename Rows, int TOKENS, typename Activations>
__device__ __forceinline__ void stream_pieces(const typename Rows::Weight* row, int width,
                                              int count, float (&sum)[TOKENS],
                                              Activations activations) {
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) sum[t] = 0.0f;
    const int lane = threadIdx.x & 31;
#pragma unroll 2
    for (int p = lane; p < Rows::pieces(width); p += 32) {
        const typename Rows::Piece w = Rows::load(row, p);
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            if (t < count) {
                float xv[Rows::kRuns][Rows::kRunLen];
                load_activations<Rows>(activations(t), p, xv);
                sum[t] = Rows::accumulate(w, xv, sum[t]);
            }
        }
    }
}

// Whether a single-row call reads a row of `width` weights in the format
// SingleRow<Rows>::Format: where it differs from `Rows` and every lane gets
// a piece of the row (a 512-wide q4_K row has 16 pieces of 32 weights: half
// the warp would wait on the other half's decoding).
template <typename Rows>
__device__ __forceinline__ bool single_row_format_fits(int width) {
    using Single = typename SingleRow<Rows>::Format;
    return !std::is_same_v<Single, Rows> && Single::pieces(width) >= 32;
}

// stream_pieces in the single-row format where it fits (TOKENS == 1).
template <typename Rows, int TOKENS, typename Activations>
__device__ __forceinline__ void stream_row(const typename Rows::Weight* row, int width, int count,
                                           float (&sum)[TOKENS], Activations activations) {
    if constexpr (TOKENS == 1) {
        if (single_row_format_fits<Rows>(width)) {
            stream_pieces<typename SingleRow<Rows>::Format, TOKENS>(row, width, count, sum,
                                                                   activations);
            return;
        }
    }
    stream_pieces<Rows, TOKENS>(row, width, count, sum, activations);
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
