// Causal grouped-query attention over a prompt (spec 3.5 step 4):
//
//   o_i = sum_j softmax_j(scale * q_i . k_j) v_j      j <= prefix + i
//
// for the T queries at the last T positions of L keys (prefix = L - T),
// query head h reading key/value head h / (Hq / Hkv). q and o are
// [B, Hq, T, D] and k and v [B, Hkv, L, D], each with a contiguous last
// dimension and its own batch, head and position strides: token-major rows
// ([B, T, H, D] in memory, as the projections write them and the output
// projection reads them) or head-major ones, and k and v views of a larger
// cache.
//
// Two kernels:
//
// * `flash_kernel` (bf16/f16, D in {64, 128, 256}): FlashAttention-2-style.
//   A block of 4 warps owns 64 queries of one head; each warp owns 16 query
//   rows. The block walks the key tiles (64 keys each) up to its causal
//   limit: S = Q K^T on tensor cores (mma.sync m16n8k16, f32 accumulators),
//   the online softmax in f32 (running max and sum per row, the output
//   accumulator rescaled when the max grows), P rounded to the input dtype
//   and O += P V on tensor cores. Tiles live in shared memory, loaded with
//   cp.async: the V tile streams in while S is computed, the next K tile
//   while the softmax and P V run. Rows are padded by 16 bytes so that the
//   ldmatrix reads of 8 rows hit 8 different bank groups. The blocks of the
//   last query tiles (the most keys) are scheduled first.
//
// * `wgmma_flash_kernel` (sm_90a builds, bf16/f16, D in {128, 256}): the
//   same algorithm with Hopper's warpgroup MMAs, 128 queries a block; it
//   replaces `flash_kernel` for those head dims where it is compiled (the
//   same results bit for bit, 1.25x its rate at 16384 tokens of BerryLM-OS:
//   kernels/CUDA.md).
//
// * `scalar_kernel` (any dtype, D <= 512): one warp per query, the same
//   online softmax with scalar f32 arithmetic; the fallback for f32 inputs
//   and other head dims.
//
// Neither rounds the scores to the input dtype as the CPU reference does, and
// their sums run in another order: they agree with it within the rounding of
// the output dtype.
#include "mma.cuh"
#if BERRYLM_WGMMA
#include "tma.cuh"
#include "wgmma.cuh"
#endif

namespace berrylm::attention {

using namespace berrylm::mma;

// A rank-4 operand's strides in elements (its last dimension contiguous).
struct Strides {
    long long batch, head, row;
    __device__ long long at(int b, int h, long long r) const {
        return b * batch + h * head + r * row;
    }
};

struct Params {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    int heads;
    int kv_heads;
    int queries;
    int keys;
    int head_dim;
    Strides q_strides, k_strides, v_strides, out_strides;
    // softmax_scale * log2(e): the kernels exponentiate with exp2f.
    float scale_log2;
};

constexpr float kLog2e = 1.4426950408889634f;

// ------------------------------------------------------- tensor-core kernel

constexpr int kBlockM = 64;  // queries per block
constexpr int kBlockN = 64;  // keys per tile
constexpr int kWarps = 4;    // each owns 16 query rows
constexpr int kThreads = kWarps * 32;
constexpr int kPad = 8;      // elements of padding per shared-memory row

template <typename T, int D> constexpr int flash_smem_bytes() {
    return (kBlockM + 2 * kBlockN) * (D + kPad) * static_cast<int>(sizeof(T));
}

// Starts loading `ROWS` rows of D elements, `row_stride` elements apart from
// `src`, into the padded tile `dst`; rows from `valid_rows` on are zeros.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_tile(T* dst, const T* src, long long row_stride,
                                          int valid_rows) {
    constexpr int kChunks = D / 8;  // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * kChunks; c += kThreads) {
        const int row = c / kChunks;
        const int col = (c % kChunks) * 8;
        const bool valid = row < valid_rows;
        const T* from = valid ? src + row * row_stride + col : src;
        cp_async_16(dst + row * (D + kPad) + col, from, valid ? 16 : 0);
    }
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) flash_kernel(const Params p) {
    static_assert(D % 16 == 0 && D <= 256, "head dim");
    constexpr int kStride = D + kPad;
    extern __shared__ __align__(16) unsigned char smem[];
    T* s_q = reinterpret_cast<T*>(smem);
    T* s_k = s_q + kBlockM * kStride;
    T* s_v = s_k + kBlockN * kStride;

    const int tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (p.heads / p.kv_heads);
    const int m0 = tile * kBlockM;
    const int prefix = p.keys - p.queries;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int group = lane / 4;   // the fragment row of this lane
    const int quad = lane % 4;    // the fragment column pair of this lane

    const T* q = static_cast<const T*>(p.q) + p.q_strides.at(batch, head, m0);
    const T* k = static_cast<const T*>(p.k) + p.k_strides.at(batch, kv_head, 0);
    const T* v = static_cast<const T*>(p.v) + p.v_strides.at(batch, kv_head, 0);
    const long long k_row = p.k_strides.row;
    const long long v_row = p.v_strides.row;

    // Keys any query of the tile sees: 0 .. prefix + m0 + kBlockM - 1.
    const int key_end = min(p.keys, prefix + m0 + kBlockM);
    const int tiles = (key_end + kBlockN - 1) / kBlockN;

    load_tile<T, D, kBlockM>(s_q, q, p.q_strides.row, p.queries - m0);
    load_tile<T, D, kBlockN>(s_k, k, k_row, key_end);
    cp_async_commit();

    float o[D / 8][4] = {};
    // Per fragment row (group, group + 8): running max of the scaled scores
    // (log2 units) and this lane's part of the running sum.
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};
    const int warp_row = warp * 16;
    // Largest key index each of this lane's rows may see.
    const int limit[2] = {prefix + m0 + warp_row + group, prefix + m0 + warp_row + group + 8};

    for (int t = 0; t < tiles; ++t) {
        const int n0 = t * kBlockN;
        load_tile<T, D, kBlockN>(s_v, v + n0 * v_row, v_row, key_end - n0);
        cp_async_commit();
        cp_async_wait<1>();  // Q and this K tile
        __syncthreads();

        // S = Q K^T for this warp's 16 rows and the 64 keys.
        float s[kBlockN / 8][4] = {};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned a[4];
            ldmatrix_x4(a, s_q + (warp_row + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride +
                               kk * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int nb = 0; nb < kBlockN / 8; nb += 2) {
                unsigned b[4];
                ldmatrix_x4(b, s_k + (nb * 8 + (lane & 7) + (lane >> 4) * 8) * kStride +
                                   kk * 16 + ((lane >> 3) & 1) * 8);
                mma_16816<T>(s[nb], a, b[0], b[1]);
                mma_16816<T>(s[nb + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with s_k
        if (t + 1 < tiles) {
            const int next = n0 + kBlockN;
            load_tile<T, D, kBlockN>(s_k, k + next * k_row, k_row, key_end - next);
        }
        cp_async_commit();

        // The causal limit and the end of the keys, where this tile reaches them.
        const bool masked = n0 + kBlockN - 1 > prefix + m0 + warp_row || n0 + kBlockN > p.keys;
#pragma unroll
        for (int nb = 0; nb < kBlockN / 8; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = n0 + nb * 8 + quad * 2 + (e & 1);
                const bool hidden = masked && (key > limit[e >> 1] || key >= p.keys);
                s[nb][e] = hidden ? -INFINITY : s[nb][e] * p.scale_log2;
            }
        }
        // Online softmax: the new running max, the rescaling of what was
        // accumulated, and P = exp2(S - max).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int nb = 0; nb < kBlockN / 8; ++nb) {
                tile_max = fmaxf(tile_max, fmaxf(s[nb][2 * r], s[nb][2 * r + 1]));
            }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float new_max = fmaxf(row_max[r], tile_max);
            // Every row sees key 0 in the first tile, so the max is finite
            // from then on; the guard keeps -inf - -inf out regardless.
            const float base = new_max == -INFINITY ? 0.0f : new_max;
            const float rescale = exp2f(row_max[r] - base);
            row_max[r] = new_max;
            float sum = 0.0f;
#pragma unroll
            for (int nb = 0; nb < kBlockN / 8; ++nb) {
                s[nb][2 * r] = exp2f(s[nb][2 * r] - base);
                s[nb][2 * r + 1] = exp2f(s[nb][2 * r + 1] - base);
                sum += s[nb][2 * r] + s[nb][2 * r + 1];
            }
            row_sum[r] = row_sum[r] * rescale + sum;
#pragma unroll
            for (int db = 0; db < D / 8; ++db) {
                o[db][2 * r] *= rescale;
                o[db][2 * r + 1] *= rescale;
            }
        }

        cp_async_wait<1>();  // this V tile
        __syncthreads();
        // O += P V: P's accumulator fragments are the A fragments of the
        // 16-key steps.
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            unsigned a[4];
            a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int db = 0; db < D / 8; db += 2) {
                unsigned b[4];
                ldmatrix_x4_trans(b, s_v + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride +
                                         db * 8 + (lane >> 4) * 8);
                mma_16816<T>(o[db], a, b[0], b[1]);
                mma_16816<T>(o[db + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // every warp is done with s_v
    }
    cp_async_wait<0>();

    // o / sum, rounded to T; rows past the queries are not written.
    T* out = static_cast<T*>(p.out) + p.out_strides.at(batch, head, m0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = 1.0f / sum;
        const int row = warp_row + group + 8 * r;
        if (m0 + row >= p.queries) continue;
#pragma unroll
        for (int db = 0; db < D / 8; ++db) {
            const unsigned pair = pack2<T>(o[db][2 * r] * inv, o[db][2 * r + 1] * inv);
            *reinterpret_cast<unsigned*>(out + row * p.out_strides.row + db * 8 + quad * 2) =
                pair;
        }
    }
}

template <typename T, int D> int launch_flash(const Params& p, int batch, cudaStream_t stream) {
    constexpr int smem = flash_smem_bytes<T, D>();
    cudaError_t status = cudaFuncSetAttribute(
        flash_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (status != cudaSuccess) return static_cast<int>(status);
    const dim3 grid((p.queries + kBlockM - 1) / kBlockM, p.heads, batch);
    flash_kernel<T, D><<<grid, kThreads, smem, stream>>>(p);
    return berrylm::launch_status();
}

// ------------------------------------------------- Hopper tensor-core kernel
#if BERRYLM_WGMMA

// `flash_kernel`'s algorithm with warpgroup MMAs (sm_90a, D in {128, 256}): a
// block of two warpgroups owns 128 queries of one head, each warpgroup 64 of
// them. Q, and each K and V tile of 64 keys, sit in shared memory as blocks of
// 64 columns (128-byte rows, swizzled: wgmma.cuh). Per tile a warpgroup runs
// S = Q K^T (m64n64k16, both operands from shared memory), the online
// softmax on S's fragment in registers (the same f32 arithmetic as
// flash_kernel), and O += P V with P from registers (P's fragment is S's,
// rounded to T) and V read transposed (m64n128k16 per 128 columns of O).
//
// K and V tiles arrive by the TMA: one thread asks for a tile's 2 x D / 64
// swizzled boxes (tensor maps of K and V made by the launcher), counted on
// that tile's mbarrier, which every thread waits on before the tile's block
// barrier. Rows past the last key land as zeros; keys past a block's causal
// limit are masked. The products of P V are left running into the next tile:
// the tensor cores take them and the next S = Q K^T back to back while the
// warpgroups meet at the tile's barrier, and one wait covers both. So that
// every buffer is refilled only after both warpgroups have waited for the
// products that read it, K is double buffered and V triple buffered: at tile
// t's barrier every warpgroup has finished S of tile t - 1 and P V of tile
// t - 2, whose buffers take K and V of tile t + 1 (tile t's mbarrier is
// t % 6, the period of both). A warpgroup skips the tiles wholly past its
// queries' causal limit.
constexpr int kWgQueries = 128;  // per block
constexpr int kWgKeys = 64;      // per tile
constexpr int kWgThreads = 256;

template <int D> struct WgmmaLayout {
    static_assert(D % 128 == 0 && D <= 256, "whole m64n128 products of O");
    static constexpr int kQBytes = kWgQueries * D * 2;
    static constexpr int kTileBytes = kWgKeys * D * 2;  // one K or V tile
    static constexpr int kKBuffers = 2;
    static constexpr int kVBuffers = 3;
    static constexpr int kTileBarriers = 6;  // a multiple of both buffer counts
    static constexpr int kSmemBytes =
        kQBytes + (kKBuffers + kVBuffers) * kTileBytes + wgmma::kTileAlign;
};

// Starts loading ROWS rows of D elements (`row_stride` apart from `src`)
// into `dst` as D / 64 swizzled blocks of [ROWS x 128 bytes]; rows from
// `valid_rows` on are zeros.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_swizzled(unsigned char* dst, const T* src,
                                              long long row_stride, int valid_rows) {
    constexpr int kChunks = D / 8;  // 16-byte chunks per row
#pragma unroll
    for (int c = threadIdx.x; c < ROWS * kChunks; c += kWgThreads) {
        const int row = c / kChunks;
        const int chunk = c % kChunks;
        const bool valid = row < valid_rows;
        const T* from = valid ? src + row * row_stride + chunk * 8 : src;
        cp_async_16(dst + (chunk / 8) * ROWS * wgmma::kRowBytes +
                        wgmma::swizzled_offset(row, chunk % 8),
                    from, valid ? 16 : 0);
    }
}


template <typename T, int D>
__global__ void __launch_bounds__(kWgThreads, 1)
    wgmma_flash_kernel(const Params p, const __grid_constant__ CUtensorMap k_map,
                       const __grid_constant__ CUtensorMap v_map) {
    using L = WgmmaLayout<D>;
    __shared__ alignas(8) uint64_t tile_landed[L::kTileBarriers];
    constexpr int kHalves = D / 128;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t raw_address = smem_address(smem_raw);
    const uint32_t base =
        (raw_address + wgmma::kTileAlign - 1) & ~uint32_t(wgmma::kTileAlign - 1);
    unsigned char* smem = smem_raw + (base - raw_address);
    // Q, then the K buffers, then the V buffers.
    const auto k_offset = [](int tile) { return L::kQBytes + (tile % L::kKBuffers) * L::kTileBytes; };
    const auto v_offset = [](int tile) {
        return L::kQBytes + (L::kKBuffers + tile % L::kVBuffers) * L::kTileBytes;
    };

    const int tile = gridDim.x - 1 - blockIdx.x;  // the longest rows first
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (p.heads / p.kv_heads);
    const int m0 = tile * kWgQueries;
    const int prefix = p.keys - p.queries;
    const int warpgroup = threadIdx.x / 128;
    const int lane = threadIdx.x % 32;
    const int group = lane / 4;
    const int quad = lane % 4;
    const int wg_row = warpgroup * 64;
    const int row0 = wg_row + (threadIdx.x / 32 % 4) * 16 + group;  // this lane's first row

    const T* q = static_cast<const T*>(p.q) + p.q_strides.at(batch, head, m0);

    const int key_end = min(p.keys, prefix + m0 + kWgQueries);
    const int tiles = (key_end + kWgKeys - 1) / kWgKeys;
    // The last key this warpgroup's queries see, and whether it has queries.
    const int wg_last_key = prefix + m0 + wg_row + 63;
    const bool has_queries = m0 + wg_row < p.queries;
    // Issued by thread 0: tile t's K and V, D / 64 boxes of 64 keys x 64
    // columns each.
    const auto load_keys = [&](int t) {
        uint64_t* landed = &tile_landed[t % L::kTileBarriers];
        tma::barrier_expect_bytes(landed, 2 * L::kTileBytes);
#pragma unroll
        for (int b = 0; b < D / 64; ++b) {
            const int box = b * kWgKeys * wgmma::kRowBytes;
            tma::load_4d(smem + k_offset(t) + box, &k_map, landed, 64 * b, t * kWgKeys, kv_head,
                         batch);
            tma::load_4d(smem + v_offset(t) + box, &v_map, landed, 64 * b, t * kWgKeys, kv_head,
                         batch);
        }
    };

    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < L::kTileBarriers; ++i) tma::barrier_init(&tile_landed[i], 1);
        tma::barrier_init_fence();
    }
    load_swizzled<T, D, kWgQueries>(smem, q, p.q_strides.row, p.queries - m0);
    cp_async_commit();
    cp_async_wait<0>();
    wgmma::fence_async_shared();
    __syncthreads();  // Q landed, the mbarriers initialised
    if (threadIdx.x == 0) load_keys(0);

    float o[kHalves][64];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int i = 0; i < 64; ++i) o[h][i] = 0.0f;
    }
    // P of the last tile, read by its pending products.
    unsigned a[kWgKeys / 16][4] = {};
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.0f, 0.0f};
    const int limit[2] = {prefix + m0 + row0, prefix + m0 + row0 + 8};
    const uint32_t q_rows = base + wg_row * wgmma::kRowBytes;

    for (int t = 0; t < tiles; ++t) {
        const int n0 = t * kWgKeys;
        tma::barrier_wait(&tile_landed[t % L::kTileBarriers], (t / L::kTileBarriers) & 1);
        __syncthreads();  // tile t landed; S of t - 1 and P V of t - 2 are done
        if (threadIdx.x == 0 && t + 1 < tiles) load_keys(t + 1);
        if (!has_queries || n0 > wg_last_key) continue;

        // S = Q K^T for this warpgroup's 64 rows and the tile's 64 keys.
        float s[kWgKeys / 2];
#pragma unroll
        for (int i = 0; i < kWgKeys / 2; ++i) s[i] = 0.0f;
        wgmma::fence_registers(s);
        wgmma::fence_operands();
        const uint32_t k_rows = base + k_offset(t);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            // Columns 16 kk ..: block kk / 4, 32 bytes a step within its rows.
            const uint32_t column = (kk % 4) * 32;
            wgmma::mma_m64n64k16<T>(
                s, wgmma::descriptor(q_rows + (kk / 4) * kWgQueries * wgmma::kRowBytes + column),
                wgmma::descriptor(k_rows + (kk / 4) * kWgKeys * wgmma::kRowBytes + column));
        }
        wgmma::commit_group();
        wgmma::wait_group<0>();  // this S, and P V of the tile before
        wgmma::fence_registers(s);
        wgmma::fence_registers(a);
        wgmma::fence_registers(o);

        // Element i of S's fragment: row row0 + 8 ((i / 2) % 2), key n0 + 8
        // (i / 4) + 2 quad + i % 2 (wgmma.cuh).
        const bool masked = n0 + kWgKeys - 1 > prefix + m0 + wg_row || n0 + kWgKeys > p.keys;
#pragma unroll
        for (int i = 0; i < kWgKeys / 2; ++i) {
            const int key = n0 + 8 * (i / 4) + 2 * quad + i % 2;
            const bool hidden = masked && (key > limit[(i / 2) % 2] || key >= p.keys);
            s[i] = hidden ? -INFINITY : s[i] * p.scale_log2;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int j = 0; j < kWgKeys / 8; ++j) {
                tile_max = fmaxf(tile_max, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
            }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const float new_max = fmaxf(row_max[r], tile_max);
            const float shift = new_max == -INFINITY ? 0.0f : new_max;
            const float rescale = exp2f(row_max[r] - shift);
            row_max[r] = new_max;
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < kWgKeys / 8; ++j) {
                s[4 * j + 2 * r] = exp2f(s[4 * j + 2 * r] - shift);
                s[4 * j + 2 * r + 1] = exp2f(s[4 * j + 2 * r + 1] - shift);
                sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
            }
            row_sum[r] = row_sum[r] * rescale + sum;
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    o[h][4 * j + 2 * r] *= rescale;
                    o[h][4 * j + 2 * r + 1] *= rescale;
                }
            }
        }

        // O += P V: P's fragment for keys 16 kk .. 16 kk + 15 is S's n8
        // blocks 2 kk and 2 kk + 1. Left running (see above).
#pragma unroll
        for (int kk = 0; kk < kWgKeys / 16; ++kk) {
            a[kk][0] = pack2<T>(s[8 * kk], s[8 * kk + 1]);
            a[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
            a[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
            a[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
        }
        wgmma::fence_registers(a);
        wgmma::fence_registers(o);
        wgmma::fence_operands();
        const uint32_t v_rows = base + v_offset(t);
        constexpr uint32_t kBlockBytes = kWgKeys * wgmma::kRowBytes;  // V's 64-column block
#pragma unroll
        for (int kk = 0; kk < kWgKeys / 16; ++kk) {
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
                wgmma::mma_m64n128k16_rs<T>(
                    o[h], a[kk],
                    wgmma::descriptor_mn(v_rows + 2 * h * kBlockBytes + kk * 16 * wgmma::kRowBytes,
                                         kBlockBytes));
            }
        }
        wgmma::commit_group();
        wgmma::fence_registers(a);
        wgmma::fence_registers(o);
    }
    wgmma::wait_group<0>();
    wgmma::fence_registers(a);
    wgmma::fence_registers(o);
    if (!has_queries) return;

    T* out = static_cast<T*>(p.out) + p.out_strides.at(batch, head, m0);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = 1.0f / sum;
        const int row = row0 + 8 * r;
        if (m0 + row >= p.queries) continue;
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const unsigned pair =
                    pack2<T>(o[h][4 * j + 2 * r] * inv, o[h][4 * j + 2 * r + 1] * inv);
                *reinterpret_cast<unsigned*>(out + row * p.out_strides.row + 128 * h + 8 * j +
                                             quad * 2) = pair;
            }
        }
    }
}

// The tensor map of K or V (`base` with `strides`, in elements) as
// [batch, kv heads, keys, D] read in boxes of 64 keys x 64 columns; false
// where the driver refuses it. A dimension of one element gets any legal
// stride (its coordinate is always 0).
bool encode_kv_map(CUtensorMap* map, const void* base, const Strides& strides, int batch,
                   int kv_heads, int keys, int head_dim) {
    const auto stride_bytes = [](long long stride, int extent) {
        return static_cast<cuuint64_t>(extent == 1 ? 16 : stride * 2);
    };
    const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(keys),
                                static_cast<cuuint64_t>(kv_heads), static_cast<cuuint64_t>(batch)};
    const cuuint64_t byte_strides[3] = {stride_bytes(strides.row, keys),
                                        stride_bytes(strides.head, kv_heads),
                                        stride_bytes(strides.batch, batch)};
    const cuuint32_t box[4] = {64, kWgKeys, 1, 1};
    return tma::encode_swizzled_map(map, base, dims, byte_strides, box);
}

// The warpgroup kernel, or `flash_kernel` where the driver makes no tensor
// maps of these operands.
template <typename T, int D>
int launch_wgmma_flash(const Params& p, int batch, cudaStream_t stream) {
    CUtensorMap k_map;
    CUtensorMap v_map;
    if (!encode_kv_map(&k_map, p.k, p.k_strides, batch, p.kv_heads, p.keys, D) ||
        !encode_kv_map(&v_map, p.v, p.v_strides, batch, p.kv_heads, p.keys, D)) {
        return launch_flash<T, D>(p, batch, stream);
    }
    constexpr int smem = WgmmaLayout<D>::kSmemBytes;
    cudaError_t status = cudaFuncSetAttribute(
        wgmma_flash_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (status != cudaSuccess) return static_cast<int>(status);
    const dim3 grid((p.queries + kWgQueries - 1) / kWgQueries, p.heads, batch);
    wgmma_flash_kernel<T, D><<<grid, kWgThreads, smem, stream>>>(p, k_map, v_map);
    return berrylm::launch_status();
}

#endif  // BERRYLM_WGMMA

// ----------------------------------------------------------- scalar kernel

constexpr int kScalarWarps = 4;
constexpr int kMaxPerLane = 16;  // D <= 32 * 16

template <typename T> __global__ void scalar_kernel(const Params p) {
    const int lane = threadIdx.x % 32;
    const int query = blockIdx.x * kScalarWarps + threadIdx.x / 32;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    if (query >= p.queries) return;
    const int D = p.head_dim;
    const int kv_head = head / (p.heads / p.kv_heads);
    const T* q = static_cast<const T*>(p.q) + p.q_strides.at(batch, head, query);
    const T* k = static_cast<const T*>(p.k) + p.k_strides.at(batch, kv_head, 0);
    const T* v = static_cast<const T*>(p.v) + p.v_strides.at(batch, kv_head, 0);

    float qr[kMaxPerLane], acc[kMaxPerLane];
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + 32 * i;
        qr[i] = d < D ? to_f32(q[d]) : 0.0f;
        acc[i] = 0.0f;
    }
    float max = -INFINITY, sum = 0.0f;
    const int last = p.keys - p.queries + query;
    for (int j = 0; j <= last; ++j) {
        const T* key = k + j * p.k_strides.row;
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
            const int d = lane + 32 * i;
            if (d < D) dot += qr[i] * to_f32(key[d]);
        }
        const float score = berrylm::warp_sum(dot) * p.scale_log2;
        const float new_max = fmaxf(max, score);
        const float rescale = exp2f(max - new_max);
        const float weight = exp2f(score - new_max);
        max = new_max;
        sum = sum * rescale + weight;
        const T* value = v + j * p.v_strides.row;
#pragma unroll
        for (int i = 0; i < kMaxPerLane; ++i) {
            const int d = lane + 32 * i;
            if (d < D) acc[i] = acc[i] * rescale + weight * to_f32(value[d]);
        }
    }
    T* out = static_cast<T*>(p.out) + p.out_strides.at(batch, head, query);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < D) out[d] = from_f32<T>(acc[i] / sum);
    }
}

}  // namespace berrylm::attention

using namespace berrylm::attention;

// Each of q, k, v and out comes with its batch, head and row strides in
// elements (`*_strides[3]`); rows are contiguous.
extern "C" int berrylm_causal_attention(int dtype, const void* q, const void* k, const void* v,
                                        void* out, int batch, int heads, int kv_heads,
                                        int queries, int keys, int head_dim,
                                        const long long* q_strides, const long long* k_strides,
                                        const long long* v_strides, const long long* out_strides,
                                        float softmax_scale, void* stream) {
    if (batch == 0 || heads == 0 || queries == 0 || head_dim == 0) return 0;
    if (kv_heads <= 0 || heads % kv_heads != 0 || keys < queries || head_dim > 32 * kMaxPerLane ||
        heads > 65535 || batch > 65535) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    const auto strides = [](const long long* s) { return Strides{s[0], s[1], s[2]}; };
    const Params p{q,
                   k,
                   v,
                   out,
                   heads,
                   kv_heads,
                   queries,
                   keys,
                   head_dim,
                   strides(q_strides),
                   strides(k_strides),
                   strides(v_strides),
                   strides(out_strides),
                   softmax_scale * kLog2e};
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (dtype == berrylm::kBF16 || dtype == berrylm::kF16) {
        const bool bf16 = dtype == berrylm::kBF16;
        switch (head_dim) {
            case 64:
                return bf16 ? launch_flash<__nv_bfloat16, 64>(p, batch, s)
                            : launch_flash<__half, 64>(p, batch, s);
#if BERRYLM_WGMMA
            case 128:
                return bf16 ? launch_wgmma_flash<__nv_bfloat16, 128>(p, batch, s)
                            : launch_wgmma_flash<__half, 128>(p, batch, s);
            case 256:
                return bf16 ? launch_wgmma_flash<__nv_bfloat16, 256>(p, batch, s)
                            : launch_wgmma_flash<__half, 256>(p, batch, s);
#else
            case 128:
                return bf16 ? launch_flash<__nv_bfloat16, 128>(p, batch, s)
                            : launch_flash<__half, 128>(p, batch, s);
            case 256:
                return bf16 ? launch_flash<__nv_bfloat16, 256>(p, batch, s)
                            : launch_flash<__half, 256>(p, batch, s);
#endif
            default:
                break;
        }
    }
    const dim3 grid((queries + kScalarWarps - 1) / kScalarWarps, heads, batch);
    BERRYLM_DISPATCH_DTYPE(dtype, T, {
        scalar_kernel<T><<<grid, kScalarWarps * 32, 0, s>>>(p);
    });
    return berrylm::launch_status();
}
