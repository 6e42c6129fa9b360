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
// * `chunked` (prefill, T > 1, dk <= 128, dv <= 128; only when the caller
//   passes prefill_algorithm = kPrefillChunked): see the section below.
//   Correct (the CUDA tests run every recurrence case with it) but, as
//   written, slower than `tiles` on the H200, so not the default.
// * `tiles` (any T, any dk <= 256, any dv; the default for T > 1): one block
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
// The decode kernel (rows or tiles) is chosen only by that size and
// alignment rule; the prefill algorithm is the caller's explicit choice
// (`prefill_algorithm` of berrylm_kda_recurrence). Nothing here reads the
// environment.
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

    const long long state_base = (static_cast<long long>(b) * hv + h) * dk * dv;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int c = row0 + r;
        s[r] = (column && c < dk)
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
            float q_sq = 0.0f, k_sq = 0.0f;
            for (int c = lane; c < dk; c += 32) {
                const float qc = sh_q[tok][c], kc = sh_k[tok][c];
                q_sq += qc * qc;
                k_sq += kc * kc;
            }
            q_sq = berrylm::warp_sum(q_sq);
            k_sq = berrylm::warp_sum(k_sq);
            const float q_inv = 1.0f / sqrtf(q_sq + kL2NormEps);
            const float k_inv = 1.0f / sqrtf(k_sq + kL2NormEps);
            for (int c = lane; c < dk; c += 32) {
                sh_q[tok][c] = (sh_q[tok][c] * q_inv) * args.query_scale;
                sh_k[tok][c] = sh_k[tok][c] * k_inv;
            }
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
        if (column && c < dk) {
            __stcs(args.state_out + state_base + static_cast<long long>(c) * dv + e, s[r]);
        }
    }
}

// ----------------------------------------------------------------- rows

constexpr int kRowsWarps = 8;
constexpr int kRowsPerWarp = 16;  // 8 warps x 16 rows: dk <= 128
constexpr int kRowsDv = 128;      // 32 lanes x float4

template <typename T>
__global__ void __launch_bounds__(kRowsWarps * 32, 2)
    kda_decode_rows(const RecurrenceArgs args) {
    __shared__ float sh_q[kRowsWarps * kRowsPerWarp];
    __shared__ float sh_k[kRowsWarps * kRowsPerWarp];
    __shared__ float sh_decay[kRowsWarps * kRowsPerWarp];
    __shared__ float4 red[kRowsWarps][32];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int dk = args.key_dim, hv = args.value_heads, hk = args.key_heads;
    const int key_head = h / (hv / hk);
    const int row0 = warp * kRowsPerWarp;

    const long long head = static_cast<long long>(b) * hv + h;  // seq_len == 1
    const float4* state_in =
        reinterpret_cast<const float4*>(args.state_in + head * dk * kRowsDv) + lane;
    float4* state_out = reinterpret_cast<float4*>(args.state_out + head * dk * kRowsDv) + lane;

    float4 s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
        const int c = row0 + r;
        s[r] = c < dk ? __ldcs(state_in + c * (kRowsDv / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }

    const T* q = static_cast<const T*>(args.q);
    const T* k = static_cast<const T*>(args.k);
    const T* v = static_cast<const T*>(args.v);
    const long long qk_base = (static_cast<long long>(b) * hk + key_head) * dk;
    if (tid < dk) {
        sh_q[tid] = berrylm::to_f32(q[qk_base + tid]);
        sh_k[tid] = berrylm::to_f32(k[qk_base + tid]);
        sh_decay[tid] = expf(args.g[head * dk + tid]);
    }
    const T* v_head = v + head * kRowsDv + 4 * lane;
    const float4 v4 = make_float4(berrylm::to_f32(v_head[0]), berrylm::to_f32(v_head[1]),
                                  berrylm::to_f32(v_head[2]), berrylm::to_f32(v_head[3]));
    const float beta = args.beta[head];
    __syncthreads();

    float q_sq = 0.0f, k_sq = 0.0f;
    for (int c = lane; c < dk; c += 32) {
        q_sq += sh_q[c] * sh_q[c];
        k_sq += sh_k[c] * sh_k[c];
    }
    q_sq = berrylm::warp_sum(q_sq);
    k_sq = berrylm::warp_sum(k_sq);
    const float q_inv = 1.0f / sqrtf(q_sq + kL2NormEps);
    const float k_inv = 1.0f / sqrtf(k_sq + kL2NormEps);

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
            __stcs(state_out + c * (kRowsDv / 4), s[r]);
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
        args.out[head * kRowsDv + tid] = total;
    }
}

// -------------------------------------------------------------- chunked
//
// Prefill in chunks of L = 64 tokens (dk <= 128, dv <= 128), opt-in through
// prefill_algorithm = kPrefillChunked. With G_i = cumsum of g inside the
// chunk (per key channel) and the chunk's initial state S0, the recurrence
// unrolls to
//   S_i = diag(exp(G_i)) S0 + sum_{j<=i} diag(exp(G_i - G_j)) k^_j d_j^T
//   d   = X_v - X_k S0,   X = [X_k | X_v] solving (I + diag(beta) A) X = diag(beta) [K~ | V]
//   A_ij = sum_c k^_i[c] k^_j[c] exp(G_i[c] - G_j[c])   (j < i)
//   K~_i = exp(G_i) * k^_i
//   O    = Q~ S0 + Bm d,  Q~_i = exp(G_i) * q^_i,
//   Bm_ij = sum_c q^_i[c] k^_j[c] exp(G_i[c] - G_j[c])  (j <= i)
//   S_L  = diag(exp(G_last)) S0 + Ke^T d,  Ke_j = exp(G_last - G_j) * k^_j.
// Every exponent is a difference G_i - G_j with j <= i, which is <= 0, so
// nothing overflows however negative g gets (no factorisation into
// exp(G_i) * exp(-G_j)); underflow only drops terms below f32's range. G is
// accumulated and kept in f64, so that a difference G_i - G_j is exact to f32
// precision even when |G| is large (an f32 cumsum would carry an absolute
// error of ulp(|G|), a relative error of the decays they feed). All other
// arithmetic is f32 on CUDA cores (no TF32), to stay within 1e-4 of the
// sequential reference.
//
// Kernel 1 (`chunk_prepare`, one block per (chunk, h, b), all chunks in
// parallel) writes X_k, X_v, Q~, Ke, Bm and exp(G_last) to a scratch buffer.
// Kernel 2 (`chunk_state`, one block per (b, h, tile of 32 value columns))
// walks the chunks in order with its state tile in shared memory:
// d = X_v - X_k S, O = Q~ S + Bm d, S = exp(G_last) * S + Ke^T d.

constexpr int kChunk = 64;
constexpr int kChunkMaxDk = 128;
constexpr int kChunkMaxDv = 128;
constexpr int kChunkThreads = 256;
constexpr int kChunkStride = kChunk + 4;  // padded row (c-major arrays), float4-aligned

// Offsets (in floats) of one (b, h, chunk)'s pieces in the scratch buffer.
struct ChunkLayout {
    int dk, dv;
    __host__ __device__ long long xk() const { return 0; }
    __host__ __device__ long long xv() const { return xk() + static_cast<long long>(kChunk) * dk; }
    __host__ __device__ long long qt() const { return xv() + static_cast<long long>(kChunk) * dv; }
    __host__ __device__ long long ke() const { return qt() + static_cast<long long>(kChunk) * dk; }
    __host__ __device__ long long bm() const { return ke() + static_cast<long long>(kChunk) * dk; }
    __host__ __device__ long long gl() const { return bm() + static_cast<long long>(kChunk) * kChunk; }
    __host__ __device__ long long size() const { return gl() + dk; }
};

constexpr size_t kPrepareSmem =
    sizeof(double) * kChunkMaxDk * kChunkStride +
    sizeof(float) * (2 * kChunkMaxDk * kChunkStride + kChunk * (kChunk + 1) + kChunk);

template <typename T>
__global__ void __launch_bounds__(kChunkThreads)
    kda_chunk_prepare(const RecurrenceArgs args, float* __restrict__ scratch, int num_chunks) {
    extern __shared__ __align__(16) float smem[];
    double (*sG)[kChunkStride] = reinterpret_cast<double (*)[kChunkStride]>(smem);  // [c][i]
    float (*sQ)[kChunkStride] = reinterpret_cast<float (*)[kChunkStride]>(sG + kChunkMaxDk);
    float (*sK)[kChunkStride] = sQ + kChunkMaxDk;
    float (*sA)[kChunk + 1] = reinterpret_cast<float (*)[kChunk + 1]>(sK + kChunkMaxDk);
    float* sBeta = &sA[kChunk][0];

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int dk = args.key_dim, dv = args.value_dim, hv = args.value_heads, hk = args.key_heads;
    const int seq_len = args.seq_len;
    const int key_head = h / (hv / hk);
    const int t0 = chunk * kChunk;
    const ChunkLayout layout{dk, dv};
    float* out = scratch + ((static_cast<long long>(b) * hv + h) * num_chunks + chunk) * layout.size();

    const T* q = static_cast<const T*>(args.q);
    const T* k = static_cast<const T*>(args.k);
    const T* v = static_cast<const T*>(args.v);

    // (a) Load q, k, g (c-major), beta; zeros past the end of the sequence.
    for (int idx = tid; idx < kChunk * dk; idx += kChunkThreads) {
        const int i = idx / dk, c = idx % dk;
        const int t = t0 + i;
        float qv = 0.0f, kv = 0.0f, gv = 0.0f;
        if (t < seq_len) {
            const long long row = static_cast<long long>(b) * seq_len + t;
            const long long qk = (row * hk + key_head) * dk + c;
            qv = berrylm::to_f32(q[qk]);
            kv = berrylm::to_f32(k[qk]);
            gv = args.g[(row * hv + h) * dk + c];
        }
        sQ[c][i] = qv;
        sK[c][i] = kv;
        sG[c][i] = gv;
    }
    if (tid < kChunk) {
        const int t = t0 + tid;
        sBeta[tid] =
            t < seq_len ? args.beta[(static_cast<long long>(b) * seq_len + t) * hv + h] : 0.0f;
    }
    __syncthreads();

    // (b) L2-normalise q (with the dk^-0.5 scale) and k, one warp per token.
    for (int i = warp; i < kChunk; i += kChunkThreads / 32) {
        float q_sq = 0.0f, k_sq = 0.0f;
        for (int c = lane; c < dk; c += 32) {
            q_sq += sQ[c][i] * sQ[c][i];
            k_sq += sK[c][i] * sK[c][i];
        }
        q_sq = berrylm::warp_sum(q_sq);
        k_sq = berrylm::warp_sum(k_sq);
        const float q_inv = 1.0f / sqrtf(q_sq + kL2NormEps);
        const float k_inv = 1.0f / sqrtf(k_sq + kL2NormEps);
        for (int c = lane; c < dk; c += 32) {
            sQ[c][i] = (sQ[c][i] * q_inv) * args.query_scale;
            sK[c][i] = sK[c][i] * k_inv;
        }
    }
    // (c) G = cumsum(g) over the chunk in f64, one thread per channel (adding
    // g <= 0 never increases it, so G_i - G_j <= 0 for j <= i).
    if (tid < dk) {
        double running = 0.0;
        for (int i = 0; i < kChunk; ++i) {
            running += sG[tid][i];
            sG[tid][i] = running;
        }
    }
    __syncthreads();

    // (f) Q~, Ke and exp(G_last).
    for (int idx = tid; idx < kChunk * dk; idx += kChunkThreads) {
        const int i = idx / dk, c = idx % dk;
        const double gi = sG[c][i];
        out[layout.qt() + idx] = expf(static_cast<float>(gi)) * sQ[c][i];
        out[layout.ke() + idx] = expf(static_cast<float>(sG[c][kChunk - 1] - gi)) * sK[c][i];
    }
    if (tid < dk) out[layout.gl() + tid] = expf(static_cast<float>(sG[tid][kChunk - 1]));

    // (d) A (strict lower, to shared memory) and Bm (lower with diagonal, to
    // global), a 4 x 4 tile of (i, j) per thread.
    {
        const int ti = tid / 16, tj = tid % 16;
        float acc_a[4][4], acc_b[4][4];
#pragma unroll
        for (int ii = 0; ii < 4; ++ii)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) acc_a[ii][jj] = acc_b[ii][jj] = 0.0f;
        if (tj <= ti) {
            for (int c = 0; c < dk; ++c) {
                const double2 gi01 = *reinterpret_cast<const double2*>(&sG[c][4 * ti]);
                const double2 gi23 = *reinterpret_cast<const double2*>(&sG[c][4 * ti + 2]);
                const double2 gj01 = *reinterpret_cast<const double2*>(&sG[c][4 * tj]);
                const double2 gj23 = *reinterpret_cast<const double2*>(&sG[c][4 * tj + 2]);
                const float4 ki4 = *reinterpret_cast<const float4*>(&sK[c][4 * ti]);
                const float4 qi4 = *reinterpret_cast<const float4*>(&sQ[c][4 * ti]);
                const float4 kj4 = *reinterpret_cast<const float4*>(&sK[c][4 * tj]);
                const double gi[4] = {gi01.x, gi01.y, gi23.x, gi23.y};
                const double gj[4] = {gj01.x, gj01.y, gj23.x, gj23.y};
                const float ki[4] = {ki4.x, ki4.y, ki4.z, ki4.w};
                const float qi[4] = {qi4.x, qi4.y, qi4.z, qi4.w};
                const float kj[4] = {kj4.x, kj4.y, kj4.z, kj4.w};
#pragma unroll
                for (int ii = 0; ii < 4; ++ii) {
#pragma unroll
                    for (int jj = 0; jj < 4; ++jj) {
                        // Pairs with j > i (diagonal tiles only) are discarded
                        // below; the clamp keeps their exponent finite.
                        const float decay = expf(static_cast<float>(fmin(gi[ii] - gj[jj], 0.0)));
                        const float kd = kj[jj] * decay;
                        acc_a[ii][jj] += ki[ii] * kd;
                        acc_b[ii][jj] += qi[ii] * kd;
                    }
                }
            }
        }
        float* bm = out + layout.bm();
#pragma unroll
        for (int ii = 0; ii < 4; ++ii) {
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const int i = 4 * ti + ii, j = 4 * tj + jj;
                sA[i][j] = j < i ? acc_a[ii][jj] : 0.0f;
                bm[i * kChunk + j] = j <= i ? acc_b[ii][jj] : 0.0f;
            }
        }
    }
    __syncthreads();

    // (e) Forward substitution, one thread per column of [K~ | V]:
    // X_i = beta_i * (R_i - sum_{j<i} A_ij X_j). Columns are independent.
    const int col = tid;
    if (col < dk + dv) {
        const bool key_col = col < dk;
        float* dst = key_col ? out + layout.xk() + col : out + layout.xv() + (col - dk);
        const int width = key_col ? dk : dv;
        const T* v_col = v + (static_cast<long long>(b) * seq_len * hv + h) * dv + (col - dk);
        float x[kChunk];
#pragma unroll
        for (int i = 0; i < kChunk; ++i) {
            float r;
            if (key_col) {
                r = expf(static_cast<float>(sG[col][i])) * sK[col][i];
            } else {
                r = t0 + i < seq_len
                        ? berrylm::to_f32(v_col[static_cast<long long>(t0 + i) * hv * dv])
                        : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < i; ++j) r -= sA[i][j] * x[j];
            x[i] = sBeta[i] * r;
            dst[static_cast<long long>(i) * width] = x[i];
        }
    }
}

constexpr size_t kStateSmem =
    sizeof(float) * (kChunkMaxDk * 32 + 3 * kChunk * kChunkMaxDk + kChunk * kChunk +
                     kChunk * 32 + kChunk * 32 + kChunkMaxDk);

__global__ void __launch_bounds__(kChunkThreads)
    kda_chunk_state(const RecurrenceArgs args, const float* __restrict__ scratch, int num_chunks) {
    extern __shared__ __align__(16) float smem[];
    float (*sS)[32] = reinterpret_cast<float (*)[32]>(smem);                    // [c][e]
    float (*sXk)[kChunkMaxDk] = reinterpret_cast<float (*)[kChunkMaxDk]>(sS + kChunkMaxDk);
    float (*sQt)[kChunkMaxDk] = sXk + kChunk;
    float (*sKe)[kChunkMaxDk] = sQt + kChunk;
    float (*sBm)[kChunk] = reinterpret_cast<float (*)[kChunk]>(sKe + kChunk);
    float (*sXv)[32] = reinterpret_cast<float (*)[32]>(sBm + kChunk);
    float (*sD)[32] = sXv + kChunk;
    float* sGl = &sD[kChunk][0];

    const int tid = threadIdx.x;
    const int e = tid & 31, r8 = tid >> 5;
    const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int dk = args.key_dim, dv = args.value_dim, hv = args.value_heads;
    const int dk4 = (dk + 3) & ~3;
    const int seq_len = args.seq_len;
    const int col = tile * 32 + e;
    const bool column = col < dv;
    const ChunkLayout layout{dk, dv};

    // State tile (rows past dk stay zero), and zeros in the columns
    // [dk, dk4) of X_k and Q~, which the float4 loops below read.
    const long long state_base = (static_cast<long long>(b) * hv + h) * dk * dv;
    for (int c = r8; c < kChunkMaxDk; c += 8) {
        sS[c][e] = (c < dk && column)
                       ? args.state_in[state_base + static_cast<long long>(c) * dv + col]
                       : 0.0f;
    }
    for (int i = tid; i < kChunk; i += kChunkThreads) {
        for (int c = dk; c < dk4; ++c) sXk[i][c] = sQt[i][c] = 0.0f;
    }

    for (int chunk = 0; chunk < num_chunks; ++chunk) {
        const float* in =
            scratch + ((static_cast<long long>(b) * hv + h) * num_chunks + chunk) * layout.size();
        for (int i = r8; i < kChunk; i += 8) {
            const long long row = static_cast<long long>(i) * dk;
            for (int c = e; c < dk; c += 32) {
                sXk[i][c] = in[layout.xk() + row + c];
                sQt[i][c] = in[layout.qt() + row + c];
                sKe[i][c] = in[layout.ke() + row + c];
            }
            for (int j = e; j < kChunk; j += 32) sBm[i][j] = in[layout.bm() + i * kChunk + j];
            sXv[i][e] = column ? in[layout.xv() + static_cast<long long>(i) * dv + col] : 0.0f;
        }
        if (tid < dk) sGl[tid] = in[layout.gl() + tid];
        __syncthreads();

        // d = X_v - X_k S and Z = Q~ S for rows i = r8 + 8m.
        float p[kChunk / 8], z[kChunk / 8];
#pragma unroll
        for (int m = 0; m < kChunk / 8; ++m) p[m] = z[m] = 0.0f;
        for (int c = 0; c < dk4; c += 4) {
            const float s0 = sS[c][e], s1 = sS[c + 1][e], s2 = sS[c + 2][e], s3 = sS[c + 3][e];
#pragma unroll
            for (int m = 0; m < kChunk / 8; ++m) {
                const float4 w = *reinterpret_cast<const float4*>(&sXk[r8 + 8 * m][c]);
                const float4 qt = *reinterpret_cast<const float4*>(&sQt[r8 + 8 * m][c]);
                p[m] += w.x * s0 + w.y * s1 + w.z * s2 + w.w * s3;
                z[m] += qt.x * s0 + qt.y * s1 + qt.z * s2 + qt.w * s3;
            }
        }
#pragma unroll
        for (int m = 0; m < kChunk / 8; ++m) {
            const int i = r8 + 8 * m;
            sD[i][e] = sXv[i][e] - p[m];
        }
        __syncthreads();

        // O = Z + Bm d (rows past the end of the sequence are not written).
        const int t0 = chunk * kChunk;
#pragma unroll
        for (int m = 0; m < kChunk / 8; ++m) {
            const int i = r8 + 8 * m;
            float o = z[m];
            for (int j = 0; j <= i; ++j) o += sBm[i][j] * sD[j][e];
            if (column && t0 + i < seq_len) {
                const long long row = static_cast<long long>(b) * seq_len + t0 + i;
                args.out[(row * hv + h) * dv + col] = o;
            }
        }

        // S = exp(G_last) * S + Ke^T d for rows c = 16 * r8 + mm (each (c, e)
        // owned by one thread; rows past dk are computed but never stored).
        {
            constexpr int kRows = kChunkMaxDk / 8;
            const int c0 = kRows * r8;
            float acc[kRows];
#pragma unroll
            for (int mm = 0; mm < kRows; ++mm) {
                acc[mm] = c0 + mm < dk ? sGl[c0 + mm] * sS[c0 + mm][e] : 0.0f;
            }
            for (int j = 0; j < kChunk; ++j) {
                const float d = sD[j][e];
#pragma unroll
                for (int q4 = 0; q4 < kRows / 4; ++q4) {
                    const float4 ke = *reinterpret_cast<const float4*>(&sKe[j][c0 + 4 * q4]);
                    acc[4 * q4 + 0] += ke.x * d;
                    acc[4 * q4 + 1] += ke.y * d;
                    acc[4 * q4 + 2] += ke.z * d;
                    acc[4 * q4 + 3] += ke.w * d;
                }
            }
#pragma unroll
            for (int mm = 0; mm < kRows; ++mm) {
                if (c0 + mm < dk) sS[c0 + mm][e] = acc[mm];
            }
        }
        __syncthreads();
    }

    for (int c = r8; c < dk; c += 8) {
        if (column) args.state_out[state_base + static_cast<long long>(c) * dv + col] = sS[c][e];
    }
}

template <typename T>
int launch_chunked(const RecurrenceArgs& args, int batch, cudaStream_t stream) {
    // Per call (cheap), so that every device the kernels run on is configured.
    cudaError_t err = cudaFuncSetAttribute(kda_chunk_prepare<T>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kPrepareSmem));
    if (err != cudaSuccess) return static_cast<int>(err);
    err = cudaFuncSetAttribute(kda_chunk_state, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kStateSmem));
    if (err != cudaSuccess) return static_cast<int>(err);
    const int num_chunks = (args.seq_len + kChunk - 1) / kChunk;
    const ChunkLayout layout{args.key_dim, args.value_dim};
    const size_t bytes = sizeof(float) * static_cast<size_t>(batch) * args.value_heads *
                         num_chunks * static_cast<size_t>(layout.size());
    void* scratch = nullptr;
    err = cudaMallocAsync(&scratch, bytes, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    kda_chunk_prepare<T><<<dim3(num_chunks, args.value_heads, batch), kChunkThreads, kPrepareSmem,
                           stream>>>(args, static_cast<float*>(scratch), num_chunks);
    kda_chunk_state<<<dim3((args.value_dim + 31) / 32, args.value_heads, batch), kChunkThreads,
                      kStateSmem, stream>>>(args, static_cast<const float*>(scratch), num_chunks);
    const int status = berrylm::launch_status();
    err = cudaFreeAsync(scratch, stream);
    if (status != 0) return status;
    return static_cast<int>(err);
}

// ------------------------------------------------------------- dispatch

// Values of berrylm_kda_recurrence's `prefill_algorithm` argument. Must match
// `PREFILL_*` in src/cuda/mod.rs.
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
    // grid has about one block per SM or more, else `tiles`.
    const bool aligned = (reinterpret_cast<uintptr_t>(args.state_in) % 16 == 0) &&
                         (reinterpret_cast<uintptr_t>(args.state_out) % 16 == 0);
    const bool rows_ok = args.seq_len == 1 && args.value_dim == kRowsDv &&
                         args.key_dim <= kRowsWarps * kRowsPerWarp && aligned;
    if (rows_ok && static_cast<long long>(batch) * args.value_heads >= 128) {
        const dim3 grid(args.value_heads, batch);
        kda_decode_rows<T><<<grid, kRowsWarps * 32, 0, stream>>>(args);
        return berrylm::launch_status();
    }
    // Prefill: the chunked kernels only when asked for and the shape fits;
    // on the H200 they measured slower than the sequential `tiles` kernel
    // (CUDA.md), which is why callers default to sequential.
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

// Largest key dim the kernels support (checked by src/cuda/mod.rs).
extern "C" int berrylm_kda_recurrence_max_key_dim() { return 256; }

// q, k, v share `qkv_dtype`; g, beta and the states are f32.
//
// `prefill_algorithm` selects how calls with T > 1 are computed:
//   0 (kPrefillSequential): the token-by-token `tiles` kernel (the default of
//     the Rust API, measured faster on the H200);
//   1 (kPrefillChunked): the chunked WY kernels when dk <= 128 and
//     dv <= 128; larger heads use the sequential kernel.
// Calls with T <= 1 (decode, empty) ignore it. Any other value is rejected
// with cudaErrorInvalidValue.
extern "C" int berrylm_kda_recurrence(int qkv_dtype, const void* q, const void* k, const void* v,
                                      const float* g, const float* beta, const float* state_in,
                                      float* out, float* state_out, int batch, int seq_len,
                                      int key_heads, int value_heads, int key_dim, int value_dim,
                                      int prefill_algorithm, void* stream) {
    if (prefill_algorithm != kPrefillSequential && prefill_algorithm != kPrefillChunked) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    if (batch == 0 || value_heads == 0 || key_dim == 0 || value_dim == 0) return 0;
    if (batch > 65535 || value_heads > 65535 || key_heads <= 0 ||
        value_heads % key_heads != 0 || key_dim > 256) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    const PrefillAlgorithm prefill = static_cast<PrefillAlgorithm>(prefill_algorithm);
    RecurrenceArgs args{q,       k,         v,       g,         beta,        state_in,
                        out,     state_out, seq_len, key_heads, value_heads, key_dim,
                        value_dim, static_cast<float>(1.0 / sqrt(static_cast<double>(key_dim)))};
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(qkv_dtype, T, { return launch<T>(args, batch, prefill, s); });
    return 0;
}
