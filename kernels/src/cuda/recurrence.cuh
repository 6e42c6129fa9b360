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
    const float* state_in;   // [B, Hv, dk, dv]
    float* out;              // [B, T, Hv, dv]
    float* state_out;        // [B, Hv, dk, dv]
    int seq_len, key_heads, value_heads, key_dim, value_dim;
    float query_scale;
};

// Largest head dims of the chunked prefill.
constexpr int kChunkMaxDk = 128;
constexpr int kChunkMaxDv = 128;

// The chunked prefill (chunked.cu), instantiated for float, __nv_bfloat16
// and __half; needs T > 1, dk <= kChunkMaxDk, dv <= kChunkMaxDv.
template <typename T>
int launch_chunked(const RecurrenceArgs& args, int batch, cudaStream_t stream);

}  // namespace berrylm::recurrence
