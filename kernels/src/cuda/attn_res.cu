// Gated Block AttnRes depth mixing (spec 3.4), one thread block per token:
//   key_s   = s / sqrt(mean(s^2) + eps)        logit_s = <key_s, q>
//   p       = softmax_s(logit)                 (max-subtracted, f32)
//   mix     = round_x(sum_s p_s * s)           (sources in order, no FMA)
//   ungated: y = mix
//   gated:   y = round_x(x + round_x(t * round_x(mix - x))),  t = round_x(tanh(g))
// The sums of squares and the logit dot products are block reductions in no
// particular order; the softmax runs in the CPU's order, and the mixture and
// the gated blend round where the CPU reference does.
//
// Optionally followed by the layer's input norm of y (norm.cu's (1 + w)
// RMSNorm), which the vector path computes from the y in its registers and
// writes beside it (norm_rows.cuh's vector layout: the same values as
// offset_rms_norm of the stored y, bit for bit); the generic path launches
// that norm after it.
//
// Two paths, chosen per call:
// * vector (hidden % 8 == 0, hidden <= 4096, every pointer 16-byte aligned):
//   a block of round_up(hidden / 8, 32) threads, thread i owning the elements
//   [8i, 8i + 8) of the token's row, read and written as 16-byte vectors
//   (two for f32). Each source is read from memory once and kept for the
//   three passes (sums of squares, logits, mixture): up to 4 or 8 sources
//   all in registers (a kernel instantiated for each bound); more sources,
//   the first 4 in registers and the rest in dynamic shared memory, copied
//   there with cp.async (a thread reads back only what it copied). Where
//   those rows exceed a block's shared memory, the sources are read again in
//   every pass instead, 8 at a time. Each pass reduces its per-source
//   partials over a warp with a transposing butterfly (at each step a lane
//   hands half of its sums to its partner), then over the warps through
//   shared memory; warp 0 evaluates the softmax (the denominator summed in
//   source order) and shares the probabilities.
// * generic (any other shape): 256 threads stride over the row with scalar
//   loads and read the sources three times; a token's rows are small enough
//   to stay in L1/L2 between the passes.
#include "common.cuh"
#include "norm_rows.cuh"
#include "weight_rows.cuh"

// The offset norm's entry point (norm.cu), for the generic path's norm.
extern "C" int berrylm_offset_rms_norm(int x_dtype, const void* x, const void* delta,
                                       const float* scale, void* sum_out, void* out,
                                       long long rows, int width, float inv_width, float eps,
                                       void* stream);

namespace berrylm::attn_res {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSources = 32;  // must match MAX_ATTN_RES_SOURCES in src/cuda/attn_res.rs

struct Sources {
    const void* ptr[kMaxSources];
};

// The input norm after the mix: `normed` = (1 + w) RMSNorm of the output
// with `scale` = 1 + w (f32); no norm when `normed` is null.
struct Norm {
    const float* scale;
    void* normed;
    float inv_width;
    float eps;
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

// ----------------------------------------------------------- generic path

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

// ------------------------------------------------------------ vector path

constexpr int kVecWidth = 8;  // elements per thread and source
constexpr int kVecMaxThreads = 512;
constexpr int kVecMaxWarps = kVecMaxThreads / 32;

// Eight consecutive elements of T as raw 32-bit words (one 16-byte vector for
// 16-bit T, two for f32).
template <typename T> struct Pack {
    static constexpr int kWords = 2 * static_cast<int>(sizeof(T));
    unsigned int word[kWords];
};

template <typename T> __device__ __forceinline__ Pack<T> zero_pack() {
    Pack<T> pack;
#pragma unroll
    for (int i = 0; i < Pack<T>::kWords; ++i) pack.word[i] = 0u;
    return pack;
}

// `p` must be 16-byte aligned.
template <typename T> __device__ __forceinline__ Pack<T> load_pack(const T* p) {
    Pack<T> pack;
    const uint4* vectors = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < Pack<T>::kWords / 4; ++i) {
        const uint4 v = __ldg(vectors + i);
        pack.word[4 * i + 0] = v.x;
        pack.word[4 * i + 1] = v.y;
        pack.word[4 * i + 2] = v.z;
        pack.word[4 * i + 3] = v.w;
    }
    return pack;
}

// Element `i` (a compile-time index once unrolled) widened to f32, exactly.
__device__ __forceinline__ float element(const Pack<float>& pack, int i) {
    return __uint_as_float(pack.word[i]);
}
__device__ __forceinline__ float element(const Pack<__nv_bfloat16>& pack, int i) {
    const unsigned int w = pack.word[i >> 1];
    return __uint_as_float((i & 1) != 0 ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ float element(const Pack<__half>& pack, int i) {
    const unsigned int w = pack.word[i >> 1];
    const unsigned short bits = static_cast<unsigned short>((i & 1) != 0 ? (w >> 16) : w);
    return __half2float(__ushort_as_half(bits));
}

// Sums each of v[0..N) over the warp (N a power of two, at most 32): at each
// butterfly step a lane keeps half of its values, adds its partner's partials
// of them, and hands the other half over, so N - 1 shuffles reduce N values
// to one per lane; the steps left sum that one. Returns, in lane l, the warp
// total of v[l / (32 / N)]; v is clobbered.
template <int N> __device__ __forceinline__ float warp_sums_transposed(float (&v)[N]) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N must be a power of two <= 32");
    const int lane = threadIdx.x & 31;
    int offset = 16;
#pragma unroll
    for (int n = N; n > 1; n >>= 1) {
        const int half = n >> 1;
        const bool upper = (lane & offset) != 0;
#pragma unroll
        for (int j = 0; j < half; ++j) {
            const float send = upper ? v[j] : v[j + half];
            const float keep = upper ? v[j + half] : v[j];
            v[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
        offset >>= 1;
    }
    float total = v[0];
#pragma unroll
    for (; offset > 0; offset >>= 1) total += __shfl_xor_sync(0xffffffffu, total, offset);
    return total;
}

// Where a kernel keeps the sources between its three passes.
enum class Keep {
    kRegisters,  // num_sources <= kChunk: all in registers
    kShared,     // [0, kChunk) in registers, the rest in dynamic shared memory
    kStream,     // nowhere: every pass reads every source again, kChunk at a time
};

// Registers a thread, by the registers that the packs take: 6 blocks of 256
// threads a multiprocessor for 4 16-bit sources held, 4 blocks for 8 (or 4
// held and 4 in flight from shared memory); otherwise 128, what blocks of
// kVecMaxThreads threads allow.
constexpr int register_cap(int pack_registers) {
    return pack_registers <= 16 ? 40 : pack_registers <= 32 ? 64 : 128;
}
// With the norm, 8 more for the norm's scale.
template <typename TS>
constexpr int register_cap(Keep keep, int chunk, bool norm) {
    return (keep == Keep::kStream
                ? 128
                : register_cap((keep == Keep::kShared ? 2 : 1) * chunk * Pack<TS>::kWords)) +
           (norm ? kVecWidth : 0);
}

__device__ __forceinline__ void copy_async16(void* shared, const void* global) {
    const unsigned int address = static_cast<unsigned int>(__cvta_generic_to_shared(shared));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global)
                 : "memory");
}

__device__ __forceinline__ void copy_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// blockDim.x = round_up(hidden / kVecWidth, 32) <= kVecMaxThreads. With
// Keep::kShared (only for num_sources > kChunk), the dynamic shared memory
// holds (num_sources - kChunk) packs of blockDim.x threads. kNorm: `norm`
// is applied (its `normed` not null).
template <typename TS, typename TO, int kChunk, Keep kKeep, bool kNorm>
__global__ void __maxnreg__(register_cap<TS>(kKeep, kChunk, kNorm))
    attn_res_mix_vec_kernel(Sources sources, int num_sources, const float* __restrict__ query,
                            TO* __restrict__ out, int hidden, float eps, int gated,
                            float strength, Norm norm) {
    static_assert(kChunk == 4 || kChunk == 8, "chunks of 4 or 8 sources");
    constexpr int kStride = 32 / kChunk;  // lanes per warp total of a source
    constexpr int kVectors = Pack<TS>::kWords / 4;  // 16-byte vectors a pack
    __shared__ float scratch[kVecMaxWarps][kMaxSources];
    __shared__ float inv_rms[kMaxSources];
    __shared__ float prob[kMaxSources];
    __shared__ float norm_partial[kVecMaxWarps];
    extern __shared__ uint4 kept[];  // [source - kChunk][vector][thread]
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const bool active = static_cast<int>(threadIdx.x) < hidden / kVecWidth;
    const long long offset = static_cast<long long>(blockIdx.x) * hidden +
                             static_cast<long long>(threadIdx.x) * kVecWidth;
    auto source_row = [&](int s) { return static_cast<const TS*>(sources.ptr[s]) + offset; };
    auto kept_vector = [&](int s, int k) -> uint4& {
        return kept[((s - kChunk) * kVectors + k) * blockDim.x + threadIdx.x];
    };
    // A thread reads back only the shared memory that it filled itself.
    auto load_kept = [&](int s) {
        Pack<TS> pack;
#pragma unroll
        for (int k = 0; k < kVectors; ++k) {
            const uint4 v = kept_vector(s, k);
            pack.word[4 * k + 0] = v.x;
            pack.word[4 * k + 1] = v.y;
            pack.word[4 * k + 2] = v.z;
            pack.word[4 * k + 3] = v.w;
        }
        return pack;
    };

    // Sources [0, kChunk) stay in `held` (unused when streaming); the others
    // pass through `work`, kChunk at a time.
    Pack<TS> held[kChunk];
    Pack<TS> work[kChunk];
    auto load_chunk = [&](Pack<TS>(&packs)[kChunk], int base) {
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
            const int s = base + c;
            if (s < num_sources) {
                if (!active) {
                    packs[c] = zero_pack<TS>();
                } else if constexpr (kKeep == Keep::kShared) {
                    packs[c] = load_kept(s);
                } else {
                    packs[c] = load_pack(source_row(s));
                }
            }
        }
    };
    // Runs body(base, packs) over the chunks of sources, in source order.
    auto for_each_chunk = [&](auto&& body) {
        if constexpr (kKeep != Keep::kStream) body(0, held);
        if constexpr (kKeep != Keep::kRegisters) {
            for (int base = kKeep == Keep::kStream ? 0 : kChunk; base < num_sources;
                 base += kChunk) {
                load_chunk(work, base);
                body(base, work);
            }
        }
    };
    // Lane l % kStride == 0 publishes the warp total of source base + l / kStride.
    auto publish = [&](int base, float (&partial)[kChunk]) {
        const float total = warp_sums_transposed(partial);
        const int s = base + lane / kStride;
        if (lane % kStride == 0 && s < num_sources) scratch[warp][s] = total;
    };

    if constexpr (kKeep == Keep::kShared) {
        if (active) {
            for (int s = kChunk; s < num_sources; ++s) {
#pragma unroll
                for (int k = 0; k < kVectors; ++k) {
                    copy_async16(&kept_vector(s, k),
                                 reinterpret_cast<const uint4*>(source_row(s)) + k);
                }
            }
        }
    }
    if constexpr (kKeep != Keep::kStream) {
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
            if (c < num_sources) held[c] = active ? load_pack(source_row(c)) : zero_pack<TS>();
        }
    }
    // x, for the gated blend (read back from shared memory where it is kept).
    Pack<TS> current = zero_pack<TS>();
    if constexpr (kKeep != Keep::kShared) {
        if (gated != 0 && active) current = load_pack(source_row(num_sources - 1));
    }
    if constexpr (kKeep == Keep::kShared) copy_async_wait_all();

    // Pass 1: sums of squares -> inv_rms.
    for_each_chunk([&](int base, const Pack<TS>(&packs)[kChunk]) {
        float partial[kChunk];
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
            partial[c] = 0.0f;
            if (base + c < num_sources) {
#pragma unroll
                for (int i = 0; i < kVecWidth; ++i) {
                    const float v = element(packs[c], i);
                    partial[c] += v * v;
                }
            }
        }
        publish(base, partial);
    });
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < num_sources) {
        float total = 0.0f;
        for (int w = 0; w < warps; ++w) total += scratch[w][threadIdx.x];
        const float mean_sq = __fdiv_rn(total, static_cast<float>(hidden));
        inv_rms[threadIdx.x] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_sq, eps)));
    }
    __syncthreads();

    // Pass 2: logits.
    float q[kVecWidth] = {};
    if (active) berrylm::rows::load_vec<float, kVecWidth>(query + threadIdx.x * kVecWidth, q);
    for_each_chunk([&](int base, const Pack<TS>(&packs)[kChunk]) {
        float partial[kChunk];
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
            partial[c] = 0.0f;
            if (base + c < num_sources) {
                const float r = inv_rms[base + c];
#pragma unroll
                for (int i = 0; i < kVecWidth; ++i) {
                    partial[c] += __fmul_rn(element(packs[c], i), r) * q[i];
                }
            }
        }
        publish(base, partial);
    });
    __syncthreads();

    // Softmax in warp 0: lane s holds logit s; the denominator is summed in
    // source order, as on the CPU.
    if (warp == 0) {
        float logit = -INFINITY;
        if (lane < num_sources) {
            logit = 0.0f;
            for (int w = 0; w < warps; ++w) logit += scratch[w][lane];
        }
        const float max_logit = berrylm::warp_max(logit);
        const float e = lane < num_sources ? expf(__fsub_rn(logit, max_logit)) : 0.0f;
        float denominator = 0.0f;
        for (int s = 0; s < num_sources; ++s) {
            denominator = __fadd_rn(denominator, __shfl_sync(0xffffffffu, e, s));
        }
        if (lane < num_sources) prob[lane] = __fdiv_rn(e, denominator);
    }
    __syncthreads();

    // The norm's scale, in flight during pass 3 (q's registers are free).
    float norm_scale[kVecWidth] = {};
    if constexpr (kNorm) {
        if (active) {
            berrylm::rows::load_vec<float, kVecWidth>(norm.scale + threadIdx.x * kVecWidth,
                                                      norm_scale);
        }
    }

    // Pass 3: the mixture, sources in order, then the gated blend.
    float mix[kVecWidth];
#pragma unroll
    for (int i = 0; i < kVecWidth; ++i) mix[i] = 0.0f;
    for_each_chunk([&](int base, const Pack<TS>(&packs)[kChunk]) {
#pragma unroll
        for (int c = 0; c < kChunk; ++c) {
            if (base + c < num_sources) {
                const float p = prob[base + c];
#pragma unroll
                for (int i = 0; i < kVecWidth; ++i) {
                    mix[i] = __fadd_rn(mix[i], __fmul_rn(p, element(packs[c], i)));
                }
            }
        }
    });
    float y[kVecWidth] = {};
    if (active) {
        if constexpr (kKeep == Keep::kShared) {
            if (gated != 0) current = load_kept(num_sources - 1);
        }
#pragma unroll
        for (int i = 0; i < kVecWidth; ++i) {
            const float m = berrylm::round_to<TO>(mix[i]);
            if (gated != 0) {
                const float x = element(current, i);
                const float difference = berrylm::round_to<TO>(__fsub_rn(m, x));
                const float step = berrylm::round_to<TO>(__fmul_rn(strength, difference));
                y[i] = __fadd_rn(x, step);
            } else {
                y[i] = m;
            }
        }
        berrylm::store8(out + offset, y);
    }
    if constexpr (kNorm) {
        // The norm of y as stored (rounded to TO); zeros past the row's end.
        float stored[kVecWidth];
#pragma unroll
        for (int i = 0; i < kVecWidth; ++i) stored[i] = berrylm::round_to<TO>(y[i]);
        const float rms = berrylm::norm_rows::vec_row_root(stored, norm_partial, norm.inv_width,
                                                           norm.eps);
        if (!active) return;
        float normed[kVecWidth];
        berrylm::norm_rows::vec_row_normed(stored, rms, norm_scale, normed);
        berrylm::store8(static_cast<TO*>(norm.normed) + offset, normed);
    }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Static shared memory of attn_res_mix_vec_kernel.
constexpr int kVecStaticShared =
    static_cast<int>(sizeof(float)) * ((kVecMaxWarps + 2) * kMaxSources + kVecMaxWarps);

// The arguments of a call, the same for every kernel it may launch.
struct Call {
    Sources sources;
    int num_sources;
    const float* query;
    void* out;
    long long tokens;
    int hidden;
    float eps;
    int gated;
    float strength;
    Norm norm;
};

// `shared_opt_in`: when nonzero, the dynamic shared memory that the kernel is
// allowed (always the device's maximum, so that concurrent calls agree).
template <typename TS, typename TO, int kChunk, Keep kKeep, bool kNorm>
int launch_vec(const Call& call, size_t shared_bytes, int shared_opt_in, cudaStream_t stream) {
    const int threads = (call.hidden / kVecWidth + 31) / 32 * 32;
    auto kernel = attn_res_mix_vec_kernel<TS, TO, kChunk, kKeep, kNorm>;
    if (shared_opt_in > 0) {
        const cudaError_t status = cudaFuncSetAttribute(
            kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_opt_in);
        if (status != cudaSuccess) return static_cast<int>(status);
    }
    kernel<<<static_cast<unsigned int>(call.tokens), threads, shared_bytes, stream>>>(
        call.sources, call.num_sources, call.query, static_cast<TO*>(call.out), call.hidden,
        call.eps, call.gated, call.strength, call.norm);
    return berrylm::launch_status();
}

// The vector kernel keeping the sources as `call` needs (see the header).
template <typename TS, typename TO, bool kNorm>
int launch_vec_for(const Call& call, cudaStream_t stream) {
    if (call.num_sources <= 4) {
        return launch_vec<TS, TO, 4, Keep::kRegisters, kNorm>(call, 0, 0, stream);
    }
    if (call.num_sources <= 8) {
        return launch_vec<TS, TO, 8, Keep::kRegisters, kNorm>(call, 0, 0, stream);
    }
    const int threads = (call.hidden / kVecWidth + 31) / 32 * 32;
    const size_t shared_bytes =
        static_cast<size_t>(call.num_sources - 4) * threads * kVecWidth * sizeof(TS);
    // Within the default 48 KiB a block, or opted in up to the device's
    // maximum (static shared memory included).
    int shared_limit = 48 * 1024;
    int shared_opt_in = 0;
    if (shared_bytes + kVecStaticShared > static_cast<size_t>(shared_limit)) {
        int device = 0;
        cudaError_t status = cudaGetDevice(&device);
        if (status == cudaSuccess) {
            status =
                cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
        }
        if (status != cudaSuccess) return static_cast<int>(status);
        shared_opt_in = shared_limit - kVecStaticShared;
    }
    if (shared_bytes + kVecStaticShared <= static_cast<size_t>(shared_limit)) {
        return launch_vec<TS, TO, 4, Keep::kShared, kNorm>(call, shared_bytes, shared_opt_in,
                                                           stream);
    }
    return launch_vec<TS, TO, 8, Keep::kStream, kNorm>(call, 0, 0, stream);
}

// The vector path where the shape and the pointers allow it (see the header),
// the generic kernel (then the norm's own kernel) otherwise.
template <typename TS, typename TO>
int launch(const Call& call, int out_dtype, cudaStream_t stream) {
    const bool norm = call.norm.normed != nullptr;
    bool vector = call.hidden % kVecWidth == 0 && call.hidden / kVecWidth <= kVecMaxThreads &&
                  aligned16(call.query) && aligned16(call.out) &&
                  (!norm || (aligned16(call.norm.scale) && aligned16(call.norm.normed)));
    for (int s = 0; s < call.num_sources; ++s) vector = vector && aligned16(call.sources.ptr[s]);
    if (vector) {
        return norm ? launch_vec_for<TS, TO, true>(call, stream)
                    : launch_vec_for<TS, TO, false>(call, stream);
    }
    attn_res_mix_kernel<TS, TO><<<static_cast<unsigned int>(call.tokens), kThreads, 0, stream>>>(
        call.sources, call.num_sources, call.query, static_cast<TO*>(call.out), call.hidden,
        call.eps, call.gated, call.strength);
    const int status = berrylm::launch_status();
    if (status != 0 || !norm) return status;
    return berrylm_offset_rms_norm(out_dtype, call.out, nullptr, call.norm.scale, nullptr,
                                   call.norm.normed, call.tokens, call.hidden,
                                   call.norm.inv_width, call.norm.eps, stream);
}

}  // namespace berrylm::attn_res

using namespace berrylm::attn_res;

// `sources` is a host array of `num_sources` device pointers, all of
// `src_dtype`; the last one is the current stream x. `out_dtype` is the dtype
// of x and must equal `src_dtype` unless `src_dtype` is f32 (sources widened
// by the caller). `strength` is round_x(tanh(g)), used when `gated` != 0.
// With `normed` (else null), the output's (1 + w) RMSNorm is written there:
// `norm_scale` = 1 + w (f32, `hidden` long), `inv_width` = 1/hidden rounded
// to f32, `norm_eps`.
extern "C" int berrylm_attn_res_mix(int src_dtype, int out_dtype, const void* const* sources,
                                    int num_sources, const float* query, void* out,
                                    long long tokens, int hidden, float eps, int gated,
                                    float strength, const float* norm_scale, void* normed,
                                    float inv_width, float norm_eps, void* stream) {
    if (tokens == 0 || hidden == 0) return 0;
    if (num_sources < 1 || num_sources > kMaxSources || tokens > 0x7fffffffll) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    Call call{};
    for (int s = 0; s < num_sources; ++s) call.sources.ptr[s] = sources[s];
    call.num_sources = num_sources;
    call.query = query;
    call.out = out;
    call.tokens = tokens;
    call.hidden = hidden;
    call.eps = eps;
    call.gated = gated;
    call.strength = strength;
    call.norm = Norm{norm_scale, normed, inv_width, norm_eps};
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    if (src_dtype == out_dtype) {
        BERRYLM_DISPATCH_DTYPE(src_dtype, T, { return launch<T, T>(call, out_dtype, st); });
    } else if (src_dtype == berrylm::kF32) {
        BERRYLM_DISPATCH_DTYPE(out_dtype, TO, { return launch<float, TO>(call, out_dtype, st); });
    }
    return static_cast<int>(cudaErrorInvalidValue);
}
