// Chunked KDA prefill on tensor cores (TF32 inputs, FP32 accumulation).
//
// Chunks of L = 64 tokens, dk <= 128, dv <= 128 (padded with zeros to 128).
// With G_i the cumulative sum of g over the chunk up to token i (per key
// channel), S0 the state before the chunk, k^, q^ the L2-normalised key and
// (scaled) query, the token-by-token recurrence of recurrence.cu unrolls to
//   A_ij  = sum_c k^_i[c] k^_j[c] exp(G_i[c] - G_j[c])     (j < i)
//   Aqk_ij = sum_c q^_i[c] k^_j[c] exp(G_i[c] - G_j[c])    (j <= i)
//   X = [W | U] solves (I + diag(beta) A) X = diag(beta) [K~ | V],
//       K~_i = exp(G_i) k^_i
//   d   = U - W S0                     (the chunk's delta rule writes)
//   O   = Q~ S0 + Aqk d,               Q~_i = exp(G_i) q^_i
//   S_L = exp(G_L) S0 + Ke^T d,        Ke_j = exp(G_L - G_j) k^_j.
//
// Decays. g <= 0, so G is non-increasing along the chunk, and every
// exponential above is exp(x) with x <= 0: nothing overflows however
// negative g gets; terms below f32's range underflow to zero, as their true
// values are below it too. The matrices A and Aqk are built from 16-token
// sub-chunks: on the four diagonal 16 x 16 blocks elementwise with the exact
// exp(G_i - G_j); on the six blocks below them (i in sub-chunk I, j in an
// earlier one) as a matmul, splitting the decay at the first token r of I:
//   exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j),
// both factors <= 1 because j < r <= i. (A split at a point between i and j
// is not possible inside a diagonal block; fla's fused variant that does it
// clamps the exponents, which SGLang disables for BerryLM-like gates.) G is
// summed in f64 and stored rounded to f32 in base-2 units (G log2 e), so
// that each decay is one exp2f of a difference.
//
// Precision. Every matmul takes TF32 operands (10-bit mantissa, unit
// roundoff 2^-11) and accumulates in FP32: A and Aqk below the diagonal
// blocks, W S0, Q~ S0, Aqk d and Ke^T d. The diagonal blocks, the cumulative
// sums, the L2 norms and the triangular solve (forward substitution) are
// FP32 on CUDA cores, and the state is carried in FP32 (only its copy that
// feeds the next chunk's products is rounded to TF32).
//
// Kernel 1 (`kda_chunk_prepare_tc`, one 512-thread block per (chunk, value
// head, sequence), all chunks in parallel, one block per SM: 133 KiB of
// shared memory) writes per chunk to a scratch buffer (144.5 KiB): W, Q~, Aqk
// and Ke^T already rounded to TF32 and laid out as mma A fragments (one
// float4 per lane and 16 x 8 tile, so that the second kernel copies them
// with 16-byte cp.async), U (f32, [64][128]) and exp(G_L). Its last phase
// runs the forward substitution on 8 warps and writes Q~, Ke^T, Aqk on the
// other 8.
// Kernel 2 (`kda_chunk_state_tc`, one 128-thread block per (sequence, value
// head, 32 value columns)) walks the chunks in order with its state tile in
// registers (FP32, the C fragments of the update) and in shared memory (TF32,
// the B operand of the next products). The next chunks' operands are copied
// with cp.async while the current one is computed (W, Q~, U double-buffered,
// issued a whole chunk ahead; Aqk, Ke^T during the chunk's first phase).
// Warp w owns tokens 16w..16w+15 (d and O) and state rows 32w..32w+31.
// (64 columns per block, with single-buffered copies, measured slower than
// 32: half as many blocks, so half the SMs busy.)
//
// H200, B = 1, Hv = 32, dk = dv = 128, bf16 q/k/v (CUDA.md): at T = 4096
// kernel 1 takes 0.55 ms, kernel 2 0.23 ms.
#include "recurrence.cuh"

namespace berrylm::recurrence {

constexpr int kL = 64;           // tokens per chunk
constexpr int kSub = 16;         // tokens per sub-chunk (diagonal blocks)
constexpr int kKP = kChunkMaxDk;  // padded key dim
constexpr int kVP = kChunkMaxDv;  // padded value dim (row stride of U)
constexpr int kLd = kKP + 4;     // row stride of [token][channel] arrays
constexpr int kLdA = kL + 4;     // row stride of the 64 x 64 matrices
constexpr int kPrepThreads = 512;
constexpr double kLog2e = 1.4426950408889634;

// Offsets (floats) of one chunk's operands in the scratch buffer. The
// fragment arrays hold ((m_tile * k_steps + k_step) * 32 + lane) * 4 + reg.
constexpr int kOffW = 0;                        // W, 4 x 16 tiles (i, c)
constexpr int kOffQ = kOffW + kL * kKP;         // Q~, 4 x 16 tiles (i, c)
constexpr int kOffU = kOffQ + kL * kKP;         // U, [64][128]
constexpr int kOffAqk = kOffU + kL * kVP;       // Aqk, 4 x 8 tiles (i, j)
constexpr int kOffKe = kOffAqk + kL * kL;       // Ke^T, 8 x 8 tiles (c, j)
constexpr int kOffGl = kOffKe + kKP * kL;       // exp(G_L), [128]
constexpr int kScratch = kOffGl + kKP;
// The state kernel: value columns per block, threads, and what it copies
// per chunk: group A = W, Q~ and its U tile, group B = Aqk, Ke^T and
// exp(G_L) (contiguous).
constexpr int kBV = 32;
constexpr int kStateThreads = 128;
constexpr int kGroupA = 2 * kL * kKP + kL * kBV;
constexpr int kGroupB = kScratch - kOffAqk;

__device__ __forceinline__ uint32_t tf32_bits(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float tf32(float x) { return __uint_as_float(tf32_bits(x)); }

// c += a * b for one 16 x 8 x 8 tile (row-major A, column-major B).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void load_a(uint32_t (&a)[4], const float* frag) {
    const float4 f = *reinterpret_cast<const float4*>(frag);
    a[0] = __float_as_uint(f.x);
    a[1] = __float_as_uint(f.y);
    a[2] = __float_as_uint(f.z);
    a[3] = __float_as_uint(f.w);
}

// Position of element (m, k) of a 16 x 8 A tile in its fragment (lane * 4 + reg).
__device__ __forceinline__ int frag_pos(int m, int k) {
    return ((m & 7) * 4 + (k & 3)) * 4 + (m >> 3) + 2 * (k >> 2);
}

// Writes a (16 * MT) x (8 * KS) matrix, element (m, k) = value(m, k), as
// its m16 x k8 TF32 A fragments (tile (mt, ks) at unit mt * KS + ks, lane by
// lane, each lane's 4 registers as one float4), items `first`, `first +
// stride`, ... of its MT * KS * 32 float4s: coalesced when consecutive
// threads take consecutive items.
template <int MT, int KS, typename Value>
__device__ __forceinline__ void store_a_fragments(float* dst, int first, int stride,
                                                  Value value) {
    for (int item = first; item < MT * KS * 32; item += stride) {
        const int unit = item >> 5, fl = item & 31;
        const int mt = unit / KS, ks = unit % KS;
        float vals[4];
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
            const int m = mt * 16 + (fl >> 2) + 8 * (reg & 1);
            const int k = ks * 8 + (fl & 3) + 4 * (reg >> 1);
            vals[reg] = value(m, k);
        }
        *reinterpret_cast<float4*>(dst + item * 4) = make_float4(vals[0], vals[1], vals[2], vals[3]);
    }
}

__device__ __forceinline__ void cp_async16(float* smem, const float* gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed cp.async groups are
// still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ------------------------------------------------------------- kernel 1

constexpr size_t kPrepSmem =
    sizeof(float) * (3 * kL * kLd + 2 * kL * kLdA + kL);

template <typename T>
__global__ void __launch_bounds__(kPrepThreads, 1)
    kda_chunk_prepare_tc(const RecurrenceArgs args, float* __restrict__ scratch, int num_chunks) {
    extern __shared__ __align__(16) float smem[];
    float (*sQ)[kLd] = reinterpret_cast<float (*)[kLd]>(smem);  // q^, [token][channel]
    float (*sK)[kLd] = sQ + kL;                                 // k^
    float (*sG)[kLd] = sK + kL;                                 // G * log2(e)
    float (*sA)[kLdA] = reinterpret_cast<float (*)[kLdA]>(sG + kL);  // A (strict lower)
    float (*sB)[kLdA] = sA + kL;                                     // Aqk (lower)
    float* sBeta = &sB[kL][0];

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int g8 = lane >> 2, t4 = lane & 3;
    const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int dk = args.key_dim, dv = args.value_dim, hv = args.value_heads, hk = args.key_heads;
    const int seq_len = args.seq_len;
    const int key_head = h / (hv / hk);
    const int t0 = chunk * kL;
    float* out = scratch + ((static_cast<long long>(b) * hv + h) * num_chunks + chunk) * kScratch;
    const T* q = static_cast<const T*>(args.q);
    const T* k = static_cast<const T*>(args.k);
    const T* v = static_cast<const T*>(args.v);

    // (a) q, k, g with zeros past dk and past the end of the sequence (there
    // k = q = 0, g = 0 and beta = 0: no write, G stays at the last token's).
    // Every thread issues all its loads before using any (out-of-range
    // elements load element 0, which exists, and are replaced by zeros).
#pragma unroll
    for (int n = 0; n < kL * kKP / kPrepThreads; ++n) {
        const int idx = tid + n * kPrepThreads;
        const int i = idx / kKP, c = idx % kKP;
        const int t = t0 + i;
        const bool ok = t < seq_len && c < dk;
        const long long row = static_cast<long long>(b) * seq_len + t;
        const long long qk = ok ? (row * hk + key_head) * dk + c : 0;
        const long long gi = ok ? (row * hv + h) * dk + c : 0;
        const float qv = berrylm::to_f32(q[qk]);
        const float kv = berrylm::to_f32(k[qk]);
        const float gv = args.g[gi];
        sQ[i][c] = ok ? qv : 0.0f;
        sK[i][c] = ok ? kv : 0.0f;
        sG[i][c] = ok ? gv : 0.0f;
    }
    for (int idx = tid; idx < kL * kLdA; idx += kPrepThreads) {
        (&sA[0][0])[idx] = 0.0f;
        (&sB[0][0])[idx] = 0.0f;
    }
    if (tid < kL) {
        const int t = t0 + tid;
        sBeta[tid] =
            t < seq_len ? args.beta[(static_cast<long long>(b) * seq_len + t) * hv + h] : 0.0f;
    }
    __syncthreads();

    // (b) L2 norms (one warp per token), as the sequential kernels; (c) G,
    // summed in f64 and stored in base-2 units, G log2(e), so that every
    // decay is one exp2f (max. error 2 ulp) of a difference (one thread per
    // channel; these arrays are disjoint).
    for (int i = warp; i < kL; i += kPrepThreads / 32) {
        l2_normalize_qk(sQ[i], sK[i], kKP, lane, args.query_scale);
    }
    if (tid < kKP) {
        double running = 0.0;
        for (int i = 0; i < kL; ++i) {
            running += sG[i][tid];
            sG[i][tid] = static_cast<float>(running * kLog2e);
        }
    }
    __syncthreads();

    // (d1) Diagonal 16 x 16 blocks, elementwise: pairs j <= i of one
    // sub-chunk, four lanes per pair (channels c = 4 n + lane % 4, so that
    // the four lanes read four different banks).
    constexpr int kPairs = kSub * (kSub + 1) / 2;
    for (int item = tid; item < (kL / kSub) * kPairs * 4; item += kPrepThreads) {
        const int pair = item >> 2, quarter = item & 3;
        const int block = pair / kPairs;
        int p = pair % kPairs, i = 0;
        while (p > i) {
            p -= i + 1;
            ++i;
        }
        const int j = p;
        const int ri = block * kSub + i, rj = block * kSub + j;
        float acc_a = 0.0f, acc_b = 0.0f;
#pragma unroll 8
        for (int cc = 0; cc < kKP / 4; ++cc) {
            const int c = 4 * cc + quarter;
            const float kd = sK[rj][c] * exp2f(sG[ri][c] - sG[rj][c]);
            acc_a += sK[ri][c] * kd;
            acc_b += sQ[ri][c] * kd;
        }
        acc_a += __shfl_xor_sync(0xffffffffu, acc_a, 1);
        acc_b += __shfl_xor_sync(0xffffffffu, acc_b, 1);
        acc_a += __shfl_xor_sync(0xffffffffu, acc_a, 2);
        acc_b += __shfl_xor_sync(0xffffffffu, acc_b, 2);
        if (quarter == 0) {
            if (j < i) sA[ri][rj] = acc_a;
            sB[ri][rj] = acc_b;
        }
    }

    // (d2) Blocks below the diagonal, as TF32 matmuls: for sub-chunk I and
    // an 8-token column tile of the earlier ones, with r = 16 I,
    //   A[i][j] = sum_c (k^_i exp(G_i - G_r))[c] (k^_j exp(G_r - G_j))[c],
    // and Aqk with q^_i in place of k^_i (same factors). 12 tiles.
    for (int tile = warp; tile < 12; tile += kPrepThreads / 32) {
        const int sub = tile < 2 ? 1 : (tile < 6 ? 2 : 3);
        const int nt = tile - (sub == 1 ? 0 : (sub == 2 ? 2 : 6));
        const int r = sub * kSub;
        float acc_a[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc_b[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const int j = nt * 8 + g8;
#pragma unroll 4
        for (int ks = 0; ks < kKP / 8; ++ks) {
            uint32_t ka[4], qa[4], kb[2];
#pragma unroll
            for (int reg = 0; reg < 4; ++reg) {
                const int i = r + g8 + 8 * (reg & 1);
                const int c = ks * 8 + t4 + 4 * (reg >> 1);
                const float decay = exp2f(sG[i][c] - sG[r][c]);
                ka[reg] = tf32_bits(sK[i][c] * decay);
                qa[reg] = tf32_bits(sQ[i][c] * decay);
            }
#pragma unroll
            for (int reg = 0; reg < 2; ++reg) {
                const int c = ks * 8 + t4 + 4 * reg;
                kb[reg] = tf32_bits(sK[j][c] * exp2f(sG[r][c] - sG[j][c]));
            }
            mma_tf32(acc_a, ka, kb);
            mma_tf32(acc_b, qa, kb);
        }
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
            const int i = r + g8 + 8 * (reg >> 1);
            const int jj = nt * 8 + 2 * t4 + (reg & 1);
            sA[i][jj] = acc_a[reg];
            sB[i][jj] = acc_b[reg];
        }
    }
    __syncthreads();

    // The first 256 threads run (e), the others (f) meanwhile.
    constexpr int kSolveThreads = kKP + kVP;
    static_assert(kPrepThreads == 2 * kSolveThreads, "(e) and (f) split the block");
    if (tid >= kSolveThreads) {
        const int ft = tid - kSolveThreads;
        // (f) Q~ and Ke^T as A fragments, Aqk as A fragments, exp(G_L): one
        // float4 (4 elements of one lane) per item, coalesced.
        store_a_fragments<4, 16>(out + kOffQ, ft, kSolveThreads, [&](int i, int c) {
            return tf32(sQ[i][c] * exp2f(sG[i][c]));
        });
        store_a_fragments<8, 8>(out + kOffKe, ft, kSolveThreads, [&](int c, int j) {
            return tf32(sK[j][c] * exp2f(sG[kL - 1][c] - sG[j][c]));
        });
        store_a_fragments<4, 8>(out + kOffAqk, ft, kSolveThreads,
                                [&](int i, int j) { return tf32(sB[i][j]); });
        if (ft < kKP) out[kOffGl + ft] = exp2f(sG[kL - 1][ft]);
    } else {
        // (e) Forward substitution, one thread per column of [K~ | V] (128 +
        // 128 columns, zero past dk and dv):
        // X_i = beta_i (R_i - sum_{j<i} A_ij X_j), in FP32 with four partial
        // sums per row.
        const bool key_col = tid < kKP;
        const int col = key_col ? tid : tid - kKP;
        float x[kL];
        if (key_col) {
#pragma unroll
            for (int i = 0; i < kL; ++i) x[i] = sK[i][col] * exp2f(sG[i][col]);
        } else {
            const T* v_col = v + (static_cast<long long>(b) * seq_len * hv + h) * dv + col;
            const long long stride = static_cast<long long>(hv) * dv;
#pragma unroll
            for (int i = 0; i < kL; ++i) {
                x[i] = (col < dv && t0 + i < seq_len)
                           ? berrylm::to_f32(v_col[static_cast<long long>(t0 + i) * stride])
                           : 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < kL; ++i) {
            float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
#pragma unroll
            for (int j = 0; j + 3 < i; j += 4) {
                const float4 a = *reinterpret_cast<const float4*>(&sA[i][j]);
                p0 += a.x * x[j];
                p1 += a.y * x[j + 1];
                p2 += a.z * x[j + 2];
                p3 += a.w * x[j + 3];
            }
#pragma unroll
            for (int j = i & ~3; j < i; ++j) p0 += sA[i][j] * x[j];
            x[i] = sBeta[i] * (x[i] - ((p0 + p1) + (p2 + p3)));
        }
        if (key_col) {
            float* w = out + kOffW + (col / 8) * 32 * 4;
#pragma unroll
            for (int i = 0; i < kL; ++i) {
                w[(i / 16) * 16 * 32 * 4 + frag_pos(i & 15, col & 7)] = tf32(x[i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < kL; ++i) out[kOffU + i * kVP + col] = x[i];
        }
    }
}

// ------------------------------------------------------------- kernel 2

// Row stride of the state and d tiles (conflict-free B fragment reads:
// stride = 8 mod 32).
constexpr int kLdS = kBV + 8;
// Group A double-buffered, group B single.
constexpr size_t kStateSmem = sizeof(float) * (2 * kGroupA + kGroupB + (kKP + kL) * kLdS);
static_assert(kStateSmem <= 227 * 1024, "the H200's shared memory per block");

// Calls f(mt, nt, reg, c, e) for every register s[mt][nt][reg] of a warp's
// state fragments (m16n8 C fragments: 2 row tiles of 16, 4 column tiles of
// 8): the register holds row c of the state tile (the warp's 32 rows from
// 32 warp) and its column e.
template <typename F>
__device__ __forceinline__ void for_each_state_register(int warp, int g8, int t4, F f) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int reg = 0; reg < 4; ++reg) {
                f(mt, nt, reg, 32 * warp + 16 * mt + g8 + 8 * (reg >> 1),
                  8 * nt + 2 * t4 + (reg & 1));
            }
        }
    }
}

__global__ void __launch_bounds__(kStateThreads)
    kda_chunk_state_tc(const RecurrenceArgs args, const float* __restrict__ scratch,
                       int num_chunks) {
    extern __shared__ __align__(16) float smem[];
    float* bufA = smem;                  // 2 x (W frags | Q~ frags | U tile [64][32])
    float* bufB = bufA + 2 * kGroupA;    // Aqk frags | Ke^T frags | exp(G_L)
    float (*sS)[kLdS] = reinterpret_cast<float (*)[kLdS]>(bufB + kGroupB);  // TF32 state
    float (*sD)[kLdS] = sS + kKP;                                              // TF32 d

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int g8 = lane >> 2, t4 = lane & 3;
    const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int dk = args.key_dim, dv = args.value_dim, hv = args.value_heads;
    const int seq_len = args.seq_len;
    const int col0 = tile * kBV;
    const float* head =
        scratch + (static_cast<long long>(b) * hv + h) * num_chunks * static_cast<long long>(kScratch);

    auto copy_a = [&](int n) {
        const float* src = head + static_cast<long long>(n) * kScratch;
        float* dst = bufA + (n & 1) * kGroupA;
        for (int i = tid; i < 2 * kL * kKP / 4; i += kStateThreads) {
            cp_async16(dst + 4 * i, src + kOffW + 4 * i);
        }
        for (int i = tid; i < kL * kBV / 4; i += kStateThreads) {
            const int row = i / (kBV / 4), q4 = i % (kBV / 4);
            cp_async16(dst + 2 * kL * kKP + row * kBV + 4 * q4,
                       src + kOffU + row * kVP + col0 + 4 * q4);
        }
    };
    auto copy_b = [&](int n) {
        const float* src = head + static_cast<long long>(n) * kScratch + kOffAqk;
        for (int i = tid; i < kGroupB / 4; i += kStateThreads) cp_async16(bufB + 4 * i, src + 4 * i);
    };

    // The state tile: rows c = 32 warp + 16 mt + g8 (+8), columns
    // 8 nt + 2 t4 (+1), in C-fragment order.
    const long long row = state_row(args, b);
    const bool pooled = row >= 0;  // else a pad row: a zero state, none written
    const long long state_base = pooled ? (row * hv + h) * dk * dv : 0;
    float s[2][4][4];
    for_each_state_register(warp, g8, t4, [&](int mt, int nt, int reg, int c, int e) {
        const int col = col0 + e;
        s[mt][nt][reg] = (pooled && c < dk && col < dv)
                             ? args.state_in[state_base + static_cast<long long>(c) * dv + col]
                             : 0.0f;
        sS[c][e] = tf32(s[mt][nt][reg]);
    });

    // Commit order: A(0), B(0), then per chunk n: A(n + 1) before phase A
    // (into the other buffer; a whole chunk to land), B(n + 1) after phase
    // B (a phase A to land). Empty groups past the end keep the counting.
    copy_a(0);
    cp_async_commit();
    copy_b(0);
    cp_async_commit();
    for (int n = 0; n < num_chunks; ++n) {
        const int t0 = n * kL;
        if (n + 1 < num_chunks) copy_a(n + 1);
        cp_async_commit();
        cp_async_wait<2>();  // A(n) (B(n) and A(n + 1) may be in flight)
        __syncthreads();
        const float* group_a = bufA + (n & 1) * kGroupA;

        // Phase A: d = U - W S and O = Q~ S for tokens 16 warp + (0..15).
        float acc_d[4][4], acc_o[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int reg = 0; reg < 4; ++reg) acc_d[nt][reg] = acc_o[nt][reg] = 0.0f;
        }
#pragma unroll 4
        for (int ks = 0; ks < kKP / 8; ++ks) {
            uint32_t wa[4], qa[4];
            load_a(wa, group_a + ((warp * 16 + ks) * 32 + lane) * 4);
            load_a(qa, group_a + kL * kKP + ((warp * 16 + ks) * 32 + lane) * 4);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const uint32_t bb[2] = {__float_as_uint(sS[ks * 8 + t4][nt * 8 + g8]),
                                        __float_as_uint(sS[ks * 8 + t4 + 4][nt * 8 + g8])};
                mma_tf32(acc_d[nt], wa, bb);
                mma_tf32(acc_o[nt], qa, bb);
            }
        }
        const float* u_tile = group_a + 2 * kL * kKP;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int reg = 0; reg < 4; ++reg) {
                const int i = 16 * warp + g8 + 8 * (reg >> 1);
                const int e = 8 * nt + 2 * t4 + (reg & 1);
                sD[i][e] = tf32(u_tile[i * kBV + e] - acc_d[nt][reg]);
            }
        }
        cp_async_wait<1>();  // B(n) (A(n + 1) may be in flight)
        __syncthreads();     // and d complete

        // Phase B: O += Aqk d (only sub-chunks j <= this warp's), stored.
#pragma unroll
        for (int ks = 0; ks < kL / 8; ++ks) {
            if (ks < 2 * warp + 2) {
                uint32_t aa[4];
                load_a(aa, bufB + ((warp * 8 + ks) * 32 + lane) * 4);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const uint32_t bb[2] = {__float_as_uint(sD[ks * 8 + t4][nt * 8 + g8]),
                                            __float_as_uint(sD[ks * 8 + t4 + 4][nt * 8 + g8])};
                    mma_tf32(acc_o[nt], aa, bb);
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int reg = 0; reg < 4; ++reg) {
                const int t = t0 + 16 * warp + g8 + 8 * (reg >> 1);
                const int col = col0 + 8 * nt + 2 * t4 + (reg & 1);
                if (t < seq_len && col < dv) {
                    const long long row = static_cast<long long>(b) * seq_len + t;
                    args.out[(row * hv + h) * dv + col] = acc_o[nt][reg];
                }
            }
        }

        // S = exp(G_L) S + Ke^T d for this warp's 32 state rows.
        const float* gl = bufB + (kOffGl - kOffAqk);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int reg = 0; reg < 4; ++reg) {
                const float decay = gl[32 * warp + 16 * mt + g8 + 8 * (reg >> 1)];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) s[mt][nt][reg] *= decay;
            }
        }
#pragma unroll
        for (int ks = 0; ks < kL / 8; ++ks) {
            uint32_t bb[4][2];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                bb[nt][0] = __float_as_uint(sD[ks * 8 + t4][nt * 8 + g8]);
                bb[nt][1] = __float_as_uint(sD[ks * 8 + t4 + 4][nt * 8 + g8]);
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                uint32_t aa[4];
                load_a(aa, bufB + (kOffKe - kOffAqk) + (((2 * warp + mt) * 8 + ks) * 32 + lane) * 4);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) mma_tf32(s[mt][nt], aa, bb[nt]);
            }
        }
        for_each_state_register(warp, g8, t4, [&](int mt, int nt, int reg, int c, int e) {
            sS[c][e] = tf32(s[mt][nt][reg]);
        });
        __syncthreads();  // S complete; group B's buffer free
        if (n + 1 < num_chunks) copy_b(n + 1);
        cp_async_commit();
    }

    for_each_state_register(warp, g8, t4, [&](int mt, int nt, int reg, int c, int e) {
        const int col = col0 + e;
        if (pooled && c < dk && col < dv) {
            args.state_out[state_base + static_cast<long long>(c) * dv + col] = s[mt][nt][reg];
        }
    });
}

template <typename T>
int launch_chunked(const RecurrenceArgs& args, int batch, cudaStream_t stream) {
    // Per call (cheap), so that every device the kernels run on is configured.
    cudaError_t err = cudaFuncSetAttribute(kda_chunk_prepare_tc<T>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(kPrepSmem));
    if (err != cudaSuccess) return static_cast<int>(err);
    err = cudaFuncSetAttribute(kda_chunk_state_tc, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kStateSmem));
    if (err != cudaSuccess) return static_cast<int>(err);
    const int num_chunks = (args.seq_len + kL - 1) / kL;
    const size_t bytes = sizeof(float) * static_cast<size_t>(batch) * args.value_heads *
                         num_chunks * static_cast<size_t>(kScratch);
    void* scratch = nullptr;
    err = cudaMallocAsync(&scratch, bytes, stream);
    if (err != cudaSuccess) return static_cast<int>(err);
    kda_chunk_prepare_tc<T><<<dim3(num_chunks, args.value_heads, batch), kPrepThreads, kPrepSmem,
                              stream>>>(args, static_cast<float*>(scratch), num_chunks);
    kda_chunk_state_tc<<<dim3((args.value_dim + kBV - 1) / kBV, args.value_heads, batch),
                         kStateThreads, kStateSmem, stream>>>(
        args, static_cast<const float*>(scratch), num_chunks);
    const int status = berrylm::launch_status();
    err = cudaFreeAsync(scratch, stream);
    if (status != 0) return status;
    return static_cast<int>(err);
}

template int launch_chunked<float>(const RecurrenceArgs&, int, cudaStream_t);
template int launch_chunked<__nv_bfloat16>(const RecurrenceArgs&, int, cudaStream_t);
template int launch_chunked<__half>(const RecurrenceArgs&, int, cudaStream_t);

}  // namespace berrylm::recurrence
