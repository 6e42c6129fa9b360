// Declarations shared by the KDA recurrence kernels: recurrence.cu (the
// sequential kernels and the dispatch) and chunked.cu (the chunked prefill).
#pragma once

#include "common.cuh"

namespace berrylm::recurrence {

constexpr float kL2NormEps = 1e-6f;

struct RecurrenceArgs {
    const void* q;           // [B, T, Hk, dk], T
    const void* k;           // [B, T, Hk, dk], T
    const void* v;           // [B, T, Hv, dv], T
    const float* g;          // [B, T, Hv, dk]
    const float* beta;       // [B, T, Hv]
    const float* state_in;   // [rows, Hv, dk, dv]
    float* out;              // [B, T, Hv, dv]
    float* state_out;        // [rows, Hv, dk, dv]; may equal state_in (a pool updated in place)
    const uint32_t* slots;   // [B] state row of each sequence, or null: row b (rows = B)
    int state_rows;          // rows of state_in / state_out
    int seq_len, key_heads, value_heads, key_dim, value_dim;
    float query_scale;
};

// The state row of sequence b: slots[b] for a pool, else b; -1 when the slot
// is out of range: a pad row (PAD_SLOT in the Rust API), which starts from a
// zero state and writes no state. The Rust API validates the other slots on
// the host, so out-of-range values other than PAD_SLOT never come.
//
// In place (state_in == state_out) is safe in every kernel using this: each
// thread loads its own state elements into registers before any write and
// stores exactly those elements, so no element is read by one thread and
// written by another; distinct slots give blocks of different sequences
// disjoint state regions.
__device__ __forceinline__ long long state_row(const RecurrenceArgs& args, int b) {
    if (args.slots == nullptr) return b;
    const uint32_t slot = args.slots[b];
    return slot < static_cast<uint32_t>(args.state_rows) ? static_cast<long long>(slot) : -1;
}

// The inverse L2 norms 1 / sqrt(sum(x^2) + eps) of one token's q and k
// (x and y), `width` channels each, in every lane of the calling warp (lane
// l sums channels l, l + 32, ...).
__device__ __forceinline__ float2 inverse_l2_norms(const float* q, const float* k, int width,
                                                   int lane) {
    float q_sq = 0.0f, k_sq = 0.0f;
    for (int c = lane; c < width; c += 32) {
        q_sq += q[c] * q[c];
        k_sq += k[c] * k[c];
    }
    q_sq = berrylm::warp_sum(q_sq);
    k_sq = berrylm::warp_sum(k_sq);
    return make_float2(1.0f / sqrtf(q_sq + kL2NormEps), 1.0f / sqrtf(k_sq + kL2NormEps));
}

// Normalises one token's q (then scaled by `query_scale`) and k in place,
// one warp.
__device__ __forceinline__ void l2_normalize_qk(float* q, float* k, int width, int lane,
                                                float query_scale) {
    const float2 inv = inverse_l2_norms(q, k, width, lane);
    for (int c = lane; c < width; c += 32) {
        q[c] = (q[c] * inv.x) * query_scale;
        k[c] = k[c] * inv.y;
    }
}

// Largest head dims of the chunked prefill.
constexpr int kChunkMaxDk = 128;
constexpr int kChunkMaxDv = 128;

// The chunked prefill (chunked.cu), instantiated for float, __nv_bfloat16
// and __half; needs T > 1, dk <= kChunkMaxDk, dv <= kChunkMaxDv.
template <typename T>
int launch_chunked(const RecurrenceArgs& args, int batch, cudaStream_t stream);

}  // namespace berrylm::recurrence
