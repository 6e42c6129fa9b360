// MoE routing (spec 3.7 steps 1-2), one thread block per row of router
// logits, one thread per expert (E <= 512):
//   p   = softmax(logits)                 (f32)
//   ids = torch.topk(p, k).indices        (PyTorch's CPU order, ties included)
//   w   = round_w(renormalize ? p[ids] / sum(p[ids]) : p[ids])
//
// Softmax: block maximum (fmaxf, which skips NaN like the CPU's f32::max, so
// it is exact), exp(x - max) evaluated in double and rounded once to f32
// (correctly rounded in all but vanishingly rare cases; the CPU's glibc expf
// is within 0.502 ulp, so the two differ by at most one ulp, and rarely),
// block sum (lanes, then warps: another order than the CPU's), IEEE division.
//
// Top-k: each thread counts the probabilities ranked before its own under
// PyTorch's comparator (NaN first, then larger) and the equal ones before
// it; that rank (a stable descending sort) places the k first. When no two
// of the k + 1 largest probabilities are equal (all k if k = E), this is the
// unique answer and it is what torch.topk returns. Otherwise the order of
// tied experts depends on how PyTorch's CPU kernel moves its (value, index)
// pairs (libstdc++ nth_element + sort, or partial_sort when 64 k <= E, see
// torch_top_k in src/route.rs), so the block replays those algorithms on
// the row in shared memory: the same comparisons, hence the same result
// (nth_element's partitions with every thread at once, which yields what the
// sequential loop does, the rest in one thread).
//
// The renormalising sum adds the k chosen probabilities in their order from
// 0 (as the CPU does); the weights are rounded to `weight_dtype` (RNE) and
// stored as f32, the ids as u32.
#include "common.cuh"

namespace berrylm::route {

constexpr int kMaxExperts = 512;  // must match MAX_MOE_EXPERTS in src/cuda/route.rs
constexpr int kMaxWarps = kMaxExperts / 32;
// libstdc++'s _S_threshold: introsort leaves ranges of at most this many
// entries to the final insertion sort.
constexpr int kSortThreshold = 16;
// Bound of the introsort's range stack: its entries have strictly decreasing
// depth budgets, the first below 2 * floor(log2(kMaxExperts)) = 18.
constexpr int kSortStack = 20;

// PyTorch's top-k comparator: whether `a` is ranked before `b`.
__device__ __forceinline__ bool before(float a, float b) {
    return (isnan(a) && !isnan(b)) || a > b;
}

// An unsigned key of a float with before(a, b) == (rank_key(a) >
// rank_key(b)): NaN the largest key, the others in their order (-0 as +0);
// every key is above 0, the key of the block's threads past the experts.
__device__ __forceinline__ unsigned rank_key(float x) {
    if (isnan(x)) return 0xffffffffu;
    const unsigned bits = __float_as_uint(x + 0.0f);
    return (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ int floor_log2(int n) { return 31 - __clz(n); }

// The (value, index) pairs of PyTorch's top-k queue, in shared memory; the
// replay of libstdc++'s algorithms below works on a range [first, last) of
// them, exactly as the C++ iterators do.
struct Queue {
    float* value;
    int* index;

    __device__ bool before_at(int a, int b) const { return before(value[a], value[b]); }
    __device__ void swap(int a, int b) const {
        const float v = value[a];
        value[a] = value[b];
        value[b] = v;
        const int i = index[a];
        index[a] = index[b];
        index[b] = i;
    }
    __device__ void copy(int to, int from) const {
        value[to] = value[from];
        index[to] = index[from];
    }

    // __adjust_heap on the heap [first, first + len): moves the hole down
    // towards the child ranked last, then pushes (v, ix) up (__push_heap).
    __device__ void adjust_heap(int first, int hole, int len, float v, int ix) const {
        const int top = hole;
        int child = hole;
        while (child < (len - 1) / 2) {
            child = 2 * (child + 1);
            if (before_at(first + child, first + child - 1)) --child;
            copy(first + hole, first + child);
            hole = child;
        }
        if ((len & 1) == 0 && child == (len - 2) / 2) {
            child = 2 * (child + 1);
            copy(first + hole, first + child - 1);
            hole = child - 1;
        }
        while (hole > top) {
            const int parent = (hole - 1) / 2;
            if (!before(value[first + parent], v)) break;
            copy(first + hole, first + parent);
            hole = parent;
        }
        value[first + hole] = v;
        index[first + hole] = ix;
    }

    // __heap_select: the `middle - first` entries ranked first end up in
    // [first, middle), as a heap whose top is the one ranked last.
    __device__ void heap_select(int first, int middle, int last) const {
        const int len = middle - first;
        if (len >= 2) {  // __make_heap
            for (int parent = (len - 2) / 2; parent >= 0; --parent) {
                adjust_heap(first, parent, len, value[first + parent], index[first + parent]);
            }
        }
        for (int i = middle; i < last; ++i) {
            if (before_at(i, first)) {  // __pop_heap(first, middle, i)
                const float v = value[i];
                const int ix = index[i];
                copy(i, first);
                adjust_heap(first, 0, len, v, ix);
            }
        }
    }

    // __sort_heap of the heap [first, last).
    __device__ void sort_heap(int first, int last) const {
        while (last - first > 1) {
            --last;
            const float v = value[last];
            const int ix = index[last];
            copy(last, first);
            adjust_heap(first, 0, last - first, v, ix);
        }
    }

    // __move_median_to_first: the median of first + 1, the middle and
    // last - 1 moves to first.
    __device__ void move_median_to_first(int first, int last) const {
        const int a = first + 1, mid = first + (last - first) / 2, c = last - 1;
        int median;
        if (before_at(a, mid)) {
            median = before_at(mid, c) ? mid : before_at(a, c) ? c : a;
        } else {
            median = before_at(a, c) ? a : before_at(mid, c) ? c : mid;
        }
        swap(first, median);
    }

    // __unguarded_partition_pivot: the median of first + 1, the middle and
    // last - 1 moves to first; returns where the second part starts.
    __device__ int partition_pivot(int first, int last) const {
        move_median_to_first(first, last);
        const float pivot = value[first];
        int low = first + 1, high = last;
        while (true) {
            while (before(value[low], pivot)) ++low;
            --high;
            while (before(pivot, value[high])) --high;
            if (!(low < high)) return low;
            swap(low, high);
            ++low;
        }
    }

    // __insertion_sort of [first, last) (stable).
    __device__ void insertion_sort(int first, int last) const {
        for (int i = first + 1; i < last; ++i) {
            const float v = value[i];
            const int ix = index[i];
            int hole = i;
            if (before(v, value[first])) {
                for (; hole > first; --hole) copy(hole, hole - 1);
            } else {
                for (; before(v, value[hole - 1]); --hole) copy(hole, hole - 1);
            }
            value[hole] = v;
            index[hole] = ix;
        }
    }

    // std::sort of [first, last): __introsort_loop, then the final insertion
    // sort. The loop's recursion on [cut, last) is replaced by a stack; the
    // ranges it handles are disjoint, so the order they are handled in does
    // not change the result.
    __device__ void sort(int first, int last) const {
        if (last - first < 2) return;
        int stack_first[kSortStack], stack_last[kSortStack], stack_depth[kSortStack];
        int top = 0;
        stack_first[0] = first;
        stack_last[0] = last;
        stack_depth[0] = 2 * floor_log2(last - first);
        ++top;
        while (top > 0) {
            --top;
            const int lo = stack_first[top];
            int hi = stack_last[top];
            int depth_limit = stack_depth[top];
            while (hi - lo > kSortThreshold) {
                if (depth_limit == 0) {  // __partial_sort(lo, hi, hi)
                    heap_select(lo, hi, hi);
                    sort_heap(lo, hi);
                    break;
                }
                --depth_limit;
                const int cut = partition_pivot(lo, hi);
                stack_first[top] = cut;
                stack_last[top] = hi;
                stack_depth[top] = depth_limit;
                ++top;
                hi = cut;
            }
        }
        // __final_insertion_sort: libstdc++ splits it into a guarded sort of
        // the first 16 and unguarded insertions after them; both place every
        // entry after the last one not ranked after it, like one insertion
        // sort of the whole range.
        insertion_sort(first, last);
    }
};

// Scratch of the block's partition: the positions of the stoppers by rank,
// the stopper counts of each warp, and the cut.
struct PartitionScratch {
    int left_at[kMaxExperts];
    int right_at[kMaxExperts];
    int warp_counts[2][kMaxWarps];
    int cut;
};

// partition_pivot by every thread of the block (thread p owns position p;
// the result is the same in every thread). The sequential loop stops its
// upward scan at "left stoppers" (entries not ranked before the pivot) and
// its downward scan at "right stoppers" (entries the pivot is not ranked
// before; the pivot itself at `first` is one), and swaps the i-th left
// stopper with the i-th right stopper from the top while the former lies
// below the latter. Those pairs are disjoint and untouched by earlier
// swaps, so they are found by counting and swapped at once. The first pair
// that fails gives the cut: its left stopper, or the right stopper of the
// previous pair if that lies lower (the scan stops at the swapped-in entry
// there), or that right stopper when no left stopper is left.
__device__ int partition_pivot_block(const Queue& queue, int first, int last,
                                     PartitionScratch& scratch) {
    const int t = static_cast<int>(threadIdx.x);
    const int lane = t & 31;
    const int warp = t >> 5;
    const int warps = static_cast<int>(blockDim.x >> 5);
    if (t == 0) queue.move_median_to_first(first, last);
    __syncthreads();
    const float pivot = queue.value[first];
    const bool in_range = t >= first && t < last;
    const float v = in_range ? queue.value[t] : pivot;
    const bool left = in_range && t > first && !before(v, pivot);
    const bool right = in_range && !before(pivot, v);
    const unsigned left_bits = __ballot_sync(0xffffffffu, left);
    const unsigned right_bits = __ballot_sync(0xffffffffu, right);
    if (lane == 0) {
        scratch.warp_counts[0][warp] = __popc(left_bits);
        scratch.warp_counts[1][warp] = __popc(right_bits);
    }
    __syncthreads();
    const unsigned below = (1u << lane) - 1u;
    int left_rank = __popc(left_bits & below);
    int right_through = __popc(right_bits & below) + (right ? 1 : 0);
    int left_total = 0, right_total = 0;
    for (int w = 0; w < warps; ++w) {
        if (w < warp) {
            left_rank += scratch.warp_counts[0][w];
            right_through += scratch.warp_counts[1][w];
        }
        left_total += scratch.warp_counts[0][w];
        right_total += scratch.warp_counts[1][w];
    }
    const int right_rank = right_total - right_through;  // 0: the topmost
    if (left) scratch.left_at[left_rank] = t;
    if (right) scratch.right_at[right_rank] = t;
    __syncthreads();
    if (left) {
        const auto swaps = [&](int rank) {
            return rank < right_total && scratch.left_at[rank] < scratch.right_at[rank];
        };
        const bool swapped = swaps(left_rank);
        if (swapped) {
            queue.swap(t, scratch.right_at[left_rank]);
            if (left_rank + 1 == left_total) scratch.cut = scratch.right_at[left_rank];
        } else if (left_rank == 0 || swaps(left_rank - 1)) {
            scratch.cut = left_rank == 0 ? t : min(t, scratch.right_at[left_rank - 1]);
        }
    }
    __syncthreads();
    return scratch.cut;
}

// torch.topk(largest=True, sorted=True) on n entries, as ATen's
// TopKImpl.h, by every thread of the block: the k chosen end up in [0, k),
// in PyTorch's order. Partial sort (64 k <= n) and the final sort run in
// thread 0; __introselect's partitions run in partition_pivot_block.
__device__ void torch_top_k_block(const Queue& queue, int n, int k, PartitionScratch& scratch) {
    const bool leader = threadIdx.x == 0;
    if (k * 64 <= n) {
        if (leader) {
            queue.heap_select(0, k, n);
            queue.sort_heap(0, k);
        }
        __syncthreads();
        return;
    }
    // __introselect(0, k - 1, n).
    const int nth = k - 1;
    int first = 0, last = n;
    int depth_limit = 2 * floor_log2(n);
    bool selected = false;
    while (last - first > 3) {  // uniform over the block
        if (depth_limit == 0) {
            if (leader) {
                queue.heap_select(first, nth + 1, last);
                queue.swap(first, nth);
            }
            selected = true;
            break;
        }
        --depth_limit;
        const int cut = partition_pivot_block(queue, first, last, scratch);
        if (cut <= nth) {
            first = cut;
        } else {
            last = cut;
        }
    }
    if (leader) {
        if (!selected) queue.insertion_sort(first, last);
        queue.sort(0, k - 1);
    }
    __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kMaxExperts)
    moe_route_kernel(const T* __restrict__ logits, long long logits_stride,
                     float* __restrict__ weights, unsigned int* __restrict__ ids, int experts,
                     int top_k, int renormalize, int weight_dtype) {
    __shared__ float prob[kMaxExperts];
    __shared__ __align__(16) unsigned key[kMaxExperts];
    __shared__ int order[kMaxExperts];
    __shared__ float top_prob[kMaxExperts];
    __shared__ int top_id[kMaxExperts];
    __shared__ float partial[kMaxWarps];
    __shared__ PartitionScratch scratch;
    __shared__ float total;
    __shared__ int tied;
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    const int warps = blockDim.x >> 5;
    const long long row = blockIdx.x;
    const bool owner = t < experts;

    const float logit = owner ? berrylm::to_f32(logits[row * logits_stride + t]) : -INFINITY;
    float m = berrylm::warp_max(logit);
    if (lane == 0) partial[warp] = m;
    if (t == 0) tied = 0;
    __syncthreads();
    m = partial[0];
    for (int w = 1; w < warps; ++w) m = fmaxf(m, partial[w]);
    __syncthreads();
    const float e =
        owner ? static_cast<float>(exp(static_cast<double>(__fsub_rn(logit, m)))) : 0.0f;
    float sum = berrylm::warp_sum(e);
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < warps; ++w) sum = __fadd_rn(sum, partial[w]);
    const float p = __fdiv_rn(e, sum);
    if (owner) prob[t] = p;
    key[t] = owner ? rank_key(p) : 0u;
    __syncthreads();

    if (owner) {
        // Counts over the row's keys, four a shared load (the same address
        // for every thread: a broadcast), in independent partial counts: a
        // warp per scheduler has no other work to hide latencies behind.
        const unsigned mine = key[t];
        int ahead[4] = {}, same[4] = {}, same_before[4] = {};
        const uint4* key4 = reinterpret_cast<const uint4*>(key);
#pragma unroll 4
        for (int j4 = 0; j4 < warps * 8; ++j4) {
            const uint4 k4 = key4[j4];
            const unsigned k[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ahead[i] += k[i] > mine;
                same[i] += k[i] == mine;
                same_before[i] += (k[i] == mine) & (4 * j4 + i < t);
            }
        }
        const int ranked_before = ahead[0] + ahead[1] + ahead[2] + ahead[3];
        const int equal_before = same_before[0] + same_before[1] + same_before[2] + same_before[3];
        const int equal = same[0] + same[1] + same[2] + same[3];  // this expert too
        const int rank = ranked_before + equal_before;
        if (rank < top_k) {
            top_prob[rank] = p;
            top_id[rank] = t;
        }
        // A tie among the k + 1 largest (every tie when k = E).
        if (ranked_before < top_k && equal > 1) tied = 1;
    }
    __syncthreads();
    if (tied) {  // uniform over the block
        if (owner) order[t] = t;
        __syncthreads();
        const Queue queue{prob, order};
        torch_top_k_block(queue, experts, top_k, scratch);
        if (owner && t < top_k) {
            top_prob[t] = prob[t];
            top_id[t] = order[t];
        }
        __syncthreads();
    }
    if (t == 0) {
        float chosen_sum = 0.0f;
        if (renormalize) {
            for (int r = 0; r < top_k; ++r) chosen_sum = __fadd_rn(chosen_sum, top_prob[r]);
        }
        total = chosen_sum;
    }
    __syncthreads();
    for (int r = t; r < top_k; r += blockDim.x) {
        float w = renormalize ? __fdiv_rn(top_prob[r], total) : top_prob[r];
        if (weight_dtype == berrylm::kBF16) {
            w = berrylm::round_to<__nv_bfloat16>(w);
        } else if (weight_dtype == berrylm::kF16) {
            w = berrylm::round_to<__half>(w);
        }
        weights[row * top_k + r] = w;
        ids[row * top_k + r] = static_cast<unsigned int>(top_id[r]);
    }
}

}  // namespace berrylm::route

using namespace berrylm::route;

// Row r of the logits starts `logits_stride` >= experts elements after row
// r - 1 (a view of the router's columns in a stacked projection's output is
// read in place). `weight_dtype` is the dtype the weights are rounded to
// (they are stored as f32); 1 <= top_k <= experts <= kMaxExperts.
extern "C" int berrylm_moe_route(int logits_dtype, const void* logits, long long logits_stride,
                                 float* weights, unsigned int* ids, long long rows, int experts,
                                 int top_k, int renormalize, int weight_dtype, void* stream) {
    if (rows == 0) return 0;
    if (experts < 1 || experts > kMaxExperts || top_k < 1 || top_k > experts ||
        logits_stride < experts ||
        rows > 0x7fffffffll ||
        (weight_dtype != berrylm::kF32 && weight_dtype != berrylm::kBF16 &&
         weight_dtype != berrylm::kF16)) {
        return static_cast<int>(cudaErrorInvalidValue);
    }
    const int threads = (experts + 31) / 32 * 32;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    BERRYLM_DISPATCH_DTYPE(logits_dtype, T, {
        moe_route_kernel<T><<<static_cast<unsigned int>(rows), threads, 0, s>>>(
            static_cast<const T*>(logits), logits_stride, weights, ids, experts, top_k,
            renormalize, weight_dtype);
    });
    return berrylm::launch_status();
}
