// The routed experts of many routed rows (prompts, large decode batches) as
// grouped GEMMs on the tensor cores, bf16 and f16, with the reference's
// rounding points (moe.cu's file comment): for each routed row r = n * top_k
// + s with expert e = ids[r] < E,
//   gate | up = round_x(W_gu[e] x_n)            (f32 accumulation)
//   h[r]      = round_x(round_x(silu(gate)) * up)
//   out[r]    = round_x(W_d[e] h[r])
// with the rows grouped by expert. moe.cu's combine then adds each token's
// weighted terms in increasing expert id. Nothing is read back to the host:
// the grouping is computed on the device and the GEMMs' grids are sized from
// a bound known on the host.
//
// Grouping (three kernels, deterministic; a call of one chunk, up to
// kChunkRows routed rows, finds the same positions in one block,
// `group_one_chunk_kernel`):
// * `chunk_kernel<false>`: one warp per chunk of kChunkRows consecutive
//   routed rows counts the chunk's rows per expert (the lanes of equal ids
//   found by ballots over 32 rows at a time), into chunk_counts[chunk][e];
// * `scan_kernel` (one block, a thread per expert): replaces each count by
//   the rows of that expert in the earlier chunks, sums each expert's rows,
//   scans over the experts (the expert's first grouped row, `offsets`) and
//   writes the tile table: (expert, first grouped row, rows) of every tile of
//   up to kBlockM rows of one expert, in increasing expert id, and its length;
// * `chunk_kernel<true>`: the same walk gives each routed row its grouped
//   position offsets[e] + (rows of e in earlier chunks) + (rows of e earlier
//   in its chunk), so an expert's rows are in increasing r, i.e. in token
//   order; it writes `positions[r]` and `tokens_of[position]` = n.
// Ids at or above E are skipped: such a row gets no grouped row (its
// position is kNotRouted, which the combine never reads since it skips the
// same ids) and nothing is written for it.
//
// GEMM (`gemm_kernel`, one launch per projection, in a `Shape`: the prompt
// shape's sizes below, the decode shape's at `DecodeShape`): a block of 8
// warps computes a tile of up to kBlockM (128) grouped rows of one expert by
// kBlockN (256) output columns, looked up in the tile table (blocks past its
// length exit; the grid is sized for ceil(R / kBlockM) + E tiles, a bound on
// their number). A rows are rows of x read through `tokens_of` (gate | up) or
// rows of h (down); B is the expert's weight rows ([N, K], K contiguous: the
// "col" operand of mma.row.col). kBlockK = 64 columns of K per stage (128
// contiguous bytes of each weight row), kStages stages in shared memory
// (rows padded by 16 bytes: the 8 rows an ldmatrix reads fall in 8
// different bank groups) filled with cp.async (zero bytes past the tile's
// rows, the weight's rows and K), one block per SM. The warps form 2 x 4: each
// owns 64 rows and 64 columns (4 m16 x 8 n8 mma.sync tiles, f32
// accumulators), and skips the m16 tiles past the tile's rows, so a partial
// tile (an expert's last, or every tile of a decode step) costs its weight
// reads and little more. For gate | up the block's columns are 128 gate
// columns j0 .. j0 + 127 and the matching up columns I + j0 ..; each warp
// holds 32 of each, so that the epilogue finds gate and up of an h element in
// the same thread: h = round(round(silu(round(gate))) * round(up)). The down
// projection's tile is kBlockN consecutive output columns, each rounded once.
// Builds for sm_90a run the prompt shape's tiles with Hopper's warpgroup MMAs
// instead (`wgmma_gemm_kernel`, below): the same tiles and rounding points,
// and in every case compared the same outputs bit for bit (kernels/CUDA.md).
#include "mma.cuh"
#include "tma.cuh"
#if BERRYLM_WGMMA
#include "wgmma.cuh"
#endif

namespace berrylm::moe_grouped {

using namespace berrylm::mma;

constexpr uint32_t kNotRouted = 0xffffffffu;

// ------------------------------------------------------------------ grouping

constexpr int kChunkSteps = 32;                // 32-row steps of one warp
constexpr int kChunkRows = 32 * kChunkSteps;   // routed rows per chunk
constexpr int kChunkWarps = 4;                 // chunks per block
constexpr int kScanThreads = 1024;             // one per expert
constexpr int kMaxExperts = kScanThreads;

// The lanes of the warp whose `key` (below 2^key_bits) equals this lane's:
// what __match_any_sync returns, from one ballot per bit of the key. The
// ballots are independent and cheap, where match.any took most of a
// grouping walk's time on the H200 (kernels/CUDA.md).
__device__ __forceinline__ unsigned same_key_lanes(uint32_t key, int key_bits) {
    unsigned lanes = 0xffffffffu;
    for (int bit = 0; bit < key_bits; ++bit) {
        const bool set = (key >> bit) & 1u;
        const unsigned lanes_set = __ballot_sync(0xffffffffu, set);
        lanes &= set ? lanes_set : ~lanes_set;
    }
    return lanes;
}

// Walks the routed rows of this warp's chunk in order. `seen[e]` starts as
// the grouped rows of expert e before the chunk (kScatter) or 0 (counting)
// and ends as that plus the chunk's rows of e. With kScatter each row's
// grouped position and the token of that position are written.
template <bool kScatter>
__global__ void __launch_bounds__(kChunkWarps * 32)
    chunk_kernel(const uint32_t* __restrict__ ids, int routed, int top_k, int experts,
                 int chunks, uint32_t* __restrict__ chunk_counts,
                 const uint32_t* __restrict__ offsets, uint32_t* __restrict__ positions,
                 uint32_t* __restrict__ tokens_of) {
    extern __shared__ uint32_t seen_all[];  // [kChunkWarps][experts]
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int chunk = blockIdx.x * kChunkWarps + warp;
    if (chunk >= chunks) return;  // the whole warp; no block-wide barrier follows
    uint32_t* seen = seen_all + warp * experts;
    uint32_t* counts = chunk_counts + static_cast<long long>(chunk) * experts;
    for (int e = lane; e < experts; e += 32) seen[e] = kScatter ? counts[e] + offsets[e] : 0u;
    const long long first = static_cast<long long>(chunk) * kChunkRows;
    uint32_t chunk_ids[kChunkSteps];
#pragma unroll
    for (int step = 0; step < kChunkSteps; ++step) {
        const long long r = first + step * 32 + lane;
        chunk_ids[step] = r < routed ? ids[r] : kNotRouted;
    }
    __syncwarp();
    const unsigned earlier_lanes = (1u << lane) - 1u;
    // Keys 0 .. experts: an expert's id, or `experts` for a row routed to none.
    const int key_bits = 32 - __clz(experts);
#pragma unroll
    for (int step = 0; step < kChunkSteps; ++step) {
        const uint32_t id = chunk_ids[step];
        const bool valid = id < static_cast<uint32_t>(experts);
        const unsigned peers =
            same_key_lanes(valid ? id : static_cast<uint32_t>(experts), key_bits);
        const uint32_t rank = __popc(peers & earlier_lanes);
        const uint32_t base = valid ? seen[id] : 0u;
        __syncwarp();
        if (valid && rank == 0) seen[id] = base + __popc(peers);
        __syncwarp();
        if constexpr (kScatter) {
            const long long r = first + step * 32 + lane;
            if (r < routed) positions[r] = valid ? base + rank : kNotRouted;
            if (valid) tokens_of[base + rank] = static_cast<uint32_t>(r / top_k);
        }
    }
    if constexpr (!kScatter) {
        for (int e = lane; e < experts; e += 32) counts[e] = seen[e];
    }
}

// Exclusive prefix sum of `value` over the threads of the block (in thread
// order); `total` receives the sum of all. All threads call it.
__device__ uint32_t block_exclusive_scan(uint32_t value, uint32_t& total) {
    __shared__ uint32_t warp_sums[kScanThreads / 32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    uint32_t inclusive = value;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const uint32_t other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    uint32_t before = 0;
    total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
        if (w < warp) before += warp_sums[w];
        total += warp_sums[w];
    }
    __syncthreads();  // warp_sums is reused by the next call
    return before + inclusive - value;
}

// Thread e of a block of kScanThreads, with the `rows` of expert e (0 for e
// >= experts): writes the expert's first grouped row (`offsets`) and its tiles
// of up to `tile_rows` rows, and the tile count; returns the first grouped
// row. All threads call it.
__device__ uint32_t write_tile_table(uint32_t rows, int experts, int tile_rows,
                                     uint32_t* __restrict__ offsets, uint4* __restrict__ tiles,
                                     uint32_t* __restrict__ tile_count) {
    const int e = threadIdx.x;
    const uint32_t expert_tiles = (rows + tile_rows - 1) / tile_rows;
    uint32_t all_rows;
    uint32_t all_tiles;
    const uint32_t first_row = block_exclusive_scan(rows, all_rows);
    const uint32_t first_tile = block_exclusive_scan(expert_tiles, all_tiles);
    if (e < experts) {
        offsets[e] = first_row;
        for (uint32_t t = 0; t < expert_tiles; ++t) {
            const uint32_t start = t * tile_rows;
            tiles[first_tile + t] =
                make_uint4(static_cast<uint32_t>(e), first_row + start,
                           min(static_cast<uint32_t>(tile_rows), rows - start), 0u);
        }
    }
    if (e == 0) *tile_count = all_tiles;
    return first_row;
}

// Thread e: the chunk counts of expert e turned into its rows before each
// chunk, the expert's first grouped row and its tiles of up to `tile_rows`.
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(uint32_t* __restrict__ chunk_counts, int chunks, int experts, int tile_rows,
                uint32_t* __restrict__ offsets, uint4* __restrict__ tiles,
                uint32_t* __restrict__ tile_count) {
    const int e = threadIdx.x;
    uint32_t rows = 0;
    if (e < experts) {
        uint32_t* counts = chunk_counts + e;
        int c = 0;
        for (; c + 4 <= chunks; c += 4) {
            uint32_t four[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) four[i] = counts[static_cast<long long>(c + i) * experts];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                counts[static_cast<long long>(c + i) * experts] = rows;
                rows += four[i];
            }
        }
        for (; c < chunks; ++c) {
            const uint32_t count = counts[static_cast<long long>(c) * experts];
            counts[static_cast<long long>(c) * experts] = rows;
            rows += count;
        }
    }
    write_tile_table(rows, experts, tile_rows, offsets, tiles, tile_count);
}

// The whole grouping of a call of one chunk (decode batches, short prompts;
// up to kOneChunkMaxExperts experts) in one block of kScanThreads, a thread
// per routed row: each warp finds the equal ids among its 32 rows, the
// per-warp counts are scanned over the warps for each expert, every thread
// writes its expert's offset and tiles, and every row its grouped position.
// The positions are those of the walks above (an expert's rows in
// increasing r), from one launch instead of three.
constexpr int kOneChunkMaxExperts = 256;
constexpr int kWarps = kScanThreads / 32;
static_assert(kChunkRows == kScanThreads, "a thread per routed row of the chunk");

__global__ void __launch_bounds__(kScanThreads)
    group_one_chunk_kernel(const uint32_t* __restrict__ ids, int routed, int top_k, int experts,
                           int tile_rows, uint32_t* __restrict__ offsets,
                           uint4* __restrict__ tiles, uint32_t* __restrict__ tile_count,
                           uint32_t* __restrict__ positions, uint32_t* __restrict__ tokens_of) {
    // The rows of expert e in warp w, then in the warps before w.
    __shared__ uint32_t warp_rows[kWarps][kOneChunkMaxExperts];
    __shared__ uint32_t first_rows[kOneChunkMaxExperts];
    const int t = threadIdx.x;
    const int lane = t % 32;
    const int warp = t / 32;
    for (int i = t; i < kWarps * experts; i += kScanThreads) warp_rows[i / experts][i % experts] = 0u;
    const uint32_t id = t < routed ? ids[t] : kNotRouted;
    const bool valid = id < static_cast<uint32_t>(experts);
    const unsigned peers =
        same_key_lanes(valid ? id : static_cast<uint32_t>(experts), 32 - __clz(experts));
    const uint32_t rank = __popc(peers & ((1u << lane) - 1u));
    __syncthreads();
    if (valid && rank == 0) warp_rows[warp][id] = __popc(peers);
    __syncthreads();
    uint32_t rows = 0;
    if (t < experts) {
        for (int w = 0; w < kWarps; ++w) {
            const uint32_t in_warp = warp_rows[w][t];
            warp_rows[w][t] = rows;
            rows += in_warp;
        }
    }
    const uint32_t first_row = write_tile_table(rows, experts, tile_rows, offsets, tiles, tile_count);
    if (t < experts) first_rows[t] = first_row;
    __syncthreads();
    if (t < routed) {
        const uint32_t position = valid ? first_rows[id] + warp_rows[warp][id] + rank : kNotRouted;
        positions[t] = position;
        if (valid) tokens_of[position] = static_cast<uint32_t>(t / top_k);
    }
}

// ---------------------------------------------------------------------- GEMM

// The shape of a GEMM launch: BlockM grouped rows (of one expert) by BlockN
// output columns a block, BlockK of K a stage, Stages stages in shared
// memory, WarpsM x WarpsN warps (each WarpM rows by WarpN columns), and the
// blocks an SM should hold.
template <int BlockM, int BlockN, int BlockK, int Stages, int WarpsM, int WarpsN, int BlocksPerSm>
struct Shape {
    static constexpr int kBlockM = BlockM;
    static constexpr int kBlockN = BlockN;
    static constexpr int kBlockK = BlockK;
    static constexpr int kStages = Stages;
    static constexpr int kWarpsN = WarpsN;
    static constexpr int kBlocksPerSm = BlocksPerSm;
    static constexpr int kThreads = WarpsM * WarpsN * 32;
    static constexpr int kPad = 8;  // elements of padding per shared-memory row
    static constexpr int kStride = BlockK + kPad;
    static constexpr int kWarpM = BlockM / WarpsM;
    static constexpr int kWarpN = BlockN / WarpsN;
    static constexpr int kTilesM = kWarpM / 16;  // m16 tiles per warp
    static constexpr int kTilesN = kWarpN / 8;   // n8 tiles per warp
    static constexpr int kChunksPerRow = BlockK / 8;  // 16-byte chunks per row and stage
    static constexpr int kLoadsA = BlockM * kChunksPerRow / kThreads;
    static constexpr int kLoadsB = BlockN * kChunksPerRow / kThreads;
    static_assert(kLoadsA * kThreads == BlockM * kChunksPerRow, "A chunks per thread");
    static_assert(kLoadsB * kThreads == BlockN * kChunksPerRow, "B chunks per thread");
    static_assert(kTilesM >= 1 && kWarpM % 16 == 0, "whole m16 tiles per warp");
    static_assert(kTilesN % 4 == 0, "pairs of n8 tiles in each half of a warp's columns");

    template <typename T> static constexpr int smem_bytes() {
        return Stages * (BlockM + BlockN) * kStride * static_cast<int>(sizeof(T));
    }

    // With the weights brought by the TMA: B stages first, unpadded, as
    // blocks of 64 columns with the 128-byte swizzle (1024-aligned), then
    // the padded A stages.
    static constexpr int kSwizzledBStageBytes = BlockN * BlockK * 2;
    template <typename T> static constexpr int tma_smem_bytes() {
        return Stages * (kSwizzledBStageBytes + BlockM * kStride * static_cast<int>(sizeof(T))) +
               1024;
    }

    // The shared-memory row of B (0 .. BlockN) whose n8 tile `nb` of the warp
    // in column `warp_n` starts there: the first kTilesN / 2 tiles in the
    // first half of the block's rows (gate rows, for gate | up), the others
    // at the same place of the second half (up rows).
    __device__ static __forceinline__ int b_row(int warp_n, int nb) {
        constexpr int kHalf = kTilesN / 2;
        return (nb / kHalf) * (BlockN / 2) + warp_n * (kWarpN / 2) + (nb % kHalf) * 8;
    }
};

// Prompts: 128 x 256 tiles, K stages of 64 (128 contiguous bytes of each
// weight row), one block of 8 warps per SM.
using PromptShape = Shape<128, 256, 64, 4, 2, 4, 1>;

struct GemmParams {
    const void* a;              // x [tokens, k] (through a_rows) or h [R, k]
    const uint32_t* a_rows;     // grouped row -> row of a; nullptr: the grouped row
    const void* w;              // [E, weight_rows, k]
    void* out;                  // [R, n_out]
    const uint4* tiles;
    const uint32_t* tile_count;
    int k;
    int n_out;                  // h columns (I) or output columns (H)
    int n_blocks;               // blocks per tile along the columns (set by the launcher)
    int experts;                // E
    int a_height;               // rows of a
};

// The sources of this thread's 16-byte chunks of a stage, rows `load_row + i
// row_step` of the tile at column `load_col` (advanced by the stage's K
// offset): A rows are rows of x through `a_rows` (gate | up) or of h (down);
// B rows are the expert's weight rows of the block's columns (down: output
// columns n0 ..; gate | up: gate rows j0 .. then the up rows I + j0 ..).
// Rows past the tile's rows and columns past n_out get nullptr (their chunks
// are zero-filled). Returns the expert's weights.
template <typename T, int LoadsA, int RowStep>
__device__ __forceinline__ void a_chunk_sources(const GemmParams& p, int first, int rows,
                                                int load_row, int load_col,
                                                const T* (&a_src)[LoadsA]) {
    const T* a = static_cast<const T*>(p.a);
#pragma unroll
    for (int i = 0; i < LoadsA; ++i) {
        const int row = load_row + i * RowStep;
        if (row < rows) {
            const long long grouped = first + row;
            const long long source = p.a_rows != nullptr ? p.a_rows[grouped] : grouped;
            a_src[i] = a + source * p.k + load_col;
        } else {
            a_src[i] = nullptr;
        }
    }
}

template <typename T, bool kGated, int BlockN, int LoadsA, int LoadsB, int RowStep>
__device__ __forceinline__ const T* chunk_sources(const GemmParams& p, int expert, int first,
                                                  int rows, int n_block, int load_row,
                                                  int load_col, const T* (&a_src)[LoadsA],
                                                  const T* (&b_src)[LoadsB]) {
    const int k = p.k;
    a_chunk_sources<T, LoadsA, RowStep>(p, first, rows, load_row, load_col, a_src);
    const int weight_rows = kGated ? 2 * p.n_out : p.n_out;
    const T* w = static_cast<const T*>(p.w) + static_cast<long long>(expert) * weight_rows * k;
#pragma unroll
    for (int i = 0; i < LoadsB; ++i) {
        const int row = load_row + i * RowStep;
        int column;
        int weight_row;
        if constexpr (kGated) {
            const int half = row / (BlockN / 2);
            column = n_block * (BlockN / 2) + row % (BlockN / 2);
            weight_row = half * p.n_out + column;
        } else {
            column = n_block * BlockN + row;
            weight_row = column;
        }
        b_src[i] = column < p.n_out ? w + static_cast<long long>(weight_row) * k + load_col
                                    : nullptr;
    }
    return w;
}

template <typename T, bool kGated, typename S, bool kTmaWeights>
__global__ void __launch_bounds__(S::kThreads, S::kBlocksPerSm)
    gemm_kernel(const GemmParams p, const __grid_constant__ CUtensorMap w_map) {
    constexpr int kBlockM = S::kBlockM, kBlockN = S::kBlockN, kBlockK = S::kBlockK;
    constexpr int kStages = S::kStages, kThreads = S::kThreads, kStride = S::kStride;
    constexpr int kWarpM = S::kWarpM, kTilesM = S::kTilesM, kTilesN = S::kTilesN;
    constexpr int kChunksPerRow = S::kChunksPerRow, kLoadsA = S::kLoadsA, kLoadsB = S::kLoadsB;
    const int tile_index = blockIdx.x / p.n_blocks;
    const int n_block = blockIdx.x % p.n_blocks;
    if (tile_index >= static_cast<int>(*p.tile_count)) return;
    const uint4 tile = p.tiles[tile_index];
    const int expert = static_cast<int>(tile.x);
    const int first = static_cast<int>(tile.y);
    const int rows = static_cast<int>(tile.z);

    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ alignas(8) uint64_t weights_landed[kStages];
    // kTmaWeights: the swizzled B stages at the first 1024-aligned byte,
    // then the A stages; else A then B, both padded.
    unsigned char* swizzled_b = smem + ((1024 - smem_address(smem) % 1024) % 1024);
    T* s_a = kTmaWeights
                 ? reinterpret_cast<T*>(swizzled_b + kStages * S::kSwizzledBStageBytes)
                 : reinterpret_cast<T*>(smem);
    T* s_b = s_a + kStages * kBlockM * kStride;
    const int warp = threadIdx.x / 32;
    const int warp_m = warp / S::kWarpsN;
    const int warp_n = warp % S::kWarpsN;
    const int lane = threadIdx.x % 32;
    const int group = lane / 4;
    const int quad = lane % 4;
    const int k = p.k;
    // The m16 tiles of this warp that hold rows of the tile: a partial tile
    // skips the products of the rows it does not have.
    const int warp_row = warp_m * kWarpM;
    const int m_tiles = max(0, min(kTilesM, (rows - warp_row + 15) / 16));

    // This thread's 16-byte chunks of a stage: rows threadIdx.x / kChunksPerRow
    // + i * (kThreads / kChunksPerRow), column chunk threadIdx.x % kChunksPerRow.
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int load_row = threadIdx.x / kChunksPerRow;
    const int load_col = (threadIdx.x % kChunksPerRow) * 8;
    const T* a = static_cast<const T*>(p.a);
    const T* a_src[kLoadsA];
    const T* b_src[kLoadsB];
    const T* w = chunk_sources<T, kGated, kBlockN, kLoadsA, kLoadsB, kRowStep>(
        p, expert, first, rows, n_block, load_row, load_col, a_src, b_src);
    // kTmaWeights: the map row of the block's weight rows (gate | up: the
    // gate rows, then the up rows, of its columns).
    const int expert_row = expert * (kGated ? 2 * p.n_out : p.n_out);
    const auto box_row = [&](int half) {
        return kGated ? expert_row + half * p.n_out + n_block * (kBlockN / 2)
                      : expert_row + n_block * kBlockN;
    };

    const int k_tiles = (k + kBlockK - 1) / kBlockK;
    auto load_stage = [&](int stage, int k_tile) {
        const int k0 = k_tile * kBlockK;
        const bool k_valid = k0 + load_col < k;
        T* dst_a = s_a + stage * kBlockM * kStride;
#pragma unroll
        for (int i = 0; i < kLoadsA; ++i) {
            const bool valid = k_valid && a_src[i] != nullptr;
            cp_async_16(dst_a + (load_row + i * kRowStep) * kStride + load_col,
                        valid ? a_src[i] + k0 : a, valid ? 16 : 0);
        }
        if constexpr (kTmaWeights) {
            if (threadIdx.x == 0) {
                // The products that read this buffer (ldmatrix, the generic
                // proxy) are ordered before the TMA's writes.
                tma::fence_async_shared();
                unsigned char* dst_b = swizzled_b + stage * S::kSwizzledBStageBytes;
                tma::barrier_expect_bytes(&weights_landed[stage], S::kSwizzledBStageBytes);
                constexpr int kHalves = kGated ? 2 : 1;
                constexpr int kBoxRows = kBlockN / kHalves;
#pragma unroll
                for (int block = 0; block < kBlockK / 64; ++block) {
#pragma unroll
                    for (int half = 0; half < kHalves; ++half) {
                        tma::load_2d(dst_b + (block * kBlockN + half * kBoxRows) * 128, &w_map,
                                     &weights_landed[stage], k0 + 64 * block, box_row(half));
                    }
                }
            }
        } else {
            T* dst_b = s_b + stage * kBlockN * kStride;
#pragma unroll
            for (int i = 0; i < kLoadsB; ++i) {
                const bool valid = k_valid && b_src[i] != nullptr;
                cp_async_16(dst_b + (load_row + i * kRowStep) * kStride + load_col,
                            valid ? b_src[i] + k0 : w, valid ? 16 : 0);
            }
        }
    };

    if constexpr (kTmaWeights) {
        if (threadIdx.x == 0) {
#pragma unroll
            for (int s = 0; s < kStages; ++s) tma::barrier_init(&weights_landed[s], 1);
            tma::barrier_init_fence();
        }
        __syncthreads();  // the mbarriers initialised
    }
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < k_tiles) load_stage(s, s);
        cp_async_commit();
    }

    float acc[kTilesM][kTilesN][4] = {};
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<kStages - 2>();  // stage kt has landed (this thread's copies)
        if constexpr (kTmaWeights) {
            tma::barrier_wait(&weights_landed[kt % kStages], (kt / kStages) & 1);
        }
        __syncthreads();  // everyone's; and stage kt - 1 is free
        const int next = kt + kStages - 1;
        if (next < k_tiles) load_stage(next % kStages, next);
        cp_async_commit();
        if (m_tiles == 0) continue;

        const T* tile_a = s_a + ((kt % kStages) * kBlockM + warp_row) * kStride;
        const T* tile_b = s_b + (kt % kStages) * kBlockN * kStride;
        const unsigned char* swizzled_tile_b =
            swizzled_b + (kt % kStages) * S::kSwizzledBStageBytes;
        // Row `row`, column `column` (a multiple of 8) of this stage's B.
        const auto b_address = [&](int row, int column) -> const void* {
            if constexpr (kTmaWeights) {
                return swizzled_tile_b + (column / 64) * kBlockN * 128 +
                       tma::swizzled_offset(row, (column % 64) / 8);
            } else {
                return tile_b + row * kStride + column;
            }
        };
        // The A fragments of step kk + 1 load while the products of step kk
        // run (the asm statements keep their order).
        unsigned frag_a[2][kTilesM][4];
        auto load_a = [&](unsigned (&frag)[kTilesM][4], int kk) {
#pragma unroll
            for (int mi = 0; mi < kTilesM; ++mi) {
                if (mi < m_tiles) {
                    ldmatrix_x4(frag[mi], tile_a + (mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) *
                                                       kStride +
                                              kk * 16 + (lane >> 4) * 8);
                }
            }
        };
        load_a(frag_a[0], 0);
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
            unsigned frag_b[kTilesN / 2][4];
#pragma unroll
            for (int pair = 0; pair < kTilesN / 2; ++pair) {
                ldmatrix_x4(frag_b[pair],
                            b_address(S::b_row(warp_n, 2 * pair) + (lane & 7) + (lane >> 4) * 8,
                                      kk * 16 + ((lane >> 3) & 1) * 8));
            }
            if (kk + 1 < kBlockK / 16) load_a(frag_a[(kk + 1) % 2], kk + 1);
#pragma unroll
            for (int pair = 0; pair < kTilesN / 2; ++pair) {
#pragma unroll
                for (int mi = 0; mi < kTilesM; ++mi) {
                    if (mi < m_tiles) {
                        mma_16816<T>(acc[mi][2 * pair], frag_a[kk % 2][mi], frag_b[pair][0],
                                     frag_b[pair][1]);
                        mma_16816<T>(acc[mi][2 * pair + 1], frag_a[kk % 2][mi], frag_b[pair][2],
                                     frag_b[pair][3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    // Epilogue: element 2 r + i of a C fragment is row group + 8 r, column
    // 2 quad + i of its tile; each pair is stored as one 32-bit word.
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int mi = 0; mi < kTilesM; ++mi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row + mi * 16 + group + 8 * r;
            if (row >= rows) continue;
            T* out_row = out + static_cast<long long>(first + row) * p.n_out;
            if constexpr (kGated) {
#pragma unroll
                for (int nb = 0; nb < kTilesN / 2; ++nb) {
                    const int column = n_block * (kBlockN / 2) + S::b_row(warp_n, nb) + quad * 2;
                    if (column >= p.n_out) continue;
                    float h[2];
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        const float gate = round_to<T>(acc[mi][nb][2 * r + i]);
                        const float up = round_to<T>(acc[mi][nb + kTilesN / 2][2 * r + i]);
                        h[i] = __fmul_rn(round_to<T>(silu(gate)), up);
                    }
                    *reinterpret_cast<unsigned*>(out_row + column) = pack2<T>(h[0], h[1]);
                }
            } else {
#pragma unroll
                for (int nb = 0; nb < kTilesN; ++nb) {
                    const int column = n_block * kBlockN + S::b_row(warp_n, nb) + quad * 2;
                    if (column >= p.n_out) continue;
                    *reinterpret_cast<unsigned*>(out_row + column) =
                        pack2<T>(acc[mi][nb][2 * r], acc[mi][nb][2 * r + 1]);
                }
            }
        }
    }
}

// Blocks per tile along the columns of a projection in tiles of BlockN
// weight rows (gate | up: BlockN / 2 columns of h, with their up rows).
template <bool kGated, int BlockN> int column_blocks(int n_out) {
    constexpr int kColumns = kGated ? BlockN / 2 : BlockN;
    return (n_out + kColumns - 1) / kColumns;
}

// The map of `rows` rows of k elements from `base` (row-major, contiguous),
// read in boxes of `box_rows` rows x 64 columns.
template <typename T>
bool encode_rows_map(CUtensorMap* map, const void* base, long long rows, int k,
                     unsigned box_rows) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(k), static_cast<cuuint64_t>(rows)};
    const cuuint64_t byte_strides[1] = {static_cast<cuuint64_t>(k) * sizeof(T)};
    const cuuint32_t box[2] = {64, box_rows};
    return tma::encode_swizzled_map(map, base, dims, byte_strides, box);
}

// The rows of every expert's weights of a projection: [E x weight rows, k].
template <bool kGated> long long weight_map_rows(const GemmParams& p) {
    return static_cast<long long>(p.experts) * (kGated ? 2 : 1) * p.n_out;
}

// gemm_kernel in shape S; kTmaWeights: its weights by the TMA through `w_map`
// (boxes of S's weight rows of a half, 64 columns).
template <typename T, bool kGated, typename S, bool kTmaWeights = false>
int launch_gemm(GemmParams p, int max_tiles, cudaStream_t stream,
                const CUtensorMap& w_map = CUtensorMap{}) {
    p.n_blocks = column_blocks<kGated, S::kBlockN>(p.n_out);
    constexpr int smem =
        kTmaWeights ? S::template tma_smem_bytes<T>() : S::template smem_bytes<T>();
    const cudaError_t status = cudaFuncSetAttribute(
        gemm_kernel<T, kGated, S, kTmaWeights>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (status != cudaSuccess) return static_cast<int>(status);
    const long long blocks = static_cast<long long>(max_tiles) * p.n_blocks;
    gemm_kernel<T, kGated, S, kTmaWeights>
        <<<static_cast<unsigned>(blocks), S::kThreads, smem, stream>>>(p, w_map);
    return launch_status();
}

// ------------------------------------------------------------- Hopper GEMM
#if BERRYLM_WGMMA

// Prompts on sm_90a: the tiles of PromptShape (128 grouped rows of one expert)
// with warpgroup MMAs. Two warpgroups, each owning 64 of the tile's rows and
// all BlockN columns as m64n128 accumulators (gate | up: BlockN 256, the gate
// and the up half; down: runs of 128 output columns); both operands come
// from shared memory with the 128-byte swizzle (wgmma.cuh): a stage's weight
// rows by the TMA (one thread asks for BlockN / 128 boxes of 128 rows x 64
// columns of the map of all experts' weights, counted on the stage's
// mbarrier), its A rows, gate | up's gathered rows of x, by every thread's
// cp.async copies, and down's consecutive rows of h by the TMA as one more
// box (the rows past the tile's, another expert's or zeros, reach only
// accumulator rows that are never written). K runs in stages of 64 columns,
// Stages buffers of them: the copies of stage kt + Stages - 2 are issued
// while the products of stage kt run and those of kt - 1 may still be
// pending, so a stage's buffer is refilled only after every warpgroup has
// waited for the products that read it. Weight rows past an expert's columns (n_out not a multiple of 128) are
// the next rows of the map, not zeros: they only reach accumulator columns
// that are never written. The epilogue is gemm_kernel's: the same rounding
// points, each thread holding gate and up of the h elements it writes.
template <int BlockN, int Stages, int BlocksPerSm>
struct WgmmaShape {
    static constexpr int kBlockM = 128;
    static constexpr int kBlockN = BlockN;
    static constexpr int kHalves = BlockN / 128;  // m64n128 accumulators a thread
    static constexpr int kBlockK = 64;  // one 128-byte swizzled row of 16-bit elements
    static constexpr int kStages = Stages;
    static constexpr int kBlocksPerSm = BlocksPerSm;
    static constexpr int kThreads = 256;
    static constexpr int kChunksPerRow = kBlockK / 8;
    static constexpr int kLoadsA = kBlockM * kChunksPerRow / kThreads;
    static constexpr int kLoadsB = kBlockN * kChunksPerRow / kThreads;
    static constexpr int kStageBytes = (kBlockM + kBlockN) * wgmma::kRowBytes;
    static constexpr int kSmemBytes = kStages * kStageBytes + wgmma::kTileAlign;
    static_assert(kBlockM == PromptShape::kBlockM, "the prompt tile table serves both");
    static_assert(BlockN % 128 == 0 && Stages >= 3, "whole n128 products; stages two ahead");
};

// Both projections: of the shapes swept (BlockN 128 or 256, 3 to 6 stages,
// one or two blocks an SM; kernels/CUDA.md) the fastest for each.
using WgmmaPromptShape = WgmmaShape<256, 4, 1>;

template <typename T, bool kGated, typename S>
__global__ void __launch_bounds__(S::kThreads, S::kBlocksPerSm)
    wgmma_gemm_kernel(const GemmParams p, const __grid_constant__ CUtensorMap w_map,
                      const __grid_constant__ CUtensorMap a_map) {
    static_assert(!kGated || S::kHalves == 2, "gate | up: a gate and an up accumulator");
    constexpr int kBlockN = S::kBlockN, kBlockK = S::kBlockK, kStages = S::kStages;
    constexpr int kHalves = S::kHalves;
    constexpr int kRowStep = S::kThreads / S::kChunksPerRow;
    const int tile_index = blockIdx.x / p.n_blocks;
    const int n_block = blockIdx.x % p.n_blocks;
    if (tile_index >= static_cast<int>(*p.tile_count)) return;
    const uint4 tile = p.tiles[tile_index];
    const int expert = static_cast<int>(tile.x);
    const int first = static_cast<int>(tile.y);
    const int rows = static_cast<int>(tile.z);

    extern __shared__ unsigned char smem_raw[];
    __shared__ alignas(8) uint64_t stage_landed[kStages];  // a stage's TMA boxes
    const uint32_t smem_base =
        (smem_address(smem_raw) + wgmma::kTileAlign - 1) & ~uint32_t(wgmma::kTileAlign - 1);
    unsigned char* smem = smem_raw + (smem_base - smem_address(smem_raw));
    const int warpgroup = threadIdx.x / 128;
    const int k = p.k;

    const int load_row = threadIdx.x / S::kChunksPerRow;
    const int load_chunk = threadIdx.x % S::kChunksPerRow;
    const int load_col = load_chunk * 8;
    const T* a = static_cast<const T*>(p.a);
    const T* a_src[S::kLoadsA];
    if constexpr (kGated) {
        a_chunk_sources<T, S::kLoadsA, kRowStep>(p, first, rows, load_row, load_col, a_src);
    }
    // The map row of the weight box `box` (128 rows) of this block: gate |
    // up, the gate rows then the up rows of its columns; down, its columns.
    const int expert_row = expert * (kGated ? 2 * p.n_out : p.n_out);
    const auto box_row = [&](int box) {
        return kGated ? expert_row + box * p.n_out + n_block * (kBlockN / 2)
                      : expert_row + n_block * kBlockN + box * 128;
    };

    const int k_tiles = (k + kBlockK - 1) / kBlockK;
    auto load_stage = [&](int stage, int k_tile) {
        const int k0 = k_tile * kBlockK;
        const bool k_valid = k0 + load_col < k;
        unsigned char* dst_a = smem + stage * S::kStageBytes;
        unsigned char* dst_b = dst_a + S::kBlockM * wgmma::kRowBytes;
        if constexpr (kGated) {
#pragma unroll
            for (int i = 0; i < S::kLoadsA; ++i) {
                const bool valid = k_valid && a_src[i] != nullptr;
                cp_async_16(dst_a + wgmma::swizzled_offset(load_row + i * kRowStep, load_chunk),
                            valid ? a_src[i] + k0 : a, valid ? 16 : 0);
            }
        }
        if (threadIdx.x == 0) {
            constexpr int kBytes = (kGated ? kBlockN : S::kBlockM + kBlockN) * wgmma::kRowBytes;
            tma::barrier_expect_bytes(&stage_landed[stage], kBytes);
            if constexpr (!kGated) tma::load_2d(dst_a, &a_map, &stage_landed[stage], k0, first);
#pragma unroll
            for (int box = 0; box < kBlockN / 128; ++box) {
                tma::load_2d(dst_b + box * 128 * wgmma::kRowBytes, &w_map, &stage_landed[stage],
                             k0, box_row(box));
            }
        }
    };

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < kStages; ++s) tma::barrier_init(&stage_landed[s], 1);
        tma::barrier_init_fence();
    }
    __syncthreads();  // the mbarriers initialised

    // Stages load two ahead of the products (see the struct's comment).
    constexpr int kAhead = kStages - 2;
#pragma unroll
    for (int s = 0; s < kAhead; ++s) {
        if (s < k_tiles) load_stage(s, s);
        cp_async_commit();
    }
    // Whether this warpgroup's 64 rows hold any of the tile's rows.
    const bool has_rows = warpgroup * 64 < rows;
    float acc[kHalves][64];
#pragma unroll
    for (int h = 0; h < kHalves; ++h) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[h][i] = 0.0f;
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<kAhead - 1>();  // stage kt's A rows have landed (this thread's copies)
        wgmma::fence_async_shared();
        tma::barrier_wait(&stage_landed[kt % kStages], (kt / kStages) & 1);
        __syncthreads();  // everyone's copies; every product of stage kt - 2 is done
        const int next = kt + kAhead;
        if (next < k_tiles) load_stage(next % kStages, next);
        cp_async_commit();
        if (!has_rows) continue;
        const uint32_t stage_a = smem_base + (kt % kStages) * S::kStageBytes;
        const uint32_t rows_a = stage_a + warpgroup * 64 * wgmma::kRowBytes;
        const uint32_t rows_b = stage_a + S::kBlockM * wgmma::kRowBytes;
        wgmma::fence_registers(acc);
        wgmma::fence_operands();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
            const uint64_t desc_a = wgmma::descriptor(rows_a + kk * 32);
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
                const uint64_t desc_b =
                    wgmma::descriptor(rows_b + h * 128 * wgmma::kRowBytes + kk * 32);
                wgmma::mma_m64n128k16<T>(acc[h], desc_a, desc_b);
            }
        }
        wgmma::commit_group();
        wgmma::wait_group<1>();
        wgmma::fence_registers(acc);
    }
    wgmma::wait_group<0>();
    wgmma::fence_registers(acc);
    cp_async_wait<0>();
    if (!has_rows) return;

    // Element i of a half's fragment: row 16 warp + group + 8 ((i / 2) % 2),
    // column 8 (i / 4) + 2 quad + i % 2 of the half (wgmma.cuh).
    const int lane = threadIdx.x % 32;
    const int warp_row = warpgroup * 64 + (threadIdx.x / 32 % 4) * 16 + lane / 4;
    const int quad = lane % 4;
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = warp_row + 8 * r;
        if (row >= rows) continue;
        T* out_row = out + static_cast<long long>(first + row) * p.n_out;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int i = 4 * j + 2 * r;
            if constexpr (kGated) {
                const int column = n_block * (kBlockN / 2) + 8 * j + 2 * quad;
                if (column >= p.n_out) continue;
                float h[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float gate = round_to<T>(acc[0][i + e]);
                    const float up = round_to<T>(acc[1][i + e]);
                    h[e] = __fmul_rn(round_to<T>(silu(gate)), up);
                }
                *reinterpret_cast<unsigned*>(out_row + column) = pack2<T>(h[0], h[1]);
            } else {
#pragma unroll
                for (int half = 0; half < kHalves; ++half) {
                    const int column = n_block * kBlockN + half * 128 + 8 * j + 2 * quad;
                    if (column >= p.n_out) continue;
                    *reinterpret_cast<unsigned*>(out_row + column) =
                        pack2<T>(acc[half][i], acc[half][i + 1]);
                }
            }
        }
    }
}

// The warpgroup GEMM, or gemm_kernel in the prompt shape where the driver
// makes no tensor map of the weights ([E x weight rows, k]) or, for down, of
// h (whose rows it reads in order: a_rows null).
template <typename T, bool kGated, typename S>
int launch_wgmma_gemm(GemmParams p, int max_tiles, cudaStream_t stream) {
    static_assert(S::kBlockK == 64 && S::kBlockM == 128, "the maps' boxes");
    CUtensorMap w_map;
    CUtensorMap a_map{};  // gate | up gathers its rows with cp.async
    if (!encode_rows_map<T>(&w_map, p.w, weight_map_rows<kGated>(p), p.k, 128) ||
        (!kGated &&
         (p.a_rows != nullptr || !encode_rows_map<T>(&a_map, p.a, p.a_height, p.k, 128)))) {
        return launch_gemm<T, kGated, PromptShape>(p, max_tiles, stream);
    }
    p.n_blocks = column_blocks<kGated, S::kBlockN>(p.n_out);
    constexpr int smem = S::kSmemBytes;
    const cudaError_t status = cudaFuncSetAttribute(
        wgmma_gemm_kernel<T, kGated, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (status != cudaSuccess) return static_cast<int>(status);
    const long long blocks = static_cast<long long>(max_tiles) * p.n_blocks;
    wgmma_gemm_kernel<T, kGated, S>
        <<<static_cast<unsigned>(blocks), S::kThreads, smem, stream>>>(p, w_map, a_map);
    return launch_status();
}
#endif  // BERRYLM_WGMMA

// The GEMM of a call in shape S: builds for sm_90a run the prompt shape's
// tiles with warpgroup MMAs (1.5x mma.sync's rate at 4096 tokens of
// BerryLM-OS, the same results bit for bit: kernels/CUDA.md) and the other
// shapes with their weights brought by the TMA, where the driver maps them.
template <typename T, bool kGated, typename S>
int launch_projection(const GemmParams& p, int max_tiles, cudaStream_t stream) {
#if BERRYLM_WGMMA
    if constexpr (std::is_same_v<S, PromptShape>) {
        return launch_wgmma_gemm<T, kGated, WgmmaPromptShape>(p, max_tiles, stream);
    } else {
        static_assert(S::kBlockK % 64 == 0, "whole 64-column boxes a stage");
        CUtensorMap w_map;
        if (encode_rows_map<T>(&w_map, p.w, weight_map_rows<kGated>(p), p.k,
                               kGated ? S::kBlockN / 2 : S::kBlockN)) {
            return launch_gemm<T, kGated, S, true>(p, max_tiles, stream, w_map);
        }
        return launch_gemm<T, kGated, S>(p, max_tiles, stream);
    }
#else
    return launch_gemm<T, kGated, S>(p, max_tiles, stream);
#endif
}

// ------------------------------------------------------------------- launcher

inline int chunk_count(int routed) { return (routed + kChunkRows - 1) / kChunkRows; }

// Decode batches (up to kDecodeRoutedRows routed rows: a few rows an expert,
// so a tile's weight reads are its cost): 32 x 128 tiles, K stages of 128
// (256 contiguous bytes of each weight row), two blocks of 8 warps per SM,
// so that one block's loads run while the other waits or writes. At 64 /
// 128 / 256 tokens of BerryLM-OS this reads the weights at 3.72 / 3.64 /
// 3.24 TB/s against the prompt shape's 3.22 / 3.16 / 2.85 (the H200 reads
// 4.35 TB/s; kernels/CUDA.md), with the same results bit for bit: a
// thread's products are summed in the same order whatever the tile.
using DecodeShape = Shape<32, 128, 128, 2, 2, 4, 2>;
constexpr int kDecodeRoutedRows = 2048;

// Whether a call of `routed` rows runs in DecodeShape (else PromptShape).
inline bool decode_sized(long long routed) { return routed <= kDecodeRoutedRows; }

// ceil(R / M) + E for shape S's tiles of M rows: at least sum_e ceil(rows_e / M).
template <typename S> int tile_bound(int routed, int experts) {
    return (routed + S::kBlockM - 1) / S::kBlockM + experts;
}

// The tile bound of the shape a call of `routed` rows runs in.
inline int max_tile_count(int routed, int experts) {
    return decode_sized(routed) ? tile_bound<DecodeShape>(routed, experts)
                                : tile_bound<PromptShape>(routed, experts);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

struct Buffers {
    const void* x;
    const uint32_t* ids;
    const void* gate_up;
    const void* down;
    uint32_t* chunk_counts;
    uint32_t* offsets;
    uint4* tiles;
    uint32_t* tile_count;
    uint32_t* positions;
    uint32_t* tokens_of;
    void* h;
    void* expert_out;
};

// The grouping with tiles of S::kBlockM rows, then the two GEMMs in shape S.
template <typename T, typename S>
int launch_shaped(const Buffers& b, int tokens, int top_k, int experts, int hidden, int inter,
                  cudaStream_t stream) {
    constexpr int kBlockM = S::kBlockM;
    const int routed = tokens * top_k;
    const int chunks = chunk_count(routed);
    if (chunks == 1 && experts <= kOneChunkMaxExperts) {
        group_one_chunk_kernel<<<1, kScanThreads, 0, stream>>>(
            b.ids, routed, top_k, experts, kBlockM, b.offsets, b.tiles, b.tile_count, b.positions,
            b.tokens_of);
    } else {
        const unsigned chunk_blocks =
            static_cast<unsigned>((chunks + kChunkWarps - 1) / kChunkWarps);
        const size_t chunk_smem = static_cast<size_t>(kChunkWarps) * experts * sizeof(uint32_t);
        chunk_kernel<false><<<chunk_blocks, kChunkWarps * 32, chunk_smem, stream>>>(
            b.ids, routed, top_k, experts, chunks, b.chunk_counts, nullptr, nullptr, nullptr);
        scan_kernel<<<1, kScanThreads, 0, stream>>>(b.chunk_counts, chunks, experts, kBlockM,
                                                    b.offsets, b.tiles, b.tile_count);
        chunk_kernel<true><<<chunk_blocks, kChunkWarps * 32, chunk_smem, stream>>>(
            b.ids, routed, top_k, experts, chunks, b.chunk_counts, b.offsets, b.positions,
            b.tokens_of);
    }
    int status = launch_status();
    if (status != 0) return status;

    const int max_tiles = tile_bound<S>(routed, experts);
    const GemmParams gate_up{b.x, b.tokens_of, b.gate_up, b.h, b.tiles, b.tile_count,
                             hidden, inter, 0, experts, tokens};
    status = launch_projection<T, true, S>(gate_up, max_tiles, stream);
    if (status != 0) return status;
    const GemmParams down{b.h, nullptr, b.down, b.expert_out, b.tiles, b.tile_count,
                          inter, hidden, 0, experts, routed};
    return launch_projection<T, false, S>(down, max_tiles, stream);
}

template <typename T>
int launch(const Buffers& b, int tokens, int top_k, int experts, int hidden, int inter,
           cudaStream_t stream) {
    return decode_sized(static_cast<long long>(tokens) * top_k)
               ? launch_shaped<T, DecodeShape>(b, tokens, top_k, experts, hidden, inter, stream)
               : launch_shaped<T, PromptShape>(b, tokens, top_k, experts, hidden, inter, stream);
}

}  // namespace berrylm::moe_grouped

using namespace berrylm::moe_grouped;

// The sizes of a call (`MoeSizes` in src/cuda/moe.rs): R = tokens * top_k
// routed rows, E experts, hidden H and expert width I.
struct MoeSizes {
    int tokens;
    int top_k;
    int experts;
    int hidden;
    int inter;
};

// The u32 scratch lengths of `berrylm_moe_grouped_experts` for `routed`
// rows (tokens x top_k) and `experts`: chunk counts, tile table (4 words a
// tile).
extern "C" void berrylm_moe_grouped_scratch(int routed, int experts, long long* chunk_counts,
                                            long long* tiles) {
    *chunk_counts = static_cast<long long>(chunk_count(routed)) * experts;
    *tiles = 4ll * max_tile_count(routed, experts);
}

// The largest number of experts `berrylm_moe_grouped_experts` takes.
extern "C" int berrylm_moe_grouped_max_experts() { return kMaxExperts; }

// bf16/f16 only. Writes h ([R, inter]) and expert_out ([R, hidden]) in
// expert-grouped order, R = tokens * top_k, and positions[r] (u32 [R]): the
// grouped row of routed row r (kNotRouted for an id at or above `experts`),
// the `rows` of berrylm_moe_combine. The other u32 buffers are scratch
// (lengths from berrylm_moe_grouped_scratch; offsets [experts], tile_count
// [1], tokens_of [R]). Needs hidden and inter multiples of 8 and x, gate_up,
// down, h and expert_out 16-byte aligned (cp.async copies 16 bytes).
extern "C" int berrylm_moe_grouped_experts(int dtype, const void* x, const uint32_t* ids,
                                           const void* gate_up, const void* down,
                                           uint32_t* chunk_counts, uint32_t* offsets,
                                           uint32_t* tiles, uint32_t* tile_count,
                                           uint32_t* positions, uint32_t* tokens_of, void* h,
                                           void* expert_out, MoeSizes sizes, void* stream) {
    const int tokens = sizes.tokens;
    const int top_k = sizes.top_k;
    const int experts = sizes.experts;
    const int hidden = sizes.hidden;
    const int inter = sizes.inter;
    if (tokens == 0) return 0;
    if (top_k <= 0 || experts <= 0 || experts > kMaxExperts || hidden <= 0 || inter <= 0 ||
        hidden % 8 != 0 || inter % 8 != 0 ||
        static_cast<long long>(tokens) * top_k > 0x7fffffffll) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    if (!aligned16(x) || !aligned16(gate_up) || !aligned16(down) || !aligned16(h) ||
        !aligned16(expert_out)) {
        return static_cast<int>(cudaErrorMisalignedAddress);
    }
    const Buffers buffers{x,         ids,        gate_up,   down,      chunk_counts,
                          offsets,   reinterpret_cast<uint4*>(tiles), tile_count,
                          positions, tokens_of,  h,         expert_out};
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (dtype) {
        case berrylm::kBF16:
            return launch<__nv_bfloat16>(buffers, tokens, top_k, experts, hidden, inter, s);
        case berrylm::kF16:
            return launch<__half>(buffers, tokens, top_k, experts, hidden, inter, s);
        default:
            return static_cast<int>(cudaErrorInvalidValue);
    }
}
