// PTX helpers of Hopper's warpgroup MMA (`wgmma`, sm_90a) for kernels whose
// operands are in shared memory: the layout and descriptor of a K-major tile
// of 64 16-bit elements a row stored with the 128-byte swizzle, the fences and
// groups that order the asynchronous products, and the m64n128k16 and m64n64k16
// products with f32 accumulators for bf16 and f16 operands.
//
// A warpgroup is four consecutive warps (128 threads, the first warp's index a
// multiple of 4); every instruction here is executed by all of its threads
// together. The accumulator fragment of m64n128k16, d[0..63] of each thread,
// has for warp w of the warpgroup, lane l and n8 block j = i / 4:
//   row    16 w + l / 4 + 8 ((i / 2) % 2)
//   column 8 j + 2 (l % 4) + i % 2
// (mma.sync's m16n8 C fragment, once per n8 block).
#pragma once

#include <type_traits>

#include "common.cuh"
#include "tma.cuh"

namespace berrylm::wgmma {

// Bytes of one row of a swizzled tile: 64 16-bit elements.
constexpr int kRowBytes = tma::kSwizzledRowBytes;
// A swizzled tile starts on this alignment (8 rows: the swizzle's period).
constexpr int kTileAlign = 1024;

using tma::swizzled_offset;

// The shared-memory matrix descriptor of the K-major, 128-byte-swizzled tile
// whose first row (at the product's first K column) is at shared-memory
// address `address`: start address (bits 0-13, in 16-byte units), leading
// byte offset 16 (unused by swizzled K-major tiles), stride byte offset 1024
// (from one group of 8 rows to the next), layout "128-byte swizzle" (bits
// 62-63 = 1). The tile must start on kTileAlign; the K column step of a
// product moves `address` by 32 bytes within its rows.
__device__ __forceinline__ uint64_t descriptor(uint32_t address) {
    return static_cast<uint64_t>((address & 0x3ffffu) >> 4) | (uint64_t{16 >> 4} << 16) |
           (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// The descriptor of a 128-byte-swizzled tile whose rows run along K and whose
// 128-byte row segments hold 64 consecutive N (output) columns: an
// "MN-major" B operand, such as V in P V with V's rows being keys. The tile
// is stored as blocks of [K rows x 128 bytes], one per 64 columns,
// `column_block_bytes` apart (the leading byte offset); the stride byte
// offset 1024 steps 8 rows of K. Products read it with B transposed.
__device__ __forceinline__ uint64_t descriptor_mn(uint32_t address, uint32_t column_block_bytes) {
    return static_cast<uint64_t>((address & 0x3ffffu) >> 4) |
           (static_cast<uint64_t>((column_block_bytes & 0x3ffffu) >> 4) << 16) |
           (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// Orders this thread's earlier writes of registers that products read or
// accumulate into before the products that follow.
__device__ __forceinline__ void fence_operands() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// Closes the products issued since the last commit into one group.
__device__ __forceinline__ void commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Waits until at most N committed groups of this warpgroup are pending.
template <int N> __device__ __forceinline__ void wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Makes this thread's generic-proxy writes to shared memory (cp.async, plain
// stores) visible to the async proxy that the products read through.
using tma::fence_async_shared;

// Keeps the compiler from moving reads or writes of a register across a
// pending product: an accumulator (the hardware writes it asynchronously) or
// an A fragment in registers (read asynchronously, so not to be reused).
__device__ __forceinline__ void fence_register(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void fence_register(unsigned& r) { asm volatile("" : "+r"(r)::"memory"); }

template <typename R, int N> __device__ __forceinline__ void fence_registers(R (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) fence_register(d[i]);
}

template <typename R, int M, int N> __device__ __forceinline__ void fence_registers(R (&d)[M][N]) {
#pragma unroll
    for (int i = 0; i < M; ++i) fence_registers(d[i]);
}

#define BERRYLM_WGMMA_D8(i)                                                                   \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])

// d += A B^T for a 64 x 16 A and a 128 x 16 B (rows of B are output columns),
// both K-major in shared memory (descriptors above), f32 accumulation.
#define BERRYLM_WGMMA_M64N128K16(AB)                                                        \
    asm volatile(                                                                            \
        "{\n"                                                                                \
        ".reg .pred accumulate;\n"                                                           \
        "setp.ne.b32 accumulate, %66, 0;\n"                                                  \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " "                         \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "            \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "   \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "   \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
        "%64, %65, accumulate, 1, 1, 0, 0;\n"                                                \
        "}\n"                                                                                \
        : BERRYLM_WGMMA_D8(0), BERRYLM_WGMMA_D8(8), BERRYLM_WGMMA_D8(16), BERRYLM_WGMMA_D8(24), \
          BERRYLM_WGMMA_D8(32), BERRYLM_WGMMA_D8(40), BERRYLM_WGMMA_D8(48), BERRYLM_WGMMA_D8(56) \
        : "l"(desc_a), "l"(desc_b), "r"(1))

#define BERRYLM_WGMMA_M64N64K16(AB)                                                         \
    asm volatile(                                                                            \
        "{\n"                                                                                \
        ".reg .pred accumulate;\n"                                                           \
        "setp.ne.b32 accumulate, %34, 0;\n"                                                  \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " "                          \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "            \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "  \
        "%32, %33, accumulate, 1, 1, 0, 0;\n"                                                \
        "}\n"                                                                                \
        : BERRYLM_WGMMA_D8(0), BERRYLM_WGMMA_D8(8), BERRYLM_WGMMA_D8(16), BERRYLM_WGMMA_D8(24) \
        : "l"(desc_a), "l"(desc_b), "r"(1))

// d += A B^T for a 64 x 16 A and a 64 x 16 B, both K-major in shared memory.
template <typename T>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or f16");
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        BERRYLM_WGMMA_M64N64K16("bf16");
    } else {
        BERRYLM_WGMMA_M64N64K16("f16");
    }
}

// d += A B for a 64 x 16 A in registers (each warp's 16 rows as mma.sync's
// m16n8k16 A fragment: a[0] row l / 4, columns 2 (l % 4) and the next;
// a[1] 8 rows below; a[2], a[3] the same 8 columns on) and a 16 x 128 B in
// shared memory, MN-major (descriptor_mn).
#define BERRYLM_WGMMA_M64N128K16_RS(AB)                                                     \
    asm volatile(                                                                            \
        "{\n"                                                                                \
        ".reg .pred accumulate;\n"                                                           \
        "setp.ne.b32 accumulate, %69, 0;\n"                                                  \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " "                         \
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "            \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "   \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "   \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "  \
        "{%64, %65, %66, %67}, %68, accumulate, 1, 1, 1;\n"                                  \
        "}\n"                                                                                \
        : BERRYLM_WGMMA_D8(0), BERRYLM_WGMMA_D8(8), BERRYLM_WGMMA_D8(16), BERRYLM_WGMMA_D8(24), \
          BERRYLM_WGMMA_D8(32), BERRYLM_WGMMA_D8(40), BERRYLM_WGMMA_D8(48), BERRYLM_WGMMA_D8(56) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

template <typename T>
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4],
                                                  uint64_t desc_b) {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or f16");
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        BERRYLM_WGMMA_M64N128K16_RS("bf16");
    } else {
        BERRYLM_WGMMA_M64N128K16_RS("f16");
    }
}

template <typename T>
__device__ __forceinline__ void mma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "bf16 or f16");
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        BERRYLM_WGMMA_M64N128K16("bf16");
    } else {
        BERRYLM_WGMMA_M64N128K16("f16");
    }
}

#undef BERRYLM_WGMMA_M64N128K16
#undef BERRYLM_WGMMA_M64N128K16_RS
#undef BERRYLM_WGMMA_M64N64K16
#undef BERRYLM_WGMMA_D8

}  // namespace berrylm::wgmma
