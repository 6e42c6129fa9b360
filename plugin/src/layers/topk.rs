//! The router's top-k selection, made the way `torch.topk` makes it on the CPU.
//!
//! Router probabilities tie exactly whenever two router logits round to the
//! same value, which bf16 logits often do. Among tied experts the reference
//! keeps the ones `torch.topk(largest=True)` keeps, and that is neither the
//! lowest nor the highest index: PyTorch's CPU kernel pairs each value with its
//! index and selects with libstdc++'s `std::nth_element` (introselect), or with
//! `std::partial_sort` (a heap) when `64 k <= n`, comparing values only. This
//! module runs the same algorithms on the same comparisons, so it keeps the
//! same experts.

/// A candidate: its value and its index.
type Entry = (f32, usize);

/// Whether `a` is selected before `b`: NaN first, then the larger value
/// (PyTorch's comparator; equal values are unordered).
fn before(a: &Entry, b: &Entry) -> bool {
    (a.0.is_nan() && !b.0.is_nan()) || a.0 > b.0
}

/// The indices of the `k` entries of `values` that `torch.topk(values, k)`
/// returns on the CPU, by decreasing value.
pub fn torch_top_k(values: &[f32], k: usize) -> Vec<usize> {
    let n = values.len();
    let k = k.min(n);
    let mut entries: Vec<Entry> = values.iter().copied().zip(0..).collect();
    if k > 0 && k < n {
        if k * 64 <= n {
            heap_select(&mut entries, k);
        } else {
            introselect(&mut entries, k - 1, 2 * n.ilog2());
        }
    }
    let mut chosen: Vec<Entry> = entries[..k].to_vec();
    chosen.sort_by(|a, b| b.0.total_cmp(&a.0));
    chosen.into_iter().map(|(_, index)| index).collect()
}

/// libstdc++'s `__introselect`: leaves in `a[nth]` the entry a full sort would
/// put there, with every entry before it not selected after it.
fn introselect(a: &mut [Entry], nth: usize, mut depth_limit: u32) {
    let (mut first, mut last) = (0, a.len());
    while last - first > 3 {
        if depth_limit == 0 {
            heap_select(&mut a[first..last], nth + 1 - first);
            a.swap(first, nth);
            return;
        }
        depth_limit -= 1;
        let cut = partition_around_median(&mut a[first..last]) + first;
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut a[first..last]);
}

/// libstdc++'s `__unguarded_partition_pivot`: moves the median of
/// `a[1]`, the middle entry and the last entry to `a[0]`, partitions the rest
/// around it and returns where the second part starts.
fn partition_around_median(a: &mut [Entry]) -> usize {
    let (mid, last) = (a.len() / 2, a.len() - 1);
    let median = if before(&a[1], &a[mid]) {
        if before(&a[mid], &a[last]) {
            mid
        } else if before(&a[1], &a[last]) {
            last
        } else {
            1
        }
    } else if before(&a[1], &a[last]) {
        1
    } else if before(&a[mid], &a[last]) {
        last
    } else {
        mid
    };
    a.swap(0, median);
    let (mut first, mut last) = (1, a.len());
    loop {
        while before(&a[first], &a[0]) {
            first += 1;
        }
        last -= 1;
        while before(&a[0], &a[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        a.swap(first, last);
        first += 1;
    }
}

/// libstdc++'s `__insertion_sort`.
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

/// libstdc++'s `__heap_select`: leaves in `a[..middle]` the `middle` entries
/// selected first, as a heap whose top is the one selected last.
fn heap_select(a: &mut [Entry], middle: usize) {
    if middle >= 2 {
        for parent in (0..=(middle - 2) / 2).rev() {
            let entry = a[parent];
            adjust_heap(&mut a[..middle], parent, entry);
        }
    }
    for i in middle..a.len() {
        if before(&a[i], &a[0]) {
            let entry = a[i];
            a[i] = a[0];
            adjust_heap(&mut a[..middle], 0, entry);
        }
    }
}

/// libstdc++'s `__adjust_heap` on the heap `heap`: fills the hole at `hole`
/// from below, then places `entry` by `__push_heap`.
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

#[cfg(test)]
mod tests {
    use super::torch_top_k;

    fn sorted(mut indices: Vec<usize>) -> Vec<usize> {
        indices.sort_unstable();
        indices
    }

    /// Rows with exact ties and the experts `torch.topk` (PyTorch 2.x, CPU)
    /// keeps for them; keeping the lowest tied indices would differ on each.
    #[test]
    fn ties_are_broken_as_torch_topk_breaks_them() {
        let cases: [(&[f32], usize, &[usize]); 8] = [
            (&[60., 0., 0., 60., 60., 60., 0., 60.], 2, &[0, 5]),
            (&[36., 0., 12., 0., 48., 12., 24., 36.], 2, &[4, 7]),
            (&[60., 0., 60., 30., 60., 60., 0., 0.], 2, &[0, 5]),
            (&[48., 36., 24., 36., 48., 36.], 3, &[0, 3, 4]),
            (&[40., 20., 20., 20., 0., 40.], 3, &[0, 3, 5]),
            (&[36., 24., 60., 36.], 2, &[2, 3]),
            (&[60., 0., 60., 60., 60., 0., 30., 60.], 1, &[4]),
            (
                &[
                    0., 0., 60., 20., 40., 20., 60., 60., 0., 0., 40., 40., 40., 60., 60., 0.,
                ],
                4,
                &[6, 7, 13, 14],
            ),
        ];
        for (values, k, expected) in cases {
            assert_eq!(sorted(torch_top_k(values, k)), expected, "{values:?} k={k}");
        }
    }

    #[test]
    fn distinct_values_give_the_largest_by_decreasing_value() {
        let values: Vec<f32> = (0..200).map(|i| ((i * 37) % 200) as f32).collect();
        for k in [1, 2, 3, 8, 64] {
            let expected: Vec<usize> = (0..k)
                .map(|rank| {
                    let value = (199 - rank) as f32;
                    values.iter().position(|&v| v == value).unwrap()
                })
                .collect();
            assert_eq!(torch_top_k(&values, k), expected, "k={k}");
        }
        assert_eq!(torch_top_k(&[1.0, 3.0, 2.0], 3), vec![1, 2, 0]);
    }
}
