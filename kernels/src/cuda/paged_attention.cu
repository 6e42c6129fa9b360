// Attention of a decode step over the host's paged KV blocks (spec 3.5 step
// 4): each sequence n has one query token, heads query heads of D channels,
// and attends to its context_lens[n] tokens, token t stored in block
// block_tables[n, t / block_size] at slot t % block_size, query head h reading
// KV head h / (heads / kv_heads). The caches are laid out as the host's
// paged attention keeps them (vLLM's layout, X = 16 bytes of elements):
//   key_cache   [blocks, kv_heads, D / X, block_size, X]
//   value_cache [blocks, kv_heads, D, block_size]
//
//   s_t = (q . k_t) * scale          (f32 products and sums)
//   o   = round_x(sum_t exp(s_t - max) v_t / sum_t exp(s_t - max))
//
// Split-KV ("flash decoding"): a thread block takes one sequence, one
// partition of kPartition tokens and query heads of one KV head (its whole
// group, up to kMaxGroup, or a part of it where the batch is small): the
// lanes of a token (D / X / kKeyPieces of them, X channels = 16 bytes a
// piece) load their kKeyPieces pieces of its key at once and compute the
// group's scores into shared memory, adding their shares with shuffles;
// then a warp per query head its partition's softmax; then each thread a
// channel of the values, 8 tokens (16 bytes of a value row) at a time. With one
// partition it writes the output; with several, f32 partial sums with their
// maximum and sum of exponentials, which combine_kernel merges. The grid
// depends on the shapes alone (the block tables' width), so the launches can
// be captured in a CUDA graph and replayed for other context lengths.
#include <type_traits>

#include "common.cuh"

namespace berrylm::paged_attention {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Tokens a thread block attends to (a multiple of 8: a chunk of 8 tokens
// never spans two KV blocks, whose size is a multiple of 8).
constexpr int kPartition = 512;
// Query heads per KV head a block takes (one warp each for the softmax).
constexpr int kMaxGroup = kWarps;  // must match MAX_GROUP in src/cuda/paged_attention.rs
constexpr int kChunk = 8;          // tokens of a value row read at once
// Pieces of X channels of a key each lane loads at once: a token's key is
// D / X / kKeyPieces lanes' (4 at D = 256), so that one load's latency, not
// 32 in a row, precedes a score.
constexpr int kKeyPieces = 8;
// Blocks a call should have before it gives each block fewer query heads
// (about one per SM of an H200).
constexpr long long kTargetBlocks = 128;

// N consecutive elements of T (N * sizeof(T) bytes, as aligned) into f32
// with one load.
template <typename T, int N>
__device__ __forceinline__ void load_piece(const T* p, float (&out)[N]) {
    static_assert(sizeof(T) == 2, "16-bit elements");
    using Word = std::conditional_t<
        N == 1, uint16_t,
        std::conditional_t<N == 2, uint32_t, std::conditional_t<N == 4, uint2, uint4>>>;
    const Word raw = *reinterpret_cast<const Word*>(p);
    const T* values = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = berrylm::to_f32(values[i]);
}

struct Sizes {
    int heads;
    int kv_heads;
    int heads_per_block;
    int blocks;
    int block_size;
    int max_blocks;
    int partitions;
    float scale;
    long long key_block_stride;
    long long value_block_stride;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    partition_kernel(const T* __restrict__ q, const T* __restrict__ key_cache,
                     const T* __restrict__ value_cache, const uint32_t* __restrict__ block_tables,
                     const uint32_t* __restrict__ context_lens, T* __restrict__ out,
                     float* __restrict__ partial_out, float* __restrict__ partial_max,
                     float* __restrict__ partial_sum, const Sizes s) {
    constexpr int kX = 16 / static_cast<int>(sizeof(T));
    static_assert(D % kX == 0, "whole key pieces");
    constexpr int kParts = kThreads / D;  // threads per value channel
    __shared__ float query[kMaxGroup][D];
    __shared__ float probs[kMaxGroup][kPartition];
    __shared__ float row_max[kMaxGroup];
    __shared__ float row_sum[kMaxGroup];
    __shared__ float part_acc[kParts > 1 ? kParts : 1][kMaxGroup][D];

    const int partition = blockIdx.x;
    const int n = blockIdx.z;
    // This block's query heads: `groups` consecutive heads, all of one KV
    // head's.
    const int groups = s.heads_per_block;
    const int kv_head = blockIdx.y * groups / (s.heads / s.kv_heads);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    // A context beyond the block table, or a block id beyond the caches, is
    // the caller's error; the kernel clamps them rather than read past its
    // buffers.
    const int context = static_cast<int>(
        min(context_lens[n], static_cast<uint32_t>(s.max_blocks * s.block_size)));
    const int start = partition * kPartition;
    const int len = min(context, start + kPartition) - start;
    const long long first_head = static_cast<long long>(n) * s.heads + blockIdx.y * groups;

    if (len <= 0) {
        // Past the sequence's context: nothing to add (or, for a sequence
        // without tokens, a zero output).
        for (int i = threadIdx.x; i < groups * D; i += kThreads) {
            const long long head = first_head + i / D;
            if (s.partitions == 1) {
                out[head * D + i % D] = berrylm::from_f32<T>(0.0f);
            } else if (i % D == 0) {
                partial_max[head * s.partitions + partition] = -INFINITY;
                partial_sum[head * s.partitions + partition] = 0.0f;
            }
        }
        return;
    }

    for (int i = threadIdx.x; i < groups * D; i += kThreads) {
        query[i / D][i % D] = berrylm::to_f32(q[first_head * D + i]);
    }
    __syncthreads();

    // Scores: the kTokenLanes lanes of a token each load kKeyPieces pieces
    // of its key (lane share `sub` takes pieces sub, sub + kTokenLanes,
    // ...), all at once, multiply them with the query heads' channels (from
    // shared memory) and add their shares over the token's lanes. A warp
    // takes 32 / kTokenLanes tokens a pass, the pieces of one index of its
    // tokens adjacent where their slots are (16-byte pieces of consecutive
    // slots lie side by side).
    constexpr int kTokenLanes = D / kX / kKeyPieces;
    static_assert(kTokenLanes >= 1 && 32 % kTokenLanes == 0, "whole tokens a warp");
    constexpr int kWarpTokens = 32 / kTokenLanes;
    const uint32_t* table = block_tables + static_cast<long long>(n) * s.max_blocks;
    const long long key_head_offset = static_cast<long long>(kv_head) * D * s.block_size;
    const int sub = lane % kTokenLanes;
    for (int first = warp * kWarpTokens; first < len; first += kWarps * kWarpTokens) {
        const int t = first + lane / kTokenLanes;
        float dot[kMaxGroup] = {};
        if (t < len) {
            const int token = start + t;
            const long long block =
                min(table[token / s.block_size], static_cast<uint32_t>(s.blocks - 1));
            const T* key = key_cache + block * s.key_block_stride + key_head_offset +
                           static_cast<long long>(token % s.block_size) * kX;
            uint4 pieces[kKeyPieces];
#pragma unroll
            for (int i = 0; i < kKeyPieces; ++i) {
                const int piece = sub + i * kTokenLanes;
                pieces[i] = *reinterpret_cast<const uint4*>(
                    key + static_cast<long long>(piece) * s.block_size * kX);
            }
#pragma unroll
            for (int i = 0; i < kKeyPieces; ++i) {
                const int channel = (sub + i * kTokenLanes) * kX;
                const T* k = reinterpret_cast<const T*>(&pieces[i]);
#pragma unroll
                for (int g = 0; g < kMaxGroup; ++g) {
                    if (g < groups) {
#pragma unroll
                        for (int e = 0; e < kX; ++e) {
                            dot[g] = fmaf(query[g][channel + e], berrylm::to_f32(k[e]), dot[g]);
                        }
                    }
                }
            }
        }
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            if (g < groups) {
#pragma unroll
                for (int offset = kTokenLanes / 2; offset > 0; offset >>= 1) {
                    dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], offset);
                }
                if (t < len && sub == 0) probs[g][t] = __fmul_rn(dot[g], s.scale);
            }
        }
    }
    __syncthreads();

    // The partition's softmax numerators, a warp per query head.
    if (warp < groups) {
        float m = -INFINITY;
        for (int t = lane; t < len; t += 32) m = fmaxf(m, probs[warp][t]);
        m = berrylm::warp_max(m);
        float sum = 0.0f;
        for (int t = lane; t < len; t += 32) {
            const float p = expf(probs[warp][t] - m);
            probs[warp][t] = p;
            sum += p;
        }
        sum = berrylm::warp_sum(sum);
        if (lane == 0) {
            row_max[warp] = m;
            row_sum[warp] = sum;
        }
    }
    __syncthreads();

    // Values: thread (part, d) adds chunks part, part + kParts, ... of 8
    // tokens of channel d (16-byte loads of value row d within a block).
    const int d = threadIdx.x % D;
    const int part = threadIdx.x / D;
    const long long value_offset = static_cast<long long>(kv_head) * D * s.block_size +
                                   static_cast<long long>(d) * s.block_size;
    float acc[kMaxGroup] = {};
#pragma unroll 4
    for (int c = part * kChunk; c < len; c += kParts * kChunk) {
        const int token = start + c;
        const long long block =
            min(table[token / s.block_size], static_cast<uint32_t>(s.blocks - 1));
        float v[kChunk];
        load_piece<T, kChunk>(
            value_cache + block * s.value_block_stride + value_offset + token % s.block_size, v);
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
            if (c + j < len) {
#pragma unroll
                for (int g = 0; g < kMaxGroup; ++g) {
                    if (g < groups) acc[g] = fmaf(probs[g][c + j], v[j], acc[g]);
                }
            }
        }
    }
    if constexpr (kParts > 1) {
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) part_acc[part][g][d] = acc[g];
        __syncthreads();
        if (part != 0) return;
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
            for (int p = 1; p < kParts; ++p) acc[g] += part_acc[p][g][d];
        }
    }
    for (int g = 0; g < groups; ++g) {
        const long long head = first_head + g;
        if (s.partitions == 1) {
            out[head * D + d] = berrylm::from_f32<T>(__fdiv_rn(acc[g], row_sum[g]));
        } else {
            const long long slot = head * s.partitions + partition;
            partial_out[slot * D + d] = acc[g];
            if (d == 0) {
                partial_max[slot] = row_max[g];
                partial_sum[slot] = row_sum[g];
            }
        }
    }
}

// o[n, h, d] from the partitions' partial sums: each rescaled by
// exp(its max - the largest max) and divided by the rescaled sums' total.
template <typename T>
__global__ void combine_kernel(const float* __restrict__ partial_out,
                               const float* __restrict__ partial_max,
                               const float* __restrict__ partial_sum, T* __restrict__ out,
                               int partitions, int head_dim) {
    const long long head = blockIdx.x;
    const float* maxes = partial_max + head * partitions;
    const float* sums = partial_sum + head * partitions;
    float largest = -INFINITY;
    for (int p = 0; p < partitions; ++p) largest = fmaxf(largest, maxes[p]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float total = 0.0f;
        float acc = 0.0f;
        for (int p = 0; p < partitions; ++p) {
            if (sums[p] == 0.0f) continue;
            const float weight = expf(maxes[p] - largest);
            total = fmaf(sums[p], weight, total);
            acc = fmaf(partial_out[(head * partitions + p) * head_dim + d], weight, acc);
        }
        out[head * head_dim + d] =
            berrylm::from_f32<T>(total > 0.0f ? __fdiv_rn(acc, total) : 0.0f);
    }
}

template <typename T, int D>
int launch(const T* q, const T* key_cache, const T* value_cache, const uint32_t* block_tables,
           const uint32_t* context_lens, T* out, float* partial_out, float* partial_max,
           float* partial_sum, int sequences, const Sizes& s, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned int>(s.partitions),
                    static_cast<unsigned int>(s.heads / s.heads_per_block),
                    static_cast<unsigned int>(sequences));
    partition_kernel<T, D><<<grid, kThreads, 0, stream>>>(q, key_cache, value_cache, block_tables,
                                                          context_lens, out, partial_out,
                                                          partial_max, partial_sum, s);
    if (s.partitions > 1) {
        combine_kernel<T><<<static_cast<unsigned int>(sequences * s.heads), D, 0, stream>>>(
            partial_out, partial_max, partial_sum, out, s.partitions, D);
    }
    return berrylm::launch_status();
}

}  // namespace berrylm::paged_attention

using namespace berrylm::paged_attention;

// Partitions of kPartition tokens a call over block tables of `max_blocks`
// blocks of `block_size` tokens has (the size of the partial buffers).
extern "C" int berrylm_paged_decode_partitions(int max_blocks, int block_size) {
    return (max_blocks * block_size + kPartition - 1) / kPartition;
}

// q [sequences, heads, head_dim]; the caches as above (contiguous, 16-byte
// aligned); block_tables [sequences, max_blocks] and context_lens
// [sequences] u32; out [sequences, heads, head_dim]; partial_out
// [sequences, heads, partitions, head_dim], partial_max and partial_sum
// [sequences, heads, partitions] f32 scratch (partitions from
// berrylm_paged_decode_partitions; unused with one). head_dim 64, 128 or
// 256, heads / kv_heads at most kMaxGroup, block_size a multiple of 8.
extern "C" int berrylm_paged_decode_attention(
    int dtype, const void* q, const void* key_cache, const void* value_cache,
    const uint32_t* block_tables, const uint32_t* context_lens, void* out, float* partial_out,
    float* partial_max, float* partial_sum, int sequences, int heads, int kv_heads, int head_dim,
    int blocks, int block_size, int max_blocks, float scale, void* stream) {
    if (sequences == 0) return 0;
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > kMaxGroup ||
        block_size <= 0 || block_size % kChunk != 0 || max_blocks <= 0 || blocks <= 0) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    // Query heads a block takes: a KV head's group, split in halves while
    // the grid has fewer blocks than kTargetBlocks (one sequence's decode
    // step would otherwise run in as many blocks as KV heads).
    int heads_per_block = heads / kv_heads;
    while (heads_per_block % 2 == 0 &&
           static_cast<long long>(sequences) * (heads / heads_per_block) < kTargetBlocks) {
        heads_per_block /= 2;
    }
    const Sizes sizes{heads,
                      kv_heads,
                      heads_per_block,
                      blocks,
                      block_size,
                      max_blocks,
                      berrylm_paged_decode_partitions(max_blocks, block_size),
                      scale,
                      static_cast<long long>(kv_heads) * head_dim * block_size,
                      static_cast<long long>(kv_heads) * head_dim * block_size};
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const auto run = [&](auto element, auto dim) {
        using T = decltype(element);
        return launch<T, decltype(dim)::value>(
            static_cast<const T*>(q), static_cast<const T*>(key_cache),
            static_cast<const T*>(value_cache), block_tables, context_lens, static_cast<T*>(out),
            partial_out, partial_max, partial_sum, sequences, sizes, s);
    };
    const auto by_dim = [&](auto element) {
        switch (head_dim) {
            case 64: return run(element, std::integral_constant<int, 64>{});
            case 128: return run(element, std::integral_constant<int, 128>{});
            case 256: return run(element, std::integral_constant<int, 256>{});
            default: return static_cast<int>(cudaErrorInvalidValue);
        }
    };
    switch (dtype) {
        case berrylm::kBF16: return by_dim(__nv_bfloat16{});
        case berrylm::kF16: return by_dim(__half{});
        default: return static_cast<int>(cudaErrorInvalidValue);
    }
}
