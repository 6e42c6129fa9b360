// The routed experts of the MoE block for decode-sized batches (spec 3.7
// step 3), with the reference's rounding points (round_x: to the activation
// dtype, RNE). For token n and each of its experts e = ids[n, s], weight
// w = weights[n, s]:
//   gate_up = round_x(W_gu[e] x_n)                       (f32 dot products)
//   h       = round_x(round_x(silu(gate)) * up)
//   out_e   = round_x(W_d[e] h)
//   term    = round_x(w * out_e)
// and y_n = the sum of the token's terms in increasing expert id, each
// addition rounded, from zero (the reference's index_add_ over the experts it
// hit, in order).
//
// Three kernels. The first two give each block one expert and a tile of
// output rows of its weights; the block collects the routed rows
// (r = n * top_k + s) sent to its expert, in order, and streams each weight
// row once per group of up to kTokens (8) of them, one warp per row (16-byte
// loads where sizes and addresses allow). With fewer routed rows than
// experts, the grid runs over the routed rows instead and a block whose
// expert appeared at an earlier row exits, so no block is launched for
// an expert nobody chose. The third adds the terms per token.
#include "common.cuh"
#include "weight_rows.cuh"

namespace berrylm::moe {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// One weight row per warp: at batch 1 the step reads 8 experts' rows, and
// many small blocks keep more of those reads in flight than fewer big ones.
constexpr int kRowsPerBlock = kWarps;
// Blocks an SM must hold at once, by the rows per group: a single token's
// step has one block per chosen expert and tile (8 experts x 64 tiles of
// gate | up at BerryLM-OS's size), three an SM (at most 85 registers a
// thread; q4_K's single-row format takes 79 without spilling, and spills
// at four).
template <int TOKENS>
constexpr int kMinBlocksPerSm = TOKENS == 1 ? 3 : 1;
// Must match MAX_TOP_K in src/cuda/moe.rs.
constexpr int kMaxCombineTopK = 32;
// 64 threads a block: at batch 1 the combine of a 2048-wide row is 256
// threads, which four blocks spread over four SMs.
constexpr int kCombineThreads = 64;
// At least MOE_KERNEL_MAX_ROUTED_ROWS in src/cuda/moe.rs (the rows it sends here).
constexpr int kMaxRouted = 4096;

// The expert of this block, or -1 when the block has nothing to do (see the
// file comment). All threads of the block call it.
__device__ int block_expert(const uint32_t* __restrict__ ids, int routed, int experts,
                            int by_row) {
    if (!by_row) return static_cast<int>(blockIdx.x);
    const uint32_t expert = ids[blockIdx.x];
    bool earlier = false;
    for (int r = threadIdx.x; r < static_cast<int>(blockIdx.x); r += kThreads) {
        earlier |= ids[r] == expert;
    }
    if (__syncthreads_or(earlier) || expert >= static_cast<uint32_t>(experts)) return -1;
    return static_cast<int>(expert);
}

// Writes the routed rows whose expert is `expert` to rows[], in increasing
// order, and returns their count. All threads of the block call it.
__device__ int collect_rows(const uint32_t* __restrict__ ids, int routed, int expert, int* rows) {
    __shared__ int warp_counts[kWarps];
    __shared__ int found;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) found = 0;
    __syncthreads();
    for (int start = 0; start < routed; start += kThreads) {
        const int r = start + threadIdx.x;
        const bool hit = r < routed && ids[r] == static_cast<uint32_t>(expert);
        const unsigned mask = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_counts[warp] = __popc(mask);
        __syncthreads();
        int offset = found;
        for (int w = 0; w < warp; ++w) offset += warp_counts[w];
        if (hit) rows[offset + __popc(mask & ((1u << lane) - 1u))] = r;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 0; w < kWarps; ++w) found += warp_counts[w];
        }
        __syncthreads();
    }
    return found;
}

// The pieces of the gate and up rows a lane has in flight: two, except in
// q4_K's single-row format, whose pieces of 32 weights (and their 32
// activations) two at a time spill at three blocks an SM.
template <typename Rows>
constexpr int kGateUpPiecesInFlight =
    std::is_same_v<Rows, berrylm::rows::Q4KSingleRowRows> ? 1 : 2;

// This lane's shares of the dot products of a gate row and an up row (in
// the row format `Rows`, `hidden` weights each) with the activation rows
// x_row(t), t < count (at most TOKENS): each weight row read once for all.
template <typename Rows, int TOKENS, typename Activations>
__device__ __forceinline__ void gate_up_pieces(const typename Rows::Weight* gate_row,
                                               const typename Rows::Weight* up_row, int hidden,
                                               int count, float (&gate)[TOKENS],
                                               float (&up)[TOKENS], Activations x_row) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
        gate[t] = 0.0f;
        up[t] = 0.0f;
    }
#pragma unroll(kGateUpPiecesInFlight<Rows>)
    for (int p = lane; p < Rows::pieces(hidden); p += 32) {
        const typename Rows::Piece wg = Rows::load(gate_row, p);
        const typename Rows::Piece wu = Rows::load(up_row, p);
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            if (t < count) {
                float xv[Rows::kRuns][Rows::kRunLen];
                berrylm::rows::load_activations<Rows>(x_row(t), p, xv);
                gate[t] = Rows::accumulate(wg, xv, gate[t]);
                up[t] = Rows::accumulate(wu, xv, up[t]);
            }
        }
    }
}

// gate_up_pieces in the single-row format where it fits (TOKENS == 1), as
// berrylm::rows::stream_row.
template <typename Rows, int TOKENS, typename Activations>
__device__ __forceinline__ void gate_up_sums(const typename Rows::Weight* gate_row,
                                             const typename Rows::Weight* up_row, int hidden,
                                             int count, float (&gate)[TOKENS],
                                             float (&up)[TOKENS], Activations x_row) {
    if constexpr (TOKENS == 1) {
        if (berrylm::rows::single_row_format_fits<Rows>(hidden)) {
            gate_up_pieces<typename berrylm::rows::SingleRow<Rows>::Format, TOKENS>(
                gate_row, up_row, hidden, count, gate, up, x_row);
            return;
        }
    }
    gate_up_pieces<Rows, TOKENS>(gate_row, up_row, hidden, count, gate, up, x_row);
}

// h[r, j] for the j of this block's tile: gate row j and up row I + j of the
// expert's [2I, H] weights (in the row format `Rows`, or its single-row
// format where that fits) against x of the row's token, in groups of up to
// TOKENS rows.
template <typename T, typename Rows, int TOKENS>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<TOKENS>)
    gate_up_kernel(const T* __restrict__ x, const uint32_t* __restrict__ ids,
                   const typename Rows::Weight* __restrict__ gate_up, T* __restrict__ h,
                   int routed, int top_k, int experts, int hidden, int inter, int by_row) {
    __shared__ int rows[kMaxRouted];
    const int expert = block_expert(ids, routed, experts, by_row);
    if (expert < 0) return;
    const int count = collect_rows(ids, routed, expert, rows);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int j = blockIdx.y * kRowsPerBlock + warp;
    if (j >= inter) return;
    const long long first_row = static_cast<long long>(expert) * 2 * inter;
    const auto* gate_row = Rows::row(gate_up, first_row + j, hidden);
    const auto* up_row = Rows::row(gate_up, first_row + inter + j, hidden);
    for (int t0 = 0; t0 < count; t0 += TOKENS) {
        const int tokens = min(TOKENS, count - t0);
        float gate[TOKENS];
        float up[TOKENS];
        const auto x_row = [&](int t) {
            return x + static_cast<long long>(rows[t0 + t] / top_k) * hidden;
        };
        gate_up_sums<Rows, TOKENS>(gate_row, up_row, hidden, tokens, gate, up, x_row);
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            if (t < tokens) {
                const float g = berrylm::round_to<T>(berrylm::warp_sum(gate[t]));
                const float u = berrylm::round_to<T>(berrylm::warp_sum(up[t]));
                if (lane == 0) {
                    const float activated = berrylm::round_to<T>(berrylm::silu(g));
                    h[static_cast<long long>(rows[t0 + t]) * inter + j] =
                        berrylm::from_f32<T>(__fmul_rn(activated, u));
                }
            }
        }
    }
}

// out[r, i] = round_x(down row i of the expert's [H, I] weights (in the row
// format `Rows`) . h[r]), in groups of up to TOKENS rows.
template <typename T, typename Rows, int TOKENS>
__global__ void __launch_bounds__(kThreads)
    down_kernel(const T* __restrict__ h, const uint32_t* __restrict__ ids,
                const typename Rows::Weight* __restrict__ down, T* __restrict__ out, int routed,
                int experts, int hidden, int inter, int by_row) {
    __shared__ int rows[kMaxRouted];
    const int expert = block_expert(ids, routed, experts, by_row);
    if (expert < 0) return;
    const int count = collect_rows(ids, routed, expert, rows);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int i = blockIdx.y * kRowsPerBlock + warp;
    if (i >= hidden) return;
    const auto* row = Rows::row(down, static_cast<long long>(expert) * hidden + i, inter);
    for (int t0 = 0; t0 < count; t0 += TOKENS) {
        const int tokens = min(TOKENS, count - t0);
        float sum[TOKENS];
        berrylm::rows::stream_row<Rows, TOKENS>(row, inter, tokens, sum, [&](int t) {
            return h + static_cast<long long>(rows[t0 + t]) * inter;
        });
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            if (t < tokens) {
                const float total = berrylm::warp_sum(sum[t]);
                if (lane == 0) {
                    out[static_cast<long long>(rows[t0 + t]) * hidden + i] =
                        berrylm::from_f32<T>(total);
                }
            }
        }
    }
}

constexpr uint32_t kUnusedSlot = 0xffffffffu;

// A token's slots s < top_k (its ids `token_ids`) ordered by expert id, as
// keys id * MAX_K + s in key[0..MAX_K) (a sorting network in registers, so
// that the loads they lead to do not wait on one another); a slot whose id is
// at or above `experts`, and the keys past top_k, are kUnusedSlot, last.
template <int MAX_K>
__device__ __forceinline__ void sorted_slots(const uint32_t* __restrict__ token_ids, int top_k,
                                             int experts, uint32_t (&key)[MAX_K]) {
#pragma unroll
    for (int s = 0; s < MAX_K; ++s) {
        const uint32_t id = s < top_k ? token_ids[s] : kUnusedSlot;
        key[s] = id < static_cast<uint32_t>(experts) ? id * MAX_K + s : kUnusedSlot;
    }
#pragma unroll
    for (int pass = 0; pass < MAX_K; ++pass) {
#pragma unroll
        for (int s = pass & 1; s + 1 < MAX_K; s += 2) {
            if (key[s] > key[s + 1]) {
                const uint32_t k = key[s];
                key[s] = key[s + 1];
                key[s + 1] = k;
            }
        }
    }
}

// Whether sorted slot j counts: a valid id, not the repeat of the one before.
template <int MAX_K>
__device__ __forceinline__ bool counted_slot(const uint32_t (&key)[MAX_K], int j) {
    const bool repeated = j > 0 && key[j - 1] / MAX_K == key[j] / MAX_K;
    return key[j] != kUnusedSlot && !repeated;
}

// y[n, i .. i + VEC): the token's terms round_x(w * out_e) added in
// increasing expert id, each addition rounded; one thread per VEC
// consecutive columns of a token (16-byte loads and stores when VEC > 1).
// Ids at or above `experts` contribute nothing, and an id repeated in a
// token's row counts once. The routed row r = n * top_k + s of `expert_out`
// is row `rows[r]` when `rows` is given (outputs grouped by expert), else
// row r.
//
// A thread orders the token's slots in registers (sorted_slots).
template <typename T, int VEC, int MAX_K>
__global__ void combine_kernel(const T* __restrict__ expert_out, const float* __restrict__ weights,
                               const uint32_t* __restrict__ ids, const uint32_t* __restrict__ rows,
                               T* __restrict__ y, long long total, int top_k, int experts,
                               int hidden) {
    const int groups = hidden / VEC;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         index < total; index += stride) {
        const long long token = index / groups;
        const int i = static_cast<int>(index % groups) * VEC;
        uint32_t key[MAX_K];
        sorted_slots<MAX_K>(ids + token * top_k, top_k, experts, key);
        float acc[VEC] = {};
#pragma unroll
        for (int j = 0; j < MAX_K; ++j) {
            if (!counted_slot<MAX_K>(key, j)) continue;
            const long long routed_row = token * top_k + key[j] % MAX_K;
            const long long out_row = rows != nullptr ? rows[routed_row] : routed_row;
            const float weight = weights[routed_row];
            float out[VEC];
            berrylm::rows::load_vec<T, VEC>(expert_out + out_row * hidden + i, out);
#pragma unroll
            for (int v = 0; v < VEC; ++v) {
                const float term = berrylm::round_to<T>(__fmul_rn(weight, out[v]));
                acc[v] = berrylm::round_to<T>(__fadd_rn(acc[v], term));
            }
        }
        T values[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) values[v] = berrylm::from_f32<T>(acc[v]);
        T* destination = y + token * hidden + i;
        if constexpr (VEC == 1) {
            *destination = values[0];
        } else {
            *reinterpret_cast<uint4*>(destination) = *reinterpret_cast<const uint4*>(values);
        }
    }
}

inline bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// The combine over `tokens` tokens, 16 bytes of a token's columns per thread
// when the width and the pointers allow.
template <typename T, int MAX_K>
void launch_combine_up_to(const T* expert_out, const float* weights, const uint32_t* ids,
                          const uint32_t* rows, T* y, int tokens, int top_k, int experts,
                          int hidden, cudaStream_t stream) {
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    const long long total = static_cast<long long>(tokens) * hidden;
    if (hidden % kVec == 0 && aligned16(expert_out) && aligned16(y)) {
        const unsigned int blocks = berrylm::elementwise_blocks(total / kVec, kCombineThreads);
        combine_kernel<T, kVec, MAX_K><<<blocks, kCombineThreads, 0, stream>>>(
            expert_out, weights, ids, rows, y, total / kVec, top_k, experts, hidden);
    } else {
        const unsigned int blocks = berrylm::elementwise_blocks(total, kCombineThreads);
        combine_kernel<T, 1, MAX_K><<<blocks, kCombineThreads, 0, stream>>>(
            expert_out, weights, ids, rows, y, total, top_k, experts, hidden);
    }
}

// 1 <= top_k <= kMaxCombineTopK.
template <typename T>
int launch_combine(const T* expert_out, const float* weights, const uint32_t* ids,
                   const uint32_t* rows, T* y, int tokens, int top_k, int experts, int hidden,
                   cudaStream_t stream) {
    if (top_k <= 8) {
        launch_combine_up_to<T, 8>(expert_out, weights, ids, rows, y, tokens, top_k, experts,
                                   hidden, stream);
    } else if (top_k <= kMaxCombineTopK) {
        launch_combine_up_to<T, kMaxCombineTopK>(expert_out, weights, ids, rows, y, tokens,
                                                 top_k, experts, hidden, stream);
    } else {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    return berrylm::launch_status();
}

// The shared expert of a MoE block as the block output kernel reads it:
// its packed gate | up projection (row n `gate_up_stride` elements after row
// n - 1), its down projection [hidden, inter] and the gate's logit (row n
// `gate_logit_stride` elements after row n - 1).
template <typename T>
struct SharedExpert {
    const T* gate_up;
    long long gate_up_stride;
    const T* down;
    int inter;
    const T* gate_logit;
    long long gate_logit_stride;
};

// The residual stream after the MoE block, y[n, i] for the block's columns
// i, one warp each (berrylm::moe_residual of):
//   routed = the token's terms round_x(w * round_x(W_d[e] row i . h[r]))
//            added in increasing expert id (combine_kernel's order and
//            rounding), r = n * top_k + s the routed row of slot s
//   shared = round_x(W_sd row i . swiglu(shared gate | up of token n))
// The warp reads down row i of each of the token's experts and of the shared
// expert together, VEC elements a lane at a time (all MAX_K rows' loads in
// flight at once), and applies the shared expert's SwiGLU (mlp.cu's rounding)
// to its gate and up columns as it reads them.
template <typename T, int VEC, int MAX_K>
__global__ void __launch_bounds__(kThreads)
    block_output_kernel(const T* __restrict__ h, const float* __restrict__ weights,
                        const uint32_t* __restrict__ ids, const T* __restrict__ down,
                        const SharedExpert<T> shared, const T* __restrict__ residual,
                        T* __restrict__ y, int tokens, int top_k, int experts, int hidden,
                        int inter) {
    const int lane = threadIdx.x & 31;
    const int i = blockIdx.x * kWarps + (threadIdx.x >> 5);
    if (i >= hidden) return;
    const int pieces = inter / VEC;
    const int shared_pieces = shared.inter / VEC;
    const T* shared_row = shared.down + static_cast<long long>(i) * shared.inter;
    for (int n = 0; n < tokens; ++n) {
        uint32_t key[MAX_K];
        sorted_slots<MAX_K>(ids + static_cast<long long>(n) * top_k, top_k, experts, key);
        // A slot that does not count reads the first slot's rows (whose
        // products it discards), so that every load is issued unconditionally.
        bool counted[MAX_K];
        const T* down_rows[MAX_K];
        const T* h_rows[MAX_K];
        float sum[MAX_K];
#pragma unroll
        for (int j = 0; j < MAX_K; ++j) {
            counted[j] = counted_slot<MAX_K>(key, j);
            const uint32_t slot_key = counted[j] ? key[j] : key[0];
            down_rows[j] = down + (static_cast<long long>(slot_key / MAX_K) * hidden + i) * inter;
            h_rows[j] = h + (static_cast<long long>(n) * top_k + slot_key % MAX_K) * inter;
            sum[j] = 0.0f;
        }
        const T* gate_up = shared.gate_up + static_cast<long long>(n) * shared.gate_up_stride;
        float shared_sum = 0.0f;
        for (int p = lane; p < max(pieces, shared_pieces); p += 32) {
            if (p < pieces) {
#pragma unroll
                for (int j = 0; j < MAX_K; ++j) {
                    float w[VEC];
                    float x[VEC];
                    berrylm::rows::load_vec<T, VEC>(down_rows[j] + p * VEC, w);
                    berrylm::rows::load_vec<T, VEC>(h_rows[j] + p * VEC, x);
#pragma unroll
                    for (int v = 0; v < VEC; ++v) sum[j] = fmaf(w[v], x[v], sum[j]);
                }
            }
            if (p < shared_pieces) {
                float w[VEC];
                float gate[VEC];
                float up[VEC];
                berrylm::rows::load_vec<T, VEC>(shared_row + p * VEC, w);
                berrylm::rows::load_vec<T, VEC>(gate_up + p * VEC, gate);
                berrylm::rows::load_vec<T, VEC>(gate_up + shared.inter + p * VEC, up);
#pragma unroll
                for (int v = 0; v < VEC; ++v) {
                    const float activated = berrylm::round_to<T>(berrylm::silu(gate[v]));
                    const float hv = berrylm::round_to<T>(__fmul_rn(activated, up[v]));
                    shared_sum = fmaf(w[v], hv, shared_sum);
                }
            }
        }
        float routed = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_K; ++j) {
            if (!counted[j]) continue;
            const float out = berrylm::round_to<T>(berrylm::warp_sum(sum[j]));
            const float weight = weights[static_cast<long long>(n) * top_k + key[j] % MAX_K];
            routed = berrylm::round_to<T>(
                __fadd_rn(routed, berrylm::round_to<T>(__fmul_rn(weight, out))));
        }
        const float shared_out = berrylm::round_to<T>(berrylm::warp_sum(shared_sum));
        if (lane == 0) {
            const long long index = static_cast<long long>(n) * hidden + i;
            y[index] = berrylm::moe_residual<T>(
                berrylm::to_f32(residual[index]), routed, shared_out,
                berrylm::to_f32(shared.gate_logit[n * shared.gate_logit_stride]));
        }
    }
}

// The most experts per token the block output kernel takes, and a smaller
// instance for blocks of few experts per token (every slot up to MAX_K is read).
constexpr int kMaxBlockTopK = 8;
constexpr int kFewTopK = 4;

// Both projections of the routed rows, the expert weights in the row format
// `Rows`. A single token's experts each have one row (top-k ids are
// distinct), so they run in the kernels for one row per group.
template <typename T, typename Rows>
void launch_projections(const T* x, const uint32_t* ids, const typename Rows::Weight* gate_up,
                        const typename Rows::Weight* down, T* h, T* expert_out, int routed,
                        int top_k, int experts, int hidden, int inter, cudaStream_t stream) {
    const int by_row = routed < experts ? 1 : 0;
    const unsigned int candidates = static_cast<unsigned int>(by_row ? routed : experts);
    const dim3 gate_up_grid(candidates, (inter + kRowsPerBlock - 1) / kRowsPerBlock);
    const dim3 down_grid(candidates, (hidden + kRowsPerBlock - 1) / kRowsPerBlock);
    berrylm::rows::with_group_size(routed / top_k, [&](auto group) {
        constexpr int kGroup = decltype(group)::value;
        gate_up_kernel<T, Rows, kGroup><<<gate_up_grid, kThreads, 0, stream>>>(
            x, ids, gate_up, h, routed, top_k, experts, hidden, inter, by_row);
        down_kernel<T, Rows, kGroup><<<down_grid, kThreads, 0, stream>>>(
            h, ids, down, expert_out, routed, experts, hidden, inter, by_row);
    });
}

template <typename T>
int launch(const void* x, const float* weights, const uint32_t* ids, const void* gate_up,
           const void* down, void* h, void* expert_out, void* y, int tokens, int top_k,
           int experts, int hidden, int inter, cudaStream_t stream) {
    const T* xp = static_cast<const T*>(x);
    const T* gp = static_cast<const T*>(gate_up);
    const T* dp = static_cast<const T*>(down);
    T* hp = static_cast<T*>(h);
    T* ep = static_cast<T*>(expert_out);
    const int routed = tokens * top_k;
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    const bool vectorized = hidden % kVec == 0 && inter % kVec == 0 && aligned16(x) &&
                            aligned16(gate_up) && aligned16(down) && aligned16(h);
    if (vectorized) {
        launch_projections<T, berrylm::rows::DenseRows<T, kVec>>(
            xp, ids, gp, dp, hp, ep, routed, top_k, experts, hidden, inter, stream);
    } else {
        launch_projections<T, berrylm::rows::DenseRows<T, 1>>(
            xp, ids, gp, dp, hp, ep, routed, top_k, experts, hidden, inter, stream);
    }
    return launch_combine<T>(ep, weights, ids, nullptr, static_cast<T*>(y), tokens, top_k,
                             experts, hidden, stream);
}

// The MoE block of a decode step: gate_up_kernel, then block_output_kernel
// (16-byte loads when the widths and the pointers allow).
template <typename T>
int launch_block(const T* x, const float* weights, const uint32_t* ids, const T* gate_up,
                 const T* down, const SharedExpert<T>& shared, const T* residual, T* h, T* y,
                 int tokens, int top_k, int experts, int hidden, int inter, cudaStream_t stream) {
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    const int routed = tokens * top_k;
    const bool vectorized = hidden % kVec == 0 && inter % kVec == 0 && shared.inter % kVec == 0 &&
                            shared.gate_up_stride % kVec == 0 && aligned16(x) &&
                            aligned16(gate_up) && aligned16(down) && aligned16(h) &&
                            aligned16(shared.gate_up) && aligned16(shared.down);
    const int by_row = routed < experts ? 1 : 0;
    const unsigned int candidates = static_cast<unsigned int>(by_row ? routed : experts);
    const dim3 gate_up_grid(candidates, (inter + kRowsPerBlock - 1) / kRowsPerBlock);
    const unsigned int output_blocks = static_cast<unsigned int>((hidden + kWarps - 1) / kWarps);
    const auto run = [&](auto vec) {
        constexpr int kV = decltype(vec)::value;
        using Rows = berrylm::rows::DenseRows<T, kV>;
        berrylm::rows::with_group_size(tokens, [&](auto group) {
            gate_up_kernel<T, Rows, decltype(group)::value><<<gate_up_grid, kThreads, 0, stream>>>(
                x, ids, gate_up, h, routed, top_k, experts, hidden, inter, by_row);
        });
        if (top_k <= kFewTopK) {
            block_output_kernel<T, kV, kFewTopK><<<output_blocks, kThreads, 0, stream>>>(
                h, weights, ids, down, shared, residual, y, tokens, top_k, experts, hidden, inter);
        } else {
            block_output_kernel<T, kV, kMaxBlockTopK><<<output_blocks, kThreads, 0, stream>>>(
                h, weights, ids, down, shared, residual, y, tokens, top_k, experts, hidden, inter);
        }
    };
    if (vectorized) {
        run(std::integral_constant<int, kVec>{});
    } else {
        run(std::integral_constant<int, 1>{});
    }
    return berrylm::launch_status();
}

// The routed experts with weights in GGUF blocks (`Rows`): x and h 16-byte
// aligned, hidden and inter multiples of the format's block.
template <typename T, typename Rows>
int launch_quantized(const void* x, const float* weights, const uint32_t* ids,
                     const void* gate_up, const void* down, void* h, void* expert_out, void* y,
                     int tokens, int top_k, int experts, int hidden, int inter,
                     cudaStream_t stream) {
    if (hidden % Rows::kBlockWeights != 0 || inter % Rows::kBlockWeights != 0 || !aligned16(x) ||
        !aligned16(h)) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    T* ep = static_cast<T*>(expert_out);
    launch_projections<T, Rows>(static_cast<const T*>(x), ids,
                                static_cast<const uint8_t*>(gate_up),
                                static_cast<const uint8_t*>(down), static_cast<T*>(h), ep,
                                tokens * top_k, top_k, experts, hidden, inter, stream);
    return launch_combine<T>(ep, weights, ids, nullptr, static_cast<T*>(y), tokens, top_k,
                             experts, hidden, stream);
}

// Whether the decode kernels take a call of these sizes (its tokens and
// hidden width not zero).
inline bool sizes_taken(int tokens, int top_k, int experts, int inter) {
    return top_k > 0 && experts > 0 && inter > 0 &&
           static_cast<long long>(tokens) * top_k <= kMaxRouted;
}

}  // namespace berrylm::moe

using namespace berrylm::moe;

// `h` ([tokens * top_k, inter]) and `expert_out` ([tokens * top_k, hidden])
// are scratch of the activation dtype; `y` is [tokens, hidden].
extern "C" int berrylm_moe_experts(int dtype, const void* x, const float* weights,
                                   const uint32_t* ids, const void* gate_up, const void* down,
                                   void* h, void* expert_out, void* y, int tokens, int top_k,
                                   int experts, int hidden, int inter, void* stream) {
    if (tokens == 0 || hidden == 0) return 0;
    if (!sizes_taken(tokens, top_k, experts, inter)) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        return launch<T>(x, weights, ids, gate_up, down, h, expert_out, y, tokens, top_k,
                         experts, hidden, inter, s);
    });
    return 0;
}

// The same with the expert weights in GGUF blocks of the format `format`
// (`GgufCode`): `gate_up` [experts, 2 * inter, hidden] and `down`
// [experts, hidden, inter] as candle lays them out.
extern "C" int berrylm_moe_experts_quantized(int dtype, int format, const void* x,
                                             const float* weights, const uint32_t* ids,
                                             const void* gate_up, const void* down, void* h,
                                             void* expert_out, void* y, int tokens, int top_k,
                                             int experts, int hidden, int inter, void* stream) {
    if (tokens == 0 || hidden == 0) return 0;
    if (!sizes_taken(tokens, top_k, experts, inter)) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        BERRYLM_DISPATCH_GGUF(format, Rows, {
            return launch_quantized<T, Rows>(x, weights, ids, gate_up, down, h, expert_out, y,
                                             tokens, top_k, experts, hidden, inter, s);
        });
    });
    return 0;
}

// The combine step alone, for expert outputs computed elsewhere (the grouped
// GEMMs of a prompt): `expert_out` is [tokens * top_k, hidden] with the routed
// row r at row rows[r]; `y` is [tokens, hidden].
extern "C" int berrylm_moe_combine(int dtype, const void* expert_out, const float* weights,
                                   const uint32_t* ids, const uint32_t* rows, void* y, int tokens,
                                   int top_k, int experts, int hidden, void* stream) {
    if (tokens == 0 || hidden == 0) return 0;
    if (top_k <= 0 || experts <= 0) return static_cast<int>(cudaErrorInvalidValue);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        return launch_combine<T>(static_cast<const T*>(expert_out), weights, ids, rows,
                                 static_cast<T*>(y), tokens, top_k, experts, hidden, s);
    });
    return 0;
}

// The residual stream after a MoE block of a decode step: the routed experts
// of berrylm_moe_experts (`gate_up` [experts, 2 * inter, hidden], `down`
// [experts, hidden, inter]) and the gated shared expert (`shared_gate_up`
// rows [2 * shared_inter] at a stride, `shared_down` [hidden, shared_inter],
// the gate logits at a stride) added to `residual` [tokens, hidden]. `h`
// ([tokens * top_k, inter]) is scratch; `y` is [tokens, hidden]. At most 8
// experts per token.
extern "C" int berrylm_moe_block_decode(int dtype, const void* x, const float* weights,
                                        const uint32_t* ids, const void* gate_up,
                                        const void* down, const void* shared_gate_up,
                                        long long shared_gate_up_stride, const void* shared_down,
                                        int shared_inter, const void* shared_gate_logit,
                                        long long shared_gate_logit_stride, const void* residual,
                                        void* h, void* y, int tokens, int top_k, int experts,
                                        int hidden, int inter, void* stream) {
    if (tokens == 0 || hidden == 0) return 0;
    if (!sizes_taken(tokens, top_k, experts, inter) || top_k > kMaxBlockTopK ||
        shared_inter <= 0 || shared_gate_up_stride < 2ll * shared_inter) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        const SharedExpert<T> shared{static_cast<const T*>(shared_gate_up), shared_gate_up_stride,
                                     static_cast<const T*>(shared_down), shared_inter,
                                     static_cast<const T*>(shared_gate_logit),
                                     shared_gate_logit_stride};
        return launch_block<T>(static_cast<const T*>(x), weights, ids,
                               static_cast<const T*>(gate_up), static_cast<const T*>(down), shared,
                               static_cast<const T*>(residual), static_cast<T*>(h),
                               static_cast<T*>(y), tokens, top_k, experts, hidden, inter, s);
    });
    return 0;
}
