// KDA delta-rule recurrence (spec 3.6 step 6), token by token, fp32 state.
//
// Per (sequence b, value head h) with S the dk x dv state and, per token t,
//   q^ = l2norm(q) * dk^-0.5,  k^ = l2norm(k)        (eps 1e-6)
//   S[c, :] *= exp(g[c]);  u = S^T k^;  d = beta * (v - u);  S += k^ d^T
//   o = S^T q^                                        (after the write)
// Every column e of S evolves independently given k^, q^, exp(g) and beta, so
// the kernels split the value columns across thread blocks and reduce only
// over the key rows c inside a block. The state lives in registers for the
// whole call: it is read from global memory once and written once.
//
// Three paths:
// * `chunked` (prefill, T > 1, dk <= 128, dv <= 128; when the caller passes
//   prefill_algorithm = kPrefillChunked): chunks of 64 tokens with TF32
//   tensor-core matmuls, in chunked.cu (its header has the details).
// * `tiles` (any T, any dk <= 256, any dv; all other prefills): one block
//   per (b, h, tile of 32 value columns); lane l owns column 32 * tile + l,
//   warp w owns R rows.
//   Token inputs are staged in chunks of CH tokens: the next chunk's q, k, g,
//   v, beta are loaded into registers while the current chunk is computed,
//   then written to shared memory, where each warp L2-normalises whole
//   tokens' q and k in place. Per token: one __syncthreads (the 4-/8-way sum
//   of u across warps); the outputs of a chunk are summed and written after it.
// * `rows` (decode, T = 1, dv = 128, dk <= 128, 16-byte aligned states): one
//   block per (b, h) streaming the whole 64 KiB head: each warp reads full
//   512-byte rows as float4 (lane l owns columns 4l..4l+3) and owns 16 rows,
//   so every block reads and writes one contiguous region. Chosen for
//   B * Hv >= 128 (about one block per SM or more); the `tiles` kernel, with
//   4x more blocks, serves smaller decode batches.
//
// The fused decode step (berrylm_kda_decode_gated) is the `rows` kernel with
// its inputs and output widened to the KDA layer's: each block computes its
// head's forget gate and write strength from the projections (gate.cuh) and,
// holding the head's whole output row, the gated RMSNorm (gated_norm.cuh),
// so that a decode step's gate, beta, recurrence and norm are one launch
// instead of four, computed with the same operations.
//
// In a pool (berrylm_kda_recurrence with slots), every kernel reads and writes
// the state of sequence b at row slots[b] of the pool, in place
// (`state_row` in recurrence.cuh says why that is safe); the kernel choice
// is the same as for separate state arrays.
//
// The decode kernel (rows or tiles) is chosen only by that size and
// alignment rule; the prefill algorithm is the caller's explicit choice
// (`prefill_algorithm` of berrylm_kda_recurrence). Nothing here reads the
// environment.
#include "gate.cuh"
#include "gated_norm.cuh"
#include "recurrence.cuh"

namespace berrylm::recurrence {

// ---------------------------------------------------------------- tiles

template <typename T, int NW, int R, int CH>
__global__ void __launch_bounds__(NW * 32)
    kda_recurrence_tiles(const RecurrenceArgs args) {
    constexpr int kThreads = NW * 32;
    constexpr int kMaxDk = NW * R;
    constexpr int kPerThread = CH * kMaxDk / kThreads;  // staged q/k/g entries per thread
    constexpr int kVPerThread = CH * 32 / kThreads > 0 ? CH * 32 / kThreads : 1;
    static_assert(CH * kMaxDk % kThreads == 0, "chunk must tile the block");
    static_assert(CH <= kThreads, "one beta per thread");

    __shared__ float sh_q[CH][kMaxDk];      // q^ after normalisation
    __shared__ float sh_k[CH][kMaxDk];      // k^ after normalisation
    __shared__ float sh_decay[CH][kMaxDk];  // exp(g)
    __shared__ float sh_v[CH][32];
    __shared__ float sh_beta[CH];
    __shared__ float red_u[2][NW][32];
    __shared__ float o_part[CH][NW][32];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int tile = blockIdx.x;
    const int e = tile * 32 + lane;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int dk = args.key_dim, dv = args.value_dim, hv = args.value_heads, hk = args.key_heads;
    const int seq_len = args.seq_len;
    const int key_head = h / (hv / hk);
    const bool column = e < dv;
    const int row0 = warp * R;

    const T* q = static_cast<const T*>(args.q);
    const T* k = static_cast<const T*>(args.k);
    const T* v = static_cast<const T*>(args.v);

    const long long row = state_row(args, b);
    const bool pooled = row >= 0;  // else a pad row: a zero state, none written
    const long long state_base = pooled ? (row * hv + h) * dk * dv : 0;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int c = row0 + r;
        s[r] = (pooled && column && c < dk)
                   ? __ldcs(args.state_in + state_base + static_cast<long long>(c) * dv + e)
                   : 0.0f;
    }

    // Registers holding the next chunk's raw inputs.
    float pq[kPerThread], pk[kPerThread], pg[kPerThread], pv[kVPerThread], pbeta = 0.0f;
    auto prefetch = [&](int t0) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
            const int i = tid + j * kThreads;
            const int tok = i / kMaxDk, c = i % kMaxDk;
            const int t = t0 + tok;
            pq[j] = pk[j] = pg[j] = 0.0f;
            if (t < seq_len && c < dk) {
                const long long row = static_cast<long long>(b) * seq_len + t;
                const long long qk = (row * hk + key_head) * dk + c;
                pq[j] = berrylm::to_f32(q[qk]);
                pk[j] = berrylm::to_f32(k[qk]);
                pg[j] = args.g[(row * hv + h) * dk + c];
            }
        }
#pragma unroll
        for (int j = 0; j < kVPerThread; ++j) {
            const int i = tid + j * kThreads;
            const int tok = i / 32, col = tile * 32 + (i % 32);
            const int t = t0 + tok;
            pv[j] = 0.0f;
            if (tok < CH && t < seq_len && col < dv) {
                const long long row = static_cast<long long>(b) * seq_len + t;
                pv[j] = berrylm::to_f32(v[(row * hv + h) * dv + col]);
            }
        }
        if (tid < CH && t0 + tid < seq_len) {
            pbeta = args.beta[(static_cast<long long>(b) * seq_len + t0 + tid) * hv + h];
        }
    };

    if (seq_len > 0) prefetch(0);
    for (int t0 = 0; t0 < seq_len; t0 += CH) {
        const int count = min(CH, seq_len - t0);
        // Stage the prefetched chunk.
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
            const int i = tid + j * kThreads;
            const int tok = i / kMaxDk, c = i % kMaxDk;
            sh_q[tok][c] = pq[j];
            sh_k[tok][c] = pk[j];
            sh_decay[tok][c] = expf(pg[j]);
        }
#pragma unroll
        for (int j = 0; j < kVPerThread; ++j) {
            const int i = tid + j * kThreads;
            if (i < CH * 32) sh_v[i / 32][i % 32] = pv[j];
        }
        if (tid < CH) sh_beta[tid] = pbeta;
        __syncthreads();
        if (t0 + CH < seq_len) prefetch(t0 + CH);

        // Normalise q and k of each token in place (one warp per token).
        for (int tok = warp; tok < count; tok += NW) {
            l2_normalize_qk(sh_q[tok], sh_k[tok], dk, lane, args.query_scale);
        }
        __syncthreads();

        for (int tok = 0; tok < count; ++tok) {
            float u = 0.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int c = row0 + r;
                if (c < dk) {
                    s[r] *= sh_decay[tok][c];
                    u += s[r] * sh_k[tok][c];
                }
            }
            red_u[tok & 1][warp][lane] = u;
            __syncthreads();
            u = 0.0f;
#pragma unroll
            for (int w = 0; w < NW; ++w) u += red_u[tok & 1][w][lane];
            const float delta = sh_beta[tok] * (sh_v[tok][lane] - u);
            float o = 0.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int c = row0 + r;
                if (c < dk) {
                    s[r] += sh_k[tok][c] * delta;
                    o += s[r] * sh_q[tok][c];
                }
            }
            o_part[tok][warp][lane] = o;
        }
        __syncthreads();
        for (int i = tid; i < count * 32; i += kThreads) {
            const int tok = i / 32, l = i % 32, col = tile * 32 + l;
            if (col < dv) {
                float o = 0.0f;
#pragma unroll
                for (int w = 0; w < NW; ++w) o += o_part[tok][w][l];
                const long long row = static_cast<long long>(b) * seq_len + t0 + tok;
                args.out[(row * hv + h) * dv + col] = o;
            }
        }
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int c = row0 + r;
        if (pooled && column && c < dk) {
            __stcs(args.state_out + state_base + static_cast<long long>(c) * dv + e, s[r]);
        }
    }
}

// ----------------------------------------------------------------- rows

constexpr int kRowsWarps = 8;
constexpr int kRowsPerWarp = 16;  // 8 warps x 16 rows: dk <= 128
constexpr int kRowsDv = 128;      // 32 lanes x float4

// The fused decode step's inputs besides RecurrenceArgs' q, k, v, states and
// slots (its g, beta and out unused), sequence b's in row b of each, in the
// dtype T of q, k and v.
template <typename T>
struct GatedStep {
    const T* raw_gate;  // [B, Hv * dk] rows raw_gate_stride apart: f_up's output
    long long raw_gate_stride;
    const T* b;  // [B, Hv] rows b_stride apart: the write strength's logits
    long long b_stride;
    const float* a_log;    // [Hv]
    const float* dt_bias;  // [Hv * dk]
    int has_lower_bound;
    float lower_bound;
    const T* z;  // [B, Hv * dv] rows z_stride apart: the output gate
    long long z_stride;
    const float* norm_weight;  // [dv]
    float norm_eps;
    T* out;  // [B, Hv * dv]: the normed, gated output
};

// kGated: the fused decode step (`gated`), else the recurrence alone
// (`gated` unused).
template <typename T, bool kGated>
__global__ void __launch_bounds__(kRowsWarps * 32, 2)
    kda_decode_rows(const RecurrenceArgs args, const GatedStep<T> gated) {
    __shared__ float sh_q[kRowsWarps * kRowsPerWarp];
    __shared__ float sh_k[kRowsWarps * kRowsPerWarp];
    __shared__ float sh_decay[kRowsWarps * kRowsPerWarp];
    __shared__ float4 red[kRowsWarps][32];
    __shared__ float sh_beta;
    __shared__ float sh_out[kRowsDv];  // kGated: the head's output row, rounded

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int dk = args.key_dim, hv = args.value_heads, hk = args.key_heads;
    const int key_head = h / (hv / hk);
    const int row0 = warp * kRowsPerWarp;

    const long long head = static_cast<long long>(b) * hv + h;  // seq_len == 1
    const long long row = state_row(args, b);
    const bool pooled = row >= 0;  // else a pad row: a zero state, none written
    const long long state_head = pooled ? row * hv + h : 0;
    const float4* state_in =
        reinterpret_cast<const float4*>(args.state_in + state_head * dk * kRowsDv) + lane;
    float4* state_out =
        reinterpret_cast<float4*>(args.state_out + state_head * dk * kRowsDv) + lane;

    float4 s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
        const int c = row0 + r;
        s[r] = pooled && c < dk ? __ldcs(state_in + c * (kRowsDv / 4))
                                : make_float4(0.f, 0.f, 0.f, 0.f);
    }

    const T* q = static_cast<const T*>(args.q);
    const T* k = static_cast<const T*>(args.k);
    const T* v = static_cast<const T*>(args.v);
    const long long qk_base = (static_cast<long long>(b) * hk + key_head) * dk;
    if (tid < dk) {
        sh_q[tid] = berrylm::to_f32(q[qk_base + tid]);
        sh_k[tid] = berrylm::to_f32(k[qk_base + tid]);
        float g;
        if constexpr (kGated) {
            const int channel = h * dk + tid;
            g = berrylm::gate::forget_gate(
                berrylm::to_f32(gated.raw_gate[b * gated.raw_gate_stride + channel]),
                gated.dt_bias[channel], gated.a_log[h], gated.has_lower_bound != 0,
                gated.lower_bound);
        } else {
            g = args.g[head * dk + tid];
        }
        sh_decay[tid] = expf(g);
    }
    if constexpr (kGated) {
        if (tid == 0) {
            sh_beta =
                berrylm::gate::write_strength(berrylm::to_f32(gated.b[b * gated.b_stride + h]));
        }
    }
    const T* v_head = v + head * kRowsDv + 4 * lane;
    const float4 v4 = make_float4(berrylm::to_f32(v_head[0]), berrylm::to_f32(v_head[1]),
                                  berrylm::to_f32(v_head[2]), berrylm::to_f32(v_head[3]));
    __syncthreads();
    const float beta = kGated ? sh_beta : args.beta[head];

    const float2 inv = inverse_l2_norms(sh_q, sh_k, dk, lane);
    const float q_inv = inv.x, k_inv = inv.y;

    float4 u = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
        const int c = row0 + r;
        if (c < dk) {
            const float decay = sh_decay[c];
            const float kc = sh_k[c] * k_inv;
            s[r].x *= decay;
            s[r].y *= decay;
            s[r].z *= decay;
            s[r].w *= decay;
            u.x += s[r].x * kc;
            u.y += s[r].y * kc;
            u.z += s[r].z * kc;
            u.w += s[r].w * kc;
        }
    }
    red[warp][lane] = u;
    __syncthreads();
    u = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kRowsWarps; ++w) {
        const float4 p = red[w][lane];
        u.x += p.x;
        u.y += p.y;
        u.z += p.z;
        u.w += p.w;
    }
    const float4 delta = make_float4(beta * (v4.x - u.x), beta * (v4.y - u.y),
                                     beta * (v4.z - u.z), beta * (v4.w - u.w));
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
        const int c = row0 + r;
        if (c < dk) {
            const float kc = sh_k[c] * k_inv;
            const float qc = (sh_q[c] * q_inv) * args.query_scale;
            s[r].x += kc * delta.x;
            s[r].y += kc * delta.y;
            s[r].z += kc * delta.z;
            s[r].w += kc * delta.w;
            o.x += s[r].x * qc;
            o.y += s[r].y * qc;
            o.z += s[r].z * qc;
            o.w += s[r].w * qc;
            if (pooled) __stcs(state_out + c * (kRowsDv / 4), s[r]);
        }
    }
    __syncthreads();  // everyone has read red (u) before it is reused for o
    red[warp][lane] = o;
    __syncthreads();
    if (tid < kRowsDv) {
        const float* red_f = reinterpret_cast<const float*>(&red[0][0]);
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < kRowsWarps; ++w) total += red_f[w * kRowsDv + tid];
        if constexpr (kGated) {
            sh_out[tid] = berrylm::round_to<T>(total);
        } else {
            args.out[head * kRowsDv + tid] = total;
        }
    }
    if constexpr (kGated) {
        // The head's output row normed and gated: each of the first
        // kRowsDv / 32 warps sums the whole row's squares and writes 32
        // columns.
        __syncthreads();
        if (warp < kRowsDv / 32) {
            const float inv_rms = berrylm::gated_norm::inverse_rms(
                [&](int i) { return sh_out[i]; }, kRowsDv, gated.norm_eps, lane);
            const int column = warp * 32 + lane;
            gated.out[head * kRowsDv + column] = berrylm::gated_norm::gated_output<T>(
                sh_out[column], inv_rms, gated.norm_weight[column],
                berrylm::to_f32(gated.z[b * gated.z_stride + h * kRowsDv + column]));
        }
    }
}

// ------------------------------------------------------------- dispatch

// Values of berrylm_kda_recurrence's `prefill_algorithm` argument. Must match
// `PREFILL_*` in src/cuda/recurrence.rs.
enum PrefillAlgorithm : int { kPrefillSequential = 0, kPrefillChunked = 1 };

template <typename T, int NW, int R, int CH>
int launch_tiles(const RecurrenceArgs& args, int batch, cudaStream_t stream) {
    const dim3 grid((args.value_dim + 31) / 32, args.value_heads, batch);
    kda_recurrence_tiles<T, NW, R, CH><<<grid, NW * 32, 0, stream>>>(args);
    return berrylm::launch_status();
}

template <typename T>
int launch(const RecurrenceArgs& args, int batch, PrefillAlgorithm prefill, cudaStream_t stream) {
    // Decode: `rows` when its shape and alignment constraints hold and the
    // grid has about one block per SM or more, else `tiles`. (State rows of
    // a pool are dk * 512 bytes apart, so the base pointers' alignment is
    // every row's.)
    const bool aligned = (reinterpret_cast<uintptr_t>(args.state_in) % 16 == 0) &&
                         (reinterpret_cast<uintptr_t>(args.state_out) % 16 == 0);
    const bool rows_ok = args.seq_len == 1 && args.value_dim == kRowsDv &&
                         args.key_dim <= kRowsWarps * kRowsPerWarp && aligned;
    if (rows_ok && static_cast<long long>(batch) * args.value_heads >= 128) {
        const dim3 grid(args.value_heads, batch);
        kda_decode_rows<T, false><<<grid, kRowsWarps * 32, 0, stream>>>(args, GatedStep<T>{});
        return berrylm::launch_status();
    }
    // Prefill: the chunked kernels when asked for and the shape fits (the
    // Rust API asks for them from T = 64 on, where they measured faster on
    // the H200; CUDA.md), else the sequential `tiles` kernel.
    const bool chunked_ok = args.seq_len > 1 && args.key_dim <= kChunkMaxDk &&
                            args.value_dim <= kChunkMaxDv;
    if (prefill == kPrefillChunked && chunked_ok) {
        return launch_chunked<T>(args, batch, stream);
    }
    const int dk = args.key_dim;
    if (dk <= 32) return launch_tiles<T, 4, 8, 16>(args, batch, stream);
    if (dk <= 64) return launch_tiles<T, 4, 16, 16>(args, batch, stream);
    if (dk <= 128) return launch_tiles<T, 8, 16, 16>(args, batch, stream);
    if (dk <= 256) return launch_tiles<T, 8, 32, 8>(args, batch, stream);
    return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace berrylm::recurrence

using namespace berrylm::recurrence;

// Largest key dim the kernels support (checked by src/cuda/recurrence.rs).
extern "C" int berrylm_kda_recurrence_max_key_dim() { return 256; }

// The recurrence of `batch` sequences. q, k, v share `qkv_dtype`; g, beta
// and the states are f32.
//
// Sequence b starts from row slots[b] of `state_in` ([state_rows, Hv, dk, dv])
// and writes its final state to that row of `state_out`; with `slots` null,
// from row b (state_rows = batch). `state_out` may equal `state_in`: a pool
// read and updated in place, whose slots must be distinct. A slot >=
// state_rows makes its sequence a pad row: it starts from a zero state and
// writes none.
//
// `prefill_algorithm` selects how calls with T > 1 are computed:
//   0 (kPrefillSequential): the token-by-token `tiles` kernel (f32);
//   1 (kPrefillChunked): the chunked WY kernels of chunked.cu (TF32 tensor
//     cores) when dk <= 128 and dv <= 128; larger heads use the sequential
//     kernel.
// Calls with T <= 1 (decode, empty) ignore it. Any other value is rejected
// with cudaErrorInvalidValue.
extern "C" int berrylm_kda_recurrence(int qkv_dtype, const void* q, const void* k, const void* v,
                                      const float* g, const float* beta, const float* state_in,
                                      float* state_out, const uint32_t* slots, int state_rows,
                                      float* out, int batch, int seq_len, int key_heads,
                                      int value_heads, int key_dim, int value_dim,
                                      int prefill_algorithm, void* stream) {
    if (prefill_algorithm != kPrefillSequential && prefill_algorithm != kPrefillChunked) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    if (batch == 0 || value_heads == 0 || key_dim == 0 || value_dim == 0) return 0;
    if (batch > 65535 || value_heads > 65535 || key_heads <= 0 || value_heads % key_heads != 0 ||
        key_dim > 256 || state_rows < 0) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    const float query_scale = static_cast<float>(1.0 / sqrt(static_cast<double>(key_dim)));
    const RecurrenceArgs args{q,         k,          v,     g,          beta,    state_in,
                              out,       state_out,  slots, state_rows, seq_len, key_heads,
                              value_heads, key_dim,  value_dim, query_scale};
    const PrefillAlgorithm prefill = static_cast<PrefillAlgorithm>(prefill_algorithm);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(qkv_dtype, T, { return launch<T>(args, batch, prefill, s); });
    return 0;
}

// The fused KDA decode step (one token per sequence, dv = 128, dk <= 128):
// from the layer's projections and the conv's q, k, v (dtype `dtype`, all
// alike) to the normed, gated output `out` ([batch, Hv * dv], `dtype`), the
// recurrent states updated in place in rows slots[b] of `states` ([rows, Hv,
// dk, dv], f32, 16-byte aligned) as berrylm_kda_recurrence does. Equals
// berrylm_kda_gate, berrylm_kda_beta, berrylm_kda_recurrence and
// berrylm_gated_rms_norm (x f32, out_dtype = dtype) in turn, bit for bit
// where berrylm_kda_recurrence runs its `rows` kernel (batch * Hv >= 128).
// Other shapes and a misaligned pool are rejected with cudaErrorInvalidValue.
extern "C" int berrylm_kda_decode_gated(
    int dtype, const void* q, const void* k, const void* v, const void* raw_gate,
    long long raw_gate_stride, const void* b, long long b_stride, const float* a_log,
    const float* dt_bias, int has_lower_bound, float lower_bound, const void* z,
    long long z_stride, const float* norm_weight, float norm_eps, float* states,
    const uint32_t* slots, int state_rows, void* out, int batch, int key_heads, int value_heads,
    int key_dim, int value_dim, void* stream) {
    if (batch == 0 || value_heads == 0) return 0;
    const bool aligned = reinterpret_cast<uintptr_t>(states) % 16 == 0;
    if (batch > 65535 || value_heads > 65535 || key_heads <= 0 ||
        value_heads % key_heads != 0 || key_dim <= 0 || key_dim > kRowsWarps * kRowsPerWarp ||
        value_dim != kRowsDv || state_rows < 0 || !aligned) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    const float query_scale = static_cast<float>(1.0 / sqrt(static_cast<double>(key_dim)));
    const RecurrenceArgs args{q,      k,        v,          nullptr,     nullptr, states,
                              nullptr, states,  slots,      state_rows,  1,       key_heads,
                              value_heads, key_dim, value_dim, query_scale};
    const dim3 grid(value_heads, batch);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        const GatedStep<T> gated{static_cast<const T*>(raw_gate),
                                 raw_gate_stride,
                                 static_cast<const T*>(b),
                                 b_stride,
                                 a_log,
                                 dt_bias,
                                 has_lower_bound,
                                 lower_bound,
                                 static_cast<const T*>(z),
                                 z_stride,
                                 norm_weight,
                                 norm_eps,
                                 static_cast<T*>(out)};
        kda_decode_rows<T, true><<<grid, kRowsWarps * 32, 0, s>>>(args, gated);
    });
    return berrylm::launch_status();
}
