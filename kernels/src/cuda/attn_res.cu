// Gated Block AttnRes depth mixing (spec 3.4), one thread block per token:
//   key_s   = s / sqrt(mean(s^2) + eps)        logit_s = <key_s, q>
//   p       = softmax_s(logit)                 (max-subtracted, f32)
//   mix     = round_x(sum_s p_s * s)           (sources in order, no FMA)
//   ungated: y = mix
//   gated:   y = round_x(x + round_x(t * round_x(mix - x))),  t = round_x(tanh(g))
// The sources are read three times (sums of squares, logits, mixture); a
// token's rows are small enough to stay in L1/L2 between the passes.
#include "common.cuh"

namespace berrylm::attn_res {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSources = 32;  // must match MAX_ATTN_RES_SOURCES in src/cuda/attn_res.rs

struct Sources {
    const void* ptr[kMaxSources];
};

// Block-wide sums of `count` per-thread partials (count <= kMaxSources);
// results land in `result[0..count)`, visible to every thread on return.
__device__ __forceinline__ void block_sums(float (&partial)[kMaxSources], int count,
                                           float (*scratch)[kMaxSources], float* result) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int s = 0; s < kMaxSources; ++s) {
        if (s < count) {
            const float v = berrylm::warp_sum(partial[s]);
            if (lane == 0) scratch[warp][s] = v;
        }
    }
    __syncthreads();
    if (threadIdx.x < count) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) total += scratch[w][threadIdx.x];
        result[threadIdx.x] = total;
    }
    __syncthreads();
}

template <typename TS, typename TO>
__global__ void __launch_bounds__(kThreads)
    attn_res_mix_kernel(Sources sources, int num_sources, const float* __restrict__ query,
                        TO* __restrict__ out, int hidden, float eps, int gated, float strength) {
    __shared__ float scratch[kWarps][kMaxSources];
    __shared__ float inv_rms[kMaxSources];
    __shared__ float logits[kMaxSources];
    const long long token_offset = static_cast<long long>(blockIdx.x) * hidden;
    auto value = [&](int s, int h) {
        return berrylm::to_f32(static_cast<const TS*>(sources.ptr[s])[token_offset + h]);
    };

    float partial[kMaxSources];
#pragma unroll
    for (int s = 0; s < kMaxSources; ++s) partial[s] = 0.0f;
    for (int h = threadIdx.x; h < hidden; h += kThreads) {
#pragma unroll
        for (int s = 0; s < kMaxSources; ++s) {
            if (s < num_sources) {
                const float v = value(s, h);
                partial[s] += v * v;
            }
        }
    }
    block_sums(partial, num_sources, scratch, inv_rms);
    if (threadIdx.x < num_sources) {
        const float mean_sq = __fdiv_rn(inv_rms[threadIdx.x], static_cast<float>(hidden));
        inv_rms[threadIdx.x] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_sq, eps)));
    }
    __syncthreads();

#pragma unroll
    for (int s = 0; s < kMaxSources; ++s) partial[s] = 0.0f;
    for (int h = threadIdx.x; h < hidden; h += kThreads) {
        const float qh = query[h];
#pragma unroll
        for (int s = 0; s < kMaxSources; ++s) {
            if (s < num_sources) partial[s] += __fmul_rn(value(s, h), inv_rms[s]) * qh;
        }
    }
    block_sums(partial, num_sources, scratch, logits);

    // Softmax, evaluated redundantly by every thread in the CPU's order.
    float max_logit = -INFINITY;
    for (int s = 0; s < num_sources; ++s) max_logit = fmaxf(max_logit, logits[s]);
    float prob[kMaxSources];
    float denominator = 0.0f;
#pragma unroll
    for (int s = 0; s < kMaxSources; ++s) {
        if (s < num_sources) {
            prob[s] = expf(__fsub_rn(logits[s], max_logit));
            denominator = __fadd_rn(denominator, prob[s]);
        }
    }
#pragma unroll
    for (int s = 0; s < kMaxSources; ++s) {
        if (s < num_sources) prob[s] = __fdiv_rn(prob[s], denominator);
    }

    TO* out_row = out + token_offset;
    for (int h = threadIdx.x; h < hidden; h += kThreads) {
        float mix = 0.0f;
#pragma unroll
        for (int s = 0; s < kMaxSources; ++s) {
            if (s < num_sources) mix = __fadd_rn(mix, __fmul_rn(prob[s], value(s, h)));
        }
        mix = berrylm::round_to<TO>(mix);
        if (gated) {
            const float x = value(num_sources - 1, h);
            const float difference = berrylm::round_to<TO>(__fsub_rn(mix, x));
            const float step = berrylm::round_to<TO>(__fmul_rn(strength, difference));
            out_row[h] = berrylm::from_f32<TO>(__fadd_rn(x, step));
        } else {
            out_row[h] = berrylm::from_f32<TO>(mix);
        }
    }
}

template <typename TS, typename TO>
int launch(const Sources& sources, int num_sources, const float* query, void* out,
           long long tokens, int hidden, float eps, int gated, float strength,
           cudaStream_t stream) {
    attn_res_mix_kernel<TS, TO><<<static_cast<unsigned int>(tokens), kThreads, 0, stream>>>(
        sources, num_sources, query, static_cast<TO*>(out), hidden, eps, gated, strength);
    return berrylm::launch_status();
}

}  // namespace berrylm::attn_res

using namespace berrylm::attn_res;

// `sources` is a host array of `num_sources` device pointers, all of
// `src_dtype`; the last one is the current stream x. `out_dtype` is the dtype
// of x and must equal `src_dtype` unless `src_dtype` is f32 (sources widened
// by the caller). `strength` is round_x(tanh(g)), used when `gated` != 0.
extern "C" int berrylm_attn_res_mix(int src_dtype, int out_dtype, const void* const* sources,
                                    int num_sources, const float* query, void* out,
                                    long long tokens, int hidden, float eps, int gated,
                                    float strength, void* stream) {
    if (tokens == 0 || hidden == 0) return 0;
    if (num_sources < 1 || num_sources > kMaxSources || tokens > 0x7fffffffll) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    Sources table{};
    for (int s = 0; s < num_sources; ++s) table.ptr[s] = sources[s];
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (src_dtype == out_dtype) {
        BERRYLM_DISPATCH_DTYPE(src_dtype, T, {
            return launch<T, T>(table, num_sources, query, out, tokens, hidden, eps, gated,
                                strength, st);
        });
    } else if (src_dtype == berrylm::kF32) {
        BERRYLM_DISPATCH_DTYPE(out_dtype, TO, {
            return launch<float, TO>(table, num_sources, query, out, tokens, hidden, eps, gated,
                                     strength, st);
        });
    }
    return static_cast<int>(cudaErrorInvalidValue);
}
