//! The MoE router's softmax top-k routing (spec 3.7 steps 1-2).

use candle_core::cpu::kernels::VecOps;
use candle_core::{DType, Device, Tensor};

use crate::{
    ensure, expect_float_dtype, expect_positive, float_dims, round_to_dtype, to_f32_vec, Result,
};

const OP: &str = "moe_route";

/// Routes each row of `router_logits` to its `top_k` experts:
///
/// ```text
/// p      = softmax(logits)                          (f32, over the E experts)
/// ids    = torch.topk(p, top_k).indices             (by decreasing p)
/// w      = p[ids], divided by sum(p[ids]) if `renormalize`
/// weight = round(w)                                 (to `weight_dtype`)
/// ```
///
/// * `router_logits`: `[N, E]` in `f32`, `bf16` or `f16` (widened to `f32`).
/// * `top_k`: `1 <= top_k <= E`.
/// * `renormalize`: the config's `norm_topk_prob`.
/// * `weight_dtype`: `f32`, `bf16` or `f16`; the weights are rounded to it
///   once (round-to-nearest-even), as the reference casts them to the
///   activation dtype.
///
/// Returns `(weights, ids)`: `weights` `[N, top_k]` in `f32` (holding values
/// of `weight_dtype`) and `ids` `[N, top_k]` in `u32`, both in the order of
/// `torch.topk`: by decreasing probability, and among exactly equal
/// probabilities in the order PyTorch's CPU kernel leaves them (libstdc++'s
/// selection and sort algorithms run on the probabilities, see
/// `torch_top_k` in this module), so that the same experts are chosen as in
/// the reference even when bf16 logits tie.
///
/// The softmax is computed like `candle_nn::ops::softmax_last_dim` on the CPU
/// (`max`, `exp(x - max)`, candle's `vec_reduce_sum`, division), so on the CPU
/// the probabilities are candle's bit for bit. The renormalising sum adds the
/// chosen probabilities in the returned order.
///
/// On CUDA (at most 512 experts) one kernel launch does all of it, with the
/// same comparisons and the same tie order; its probabilities can differ from
/// the CPU's in the last bits (another exponential and summation order, see
/// `CUDA.md`), so the two devices can only disagree on the order of experts
/// whose logits differ but whose probabilities are within a few ulp.
pub fn moe_route(
    router_logits: &Tensor,
    top_k: usize,
    renormalize: bool,
    weight_dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let args = MoeRouteArgs::validate(router_logits, top_k, renormalize, weight_dtype)?;
    on_device!(OP, router_logits.device(), args.cpu(), args.cuda())
}

/// The validated arguments of a [`moe_route`] call and its sizes:
/// `router_logits` `[rows, experts]`.
pub(crate) struct MoeRouteArgs<'a> {
    pub router_logits: &'a Tensor,
    pub rows: usize,
    pub experts: usize,
    pub top_k: usize,
    pub renormalize: bool,
    pub weight_dtype: DType,
}

impl<'a> MoeRouteArgs<'a> {
    /// Checks the arguments of a [`moe_route`] call and reads its sizes.
    fn validate(
        router_logits: &'a Tensor,
        top_k: usize,
        renormalize: bool,
        weight_dtype: DType,
    ) -> Result<Self> {
        let [rows, experts] = float_dims::<2>(OP, "router_logits", router_logits)?;
        expect_positive(
            OP,
            "router_logits",
            "the number of experts (dim 1)",
            experts,
        )?;
        ensure((1..=experts).contains(&top_k), OP, "top_k", || {
            format!("{top_k} must be between 1 and the number of experts {experts}")
        })?;
        expect_float_dtype(OP, "weight_dtype", weight_dtype)?;
        Ok(Self {
            router_logits,
            rows,
            experts,
            top_k,
            renormalize,
            weight_dtype,
        })
    }

    /// The CPU reference.
    fn cpu(&self) -> Result<(Tensor, Tensor)> {
        let (rows, experts, top_k) = (self.rows, self.experts, self.top_k);
        let logits = to_f32_vec(self.router_logits)?;
        let mut weights = Vec::with_capacity(rows * top_k);
        let mut ids = Vec::with_capacity(rows * top_k);
        let mut probs = vec![0f32; experts];
        for row in logits.chunks_exact(experts) {
            softmax(row, &mut probs);
            let chosen = torch_top_k(&probs, top_k);
            let total: f32 = chosen.iter().map(|&expert| probs[expert]).sum();
            for expert in chosen {
                let prob = probs[expert];
                weights.push(if self.renormalize { prob / total } else { prob });
                ids.push(expert as u32);
            }
        }
        let weights = round_to_dtype(weights, self.weight_dtype)?;
        Ok((
            Tensor::from_vec(weights, (rows, top_k), &Device::Cpu)?,
            Tensor::from_vec(ids, (rows, top_k), &Device::Cpu)?,
        ))
    }
}

/// `probs = softmax(row)`, computed as candle_nn's CPU `softmax_last_dim`
/// computes it: the maximum by `f32::max` from the first element, `exp` of
/// each difference, their sum by candle's `vec_reduce_sum` (sequential, or in
/// SIMD lanes when candle is built with AVX2), and one division each.
fn softmax(row: &[f32], probs: &mut [f32]) {
    let max = row[1..].iter().fold(row[0], |max, &value| max.max(value));
    for (prob, &value) in probs.iter_mut().zip(row) {
        *prob = (value - max).exp();
    }
    let mut sum = 0f32;
    // SAFETY: `probs` holds `probs.len()` initialised values and `sum` is a
    // valid place to write the result.
    unsafe { f32::vec_reduce_sum(probs.as_ptr(), &mut sum, probs.len()) };
    for prob in probs.iter_mut() {
        *prob /= sum;
    }
}

/// A candidate of the top-k selection: its value and its index.
type Entry = (f32, usize);

/// Whether `a` is ranked before `b`: PyTorch's top-k comparator, NaN first,
/// then the larger value. Equal values (and two NaNs) are unordered.
fn before(a: &Entry, b: &Entry) -> bool {
    (a.0.is_nan() && !b.0.is_nan()) || a.0 > b.0
}

/// The indices `torch.topk(values, k, largest=True, sorted=True)` returns on
/// the CPU, in its order.
///
/// Among exactly equal values PyTorch keeps neither the lowest nor the
/// highest indices: its CPU kernel (ATen `TopKImpl.h`) pairs each value with
/// its index and, comparing values only with [`before`], runs libstdc++'s
/// `std::partial_sort` of the first `k` when `64 k <= n`, else
/// `std::nth_element` at `k - 1` followed by `std::sort` of the first
/// `k - 1`. This function runs the same algorithms (heap select and heap
/// sort; introselect; introsort with a final insertion sort) with the same
/// comparisons, so it returns the same indices in the same order. Without
/// ties the result is simply the `k` largest values by decreasing value.
fn torch_top_k(values: &[f32], k: usize) -> Vec<usize> {
    let n = values.len();
    let mut entries: Vec<Entry> = values.iter().copied().zip(0..).collect();
    if k * 64 <= n {
        heap_select(&mut entries, k);
        sort_heap(&mut entries[..k]);
    } else {
        introselect(&mut entries, k - 1, 2 * n.ilog2());
        sort(&mut entries[..k - 1]);
    }
    entries[..k].iter().map(|&(_, index)| index).collect()
}

/// libstdc++'s `_S_threshold`: introsort leaves ranges of at most this many
/// entries to the final insertion sort.
const SORT_THRESHOLD: usize = 16;

/// libstdc++'s `std::sort`: introsort, then a final insertion sort.
fn sort(a: &mut [Entry]) {
    if !a.is_empty() {
        introsort_loop(a, 2 * a.len().ilog2());
        insertion_sort(a);
    }
}

/// libstdc++'s `__introsort_loop`: partitions until every range left has at
/// most [`SORT_THRESHOLD`] entries, heap-sorting a range when `depth_limit`
/// runs out.
fn introsort_loop(a: &mut [Entry], mut depth_limit: u32) {
    let mut last = a.len();
    while last > SORT_THRESHOLD {
        if depth_limit == 0 {
            heap_select(&mut a[..last], last);
            sort_heap(&mut a[..last]);
            return;
        }
        depth_limit -= 1;
        let cut = partition_around_median(&mut a[..last]);
        introsort_loop(&mut a[cut..last], depth_limit);
        last = cut;
    }
}

/// libstdc++'s `__introselect`: leaves in `a[nth]` the entry a full sort
/// would put there, with no entry before it ranked after it and none after
/// it ranked before it.
fn introselect(a: &mut [Entry], nth: usize, mut depth_limit: u32) {
    let (mut first, mut last) = (0, a.len());
    while last - first > 3 {
        if depth_limit == 0 {
            heap_select(&mut a[first..last], nth + 1 - first);
            a.swap(first, nth);
            return;
        }
        depth_limit -= 1;
        let cut = first + partition_around_median(&mut a[first..last]);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut a[first..last]);
}

/// libstdc++'s `__unguarded_partition_pivot`: moves the median of `a[1]`,
/// the middle entry and the last entry to `a[0]`, partitions `a[1..]` around
/// it and returns where the second part starts.
fn partition_around_median(a: &mut [Entry]) -> usize {
    let (second, mid, last) = (1, a.len() / 2, a.len() - 1);
    let median = if before(&a[second], &a[mid]) {
        if before(&a[mid], &a[last]) {
            mid
        } else if before(&a[second], &a[last]) {
            last
        } else {
            second
        }
    } else if before(&a[second], &a[last]) {
        second
    } else if before(&a[mid], &a[last]) {
        last
    } else {
        mid
    };
    a.swap(0, median);
    let (mut low, mut high) = (1, a.len());
    loop {
        while before(&a[low], &a[0]) {
            low += 1;
        }
        high -= 1;
        while before(&a[0], &a[high]) {
            high -= 1;
        }
        if low >= high {
            return low;
        }
        a.swap(low, high);
        low += 1;
    }
}

/// libstdc++'s `__insertion_sort` (stable).
fn insertion_sort(a: &mut [Entry]) {
    for i in 1..a.len() {
        let entry = a[i];
        if before(&entry, &a[0]) {
            a.copy_within(0..i, 1);
            a[0] = entry;
        } else {
            let mut hole = i;
            while before(&entry, &a[hole - 1]) {
                a[hole] = a[hole - 1];
                hole -= 1;
            }
            a[hole] = entry;
        }
    }
}

/// libstdc++'s `__heap_select`: leaves in `a[..middle]` the `middle`
/// entries ranked first, as a heap whose top is the one ranked last.
fn heap_select(a: &mut [Entry], middle: usize) {
    make_heap(&mut a[..middle]);
    for i in middle..a.len() {
        if before(&a[i], &a[0]) {
            let entry = a[i];
            a[i] = a[0];
            adjust_heap(&mut a[..middle], 0, entry);
        }
    }
}

/// libstdc++'s `__make_heap`.
fn make_heap(heap: &mut [Entry]) {
    if heap.len() < 2 {
        return;
    }
    for parent in (0..=(heap.len() - 2) / 2).rev() {
        let entry = heap[parent];
        adjust_heap(heap, parent, entry);
    }
}

/// libstdc++'s `__sort_heap`: pops the top to the end until the heap is
/// sorted (the entry ranked first at index 0).
fn sort_heap(heap: &mut [Entry]) {
    for last in (1..heap.len()).rev() {
        let entry = heap[last];
        heap[last] = heap[0];
        adjust_heap(&mut heap[..last], 0, entry);
    }
}

/// libstdc++'s `__adjust_heap`: moves the hole at `hole` down to a leaf,
/// always towards the child ranked last (the second child on equality), then
/// places `entry` on the way back up (`__push_heap`).
fn adjust_heap(heap: &mut [Entry], mut hole: usize, entry: Entry) {
    let len = heap.len();
    let top = hole;
    let mut child = hole;
    while child < (len - 1) / 2 {
        child = 2 * (child + 1);
        if before(&heap[child], &heap[child - 1]) {
            child -= 1;
        }
        heap[hole] = heap[child];
        hole = child;
    }
    if len.is_multiple_of(2) && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        heap[hole] = heap[child - 1];
        hole = child - 1;
    }
    while hole > top {
        let parent = (hole - 1) / 2;
        if !before(&heap[parent], &entry) {
            break;
        }
        heap[hole] = heap[parent];
        hole = parent;
    }
    heap[hole] = entry;
}
