//! CPU `torch.topk` (torch 2.6.0, `aten/src/ATen/native/TopKImpl.h`) over |value|,
//! reproducing its tie order exactly.
//!
//! torch fills a vector of `(value, index)` pairs and orders it with
//! `before(a, b) = (isnan(a) && !isnan(b)) || a > b` using GCC libstdc++ algorithms:
//! `std::partial_sort(q, q+k, q+n)` when `k * 64 <= n`, else
//! `std::nth_element(q, q+k-1, q+n)` followed by `std::sort(q, q+k-1)`. Which tied elements
//! are selected, and their order, is whatever those exact algorithms produce, so this file
//! is a line-by-line port of `__heap_select`, `__adjust_heap`, `__push_heap`, `__pop_heap`,
//! `__sort_heap`, `__introselect`, `__introsort_loop`, `__unguarded_partition_pivot`,
//! `__move_median_to_first` and the insertion sorts (`bits/stl_heap.h`, `bits/stl_algo.h`).
//! Vectors README, "torch.topk order (CPU, torch 2.6.0)".
//!
//! Comparator as an integer key: for the absolute value of a bfloat16 or float16, the
//! float order of non-NaN magnitudes equals the order of their 15-bit patterns (sign
//! cleared, so +0 and -0 tie, subnormals ordered exactly), and every NaN pattern is above
//! infinity's. Mapping every NaN to one key just above infinity (`min(bits & 0x7FFF,
//! inf + 1)`) gives `before(a, b) ⇔ key(a) > key(b)` for all inputs, including NaN vs NaN
//! (false both ways, as in torch). The algorithms only observe comparator outcomes, so the
//! result is identical to torch's.

use super::{Dtype, ToplocError};

/// Which libstdc++ path torch takes for a top-k of `k` out of `n` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TopkAlgorithm {
    /// `k * 64 <= n`: `std::partial_sort` (a heap of the first k, replaced only by a
    /// strictly larger later value). The realistic configurations (32 rows × 2048 or 6144,
    /// k = 128) take this path.
    PartialSort,
    /// `k * 64 > n`: `std::nth_element` then `std::sort` of the first k-1.
    NthElementSort,
}

impl TopkAlgorithm {
    /// The name the golden vectors use (`"partial_sort"` / `"nth_element+sort"`).
    pub fn vector_name(self) -> &'static str {
        match self {
            Self::PartialSort => "partial_sort",
            Self::NthElementSort => "nth_element+sort",
        }
    }
}

/// The path torch 2.6.0 takes for top-`k` of `n` values (`k * 64 <= n` → partial sort).
pub fn topk_algorithm(k: usize, n: usize) -> TopkAlgorithm {
    if k.saturating_mul(64) <= n {
        TopkAlgorithm::PartialSort
    } else {
        TopkAlgorithm::NthElementSort
    }
}

/// One `(|value|, index)` pair of torch's queue, plus the raw signed bits at that index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Order key: `before(a, b) ⇔ a.key > b.key`.
    pub key: u16,
    /// The element's own (signed) bit pattern.
    pub bits: u16,
    /// Flat index within the batch.
    pub idx: u32,
}

/// Key of |value| with every NaN collapsed to `inf + 1` (see the module docs).
#[inline(always)]
fn key_of(bits: u16, nan_key: u16) -> u16 {
    (bits & 0x7FFF).min(nan_key)
}

/// `inf + 1` for the dtype: the single key every NaN magnitude maps to.
#[inline]
fn nan_key(dtype: Dtype) -> u16 {
    match dtype {
        Dtype::Bf16 => 0x7F81,
        Dtype::F16 => 0x7C01,
    }
}

#[inline(always)]
fn before(a: &Entry, b: &Entry) -> bool {
    a.key > b.key
}

// ----------------------------------------------------------------------------------------
// bits/stl_heap.h
// ----------------------------------------------------------------------------------------

/// `std::__push_heap(first, holeIndex, topIndex, value, comp)`.
fn push_heap(v: &mut [Entry], mut hole: usize, top: usize, value: Entry) {
    while hole > top {
        let parent = (hole - 1) / 2;
        if !before(&v[parent], &value) {
            break;
        }
        v[hole] = v[parent];
        hole = parent;
    }
    v[hole] = value;
}

/// `std::__adjust_heap(first, holeIndex, len, value, comp)` on `v[..len]`.
fn adjust_heap(v: &mut [Entry], mut hole: usize, len: usize, value: Entry) {
    let top = hole;
    let mut second = hole;
    // `(len - 1) / 2` with C++ truncation; len >= 1 whenever this is called.
    let half = len.saturating_sub(1) / 2;
    while second < half {
        second = 2 * (second + 1);
        if before(&v[second], &v[second - 1]) {
            second -= 1;
        }
        v[hole] = v[second];
        hole = second;
    }
    if len & 1 == 0 && len >= 2 && second == (len - 2) / 2 {
        second = 2 * (second + 1);
        v[hole] = v[second - 1];
        hole = second - 1;
    }
    push_heap(v, hole, top, value);
}

/// `std::__make_heap(first, last, comp)`.
fn make_heap(v: &mut [Entry]) {
    let len = v.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let value = v[parent];
        adjust_heap(v, parent, len, value);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

/// `std::__pop_heap(first, last, result, comp)` with `first..last = v[..len]`,
/// `result = v[result]` (`result >= len`, or `len - 1` from `__sort_heap`).
fn pop_heap(v: &mut [Entry], len: usize, result: usize) {
    let value = v[result];
    v[result] = v[0];
    adjust_heap(v, 0, len, value);
}

/// `std::__sort_heap(first, last, comp)`.
fn sort_heap(v: &mut [Entry]) {
    let mut last = v.len();
    while last > 1 {
        last -= 1;
        pop_heap(v, last, last);
    }
}

// ----------------------------------------------------------------------------------------
// bits/stl_algo.h
// ----------------------------------------------------------------------------------------

/// `std::__heap_select(first, middle, last, comp)`.
fn heap_select(v: &mut [Entry], middle: usize) {
    make_heap(&mut v[..middle]);
    for i in middle..v.len() {
        if before(&v[i], &v[0]) {
            pop_heap(v, middle, i);
        }
    }
}

/// `std::__partial_sort(first, middle, last, comp)`.
fn partial_sort(v: &mut [Entry], middle: usize) {
    heap_select(v, middle);
    sort_heap(&mut v[..middle]);
}

/// `std::__move_median_to_first(result, a, b, c, comp)`.
fn move_median_to_first(v: &mut [Entry], result: usize, a: usize, b: usize, c: usize) {
    if before(&v[a], &v[b]) {
        if before(&v[b], &v[c]) {
            v.swap(result, b);
        } else if before(&v[a], &v[c]) {
            v.swap(result, c);
        } else {
            v.swap(result, a);
        }
    } else if before(&v[a], &v[c]) {
        v.swap(result, a);
    } else if before(&v[b], &v[c]) {
        v.swap(result, c);
    } else {
        v.swap(result, b);
    }
}

/// `std::__unguarded_partition(first, last, pivot, comp)`; returns the cut.
///
/// The scans are "unguarded" in C++ (the median-of-three guarantees sentinels); the extra
/// bounds in the loop conditions never trigger for a strict weak order and only keep the
/// port free of out-of-bounds indexing.
fn unguarded_partition(v: &mut [Entry], mut first: usize, mut last: usize, pivot: usize) -> usize {
    loop {
        while first < v.len() && before(&v[first], &v[pivot]) {
            first += 1;
        }
        last = last.saturating_sub(1);
        while last > 0 && before(&v[pivot], &v[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        v.swap(first, last);
        first += 1;
    }
}

/// `std::__unguarded_partition_pivot(first, last, comp)` on `v[first..last]`.
fn unguarded_partition_pivot(v: &mut [Entry], first: usize, last: usize) -> usize {
    let mid = first + (last - first) / 2;
    move_median_to_first(v, first, first + 1, mid, last - 1);
    unguarded_partition(v, first + 1, last, first)
}

/// `std::__unguarded_linear_insert(last, comp)` within `v`.
fn unguarded_linear_insert(v: &mut [Entry], mut last: usize) {
    let val = v[last];
    while last > 0 && before(&val, &v[last - 1]) {
        v[last] = v[last - 1];
        last -= 1;
    }
    v[last] = val;
}

/// `std::__insertion_sort(first, last, comp)`.
fn insertion_sort(v: &mut [Entry]) {
    for i in 1..v.len() {
        if before(&v[i], &v[0]) {
            // move_backward(first, i, i + 1); *first = val
            v[..=i].rotate_right(1);
        } else {
            unguarded_linear_insert(v, i);
        }
    }
}

/// libstdc++ `_S_threshold`.
const S_THRESHOLD: usize = 16;

/// `std::__final_insertion_sort(first, last, comp)`.
fn final_insertion_sort(v: &mut [Entry]) {
    if v.len() > S_THRESHOLD {
        insertion_sort(&mut v[..S_THRESHOLD]);
        for i in S_THRESHOLD..v.len() {
            unguarded_linear_insert(v, i);
        }
    } else {
        insertion_sort(v);
    }
}

/// `std::__lg(n)` = floor(log2 n) for n > 0.
fn lg(n: usize) -> usize {
    (usize::BITS - 1 - n.leading_zeros()) as usize
}

/// `std::__introsort_loop(first, last, depth_limit, comp)` on `v[first..last]`.
fn introsort_loop(v: &mut [Entry], first: usize, mut last: usize, mut depth_limit: usize) {
    while last - first > S_THRESHOLD {
        if depth_limit == 0 {
            let len = last - first;
            partial_sort(&mut v[first..last], len);
            return;
        }
        depth_limit -= 1;
        let cut = unguarded_partition_pivot(v, first, last);
        introsort_loop(v, cut, last, depth_limit);
        last = cut;
    }
}

/// `std::sort(first, last, comp)`.
fn std_sort(v: &mut [Entry]) {
    if v.is_empty() {
        return;
    }
    let len = v.len();
    introsort_loop(v, 0, len, lg(len) * 2);
    final_insertion_sort(v);
}

/// `std::__introselect(first, nth, last, depth_limit, comp)` on `v[first..last]`.
fn introselect(v: &mut [Entry], mut first: usize, nth: usize, mut last: usize, mut depth: usize) {
    while last - first > 3 {
        if depth == 0 {
            heap_select(&mut v[first..last], nth + 1 - first);
            v.swap(first, nth);
            return;
        }
        depth -= 1;
        let cut = unguarded_partition_pivot(v, first, last);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut v[first..last]);
}

/// `std::nth_element(first, nth, last, comp)`.
fn nth_element(v: &mut [Entry], nth: usize) {
    let len = v.len();
    if len == 0 || nth >= len {
        return;
    }
    introselect(v, 0, nth, len, lg(len) * 2);
}

// ----------------------------------------------------------------------------------------
// torch.topk over a batch made of several slices
// ----------------------------------------------------------------------------------------

/// Reusable buffers for [`topk_into`], so repeated batches do not allocate.
#[derive(Debug, Default)]
pub(crate) struct TopkScratch {
    /// partial_sort: the heap of the first k pairs. nth_element: the whole queue.
    buf: Vec<Entry>,
}

/// Values per chunk in the partial_sort scan: a chunk whose largest key cannot enter the
/// heap is skipped without touching the heap (same outcome, fewer branches).
const SCAN_CHUNK: usize = 32;

/// `flat.abs().topk(k)` for the batch `flat = concat(parts)`; returns the k pairs in
/// torch's order. Preconditions (checked by the callers): `1 <= k <= n`, `n <= i32::MAX`.
pub(crate) fn topk_into<'s>(
    parts: &[&[u16]],
    n: usize,
    dtype: Dtype,
    k: usize,
    scratch: &'s mut TopkScratch,
) -> &'s [Entry] {
    let nk = nan_key(dtype);
    let buf = &mut scratch.buf;
    buf.clear();
    match topk_algorithm(k, n) {
        TopkAlgorithm::PartialSort => {
            // __heap_select(q, q+k, q+n) + __sort_heap(q, q+k). The queue positions >= k
            // are only ever read once, in order, before anything is written to them (a
            // pop_heap writes the old top to the position just read), so it suffices to
            // keep the heap of k pairs and stream the rest.
            buf.reserve(k);
            let mut base: u32 = 0;
            let mut heap_ready = false;
            for part in parts {
                let mut rest: &[u16] = part;
                if !heap_ready {
                    let take = (k - buf.len()).min(rest.len());
                    let (head, tail) = rest.split_at(take);
                    for (j, &bits) in head.iter().enumerate() {
                        buf.push(Entry {
                            key: key_of(bits, nk),
                            bits,
                            idx: base + j as u32,
                        });
                    }
                    base += take as u32;
                    rest = tail;
                    if buf.len() == k {
                        make_heap(buf);
                        heap_ready = true;
                    } else {
                        continue;
                    }
                }
                scan_into_heap(buf, rest, base, nk);
                base += rest.len() as u32;
            }
            sort_heap(buf);
        }
        TopkAlgorithm::NthElementSort => {
            buf.reserve(n);
            let mut base: u32 = 0;
            for part in parts {
                for (j, &bits) in part.iter().enumerate() {
                    buf.push(Entry {
                        key: key_of(bits, nk),
                        bits,
                        idx: base + j as u32,
                    });
                }
                base += part.len() as u32;
            }
            nth_element(buf, k - 1);
            std_sort(&mut buf[..k - 1]);
            buf.truncate(k);
        }
    }
    &scratch.buf
}

/// The `for i in middle..last: if comp(*i, *first) pop_heap(first, middle, i)` loop of
/// `__heap_select` over one slice whose first value has flat index `base`.
#[inline]
fn scan_into_heap(heap: &mut [Entry], values: &[u16], base: u32, nk: u16) {
    let len = heap.len();
    let Some(top) = heap.first() else {
        return;
    };
    let mut threshold = top.key;
    let mut offset = base;
    for chunk in values.chunks(SCAN_CHUNK) {
        let chunk_max = chunk.iter().fold(0u16, |m, &b| m.max(key_of(b, nk)));
        if chunk_max > threshold {
            for (j, &bits) in chunk.iter().enumerate() {
                let key = key_of(bits, nk);
                if key > threshold {
                    // pop_heap(first, middle, i): the old top goes to position i (never
                    // read again), the new pair sifts in from the top.
                    adjust_heap(
                        heap,
                        0,
                        len,
                        Entry {
                            key,
                            bits,
                            idx: offset + j as u32,
                        },
                    );
                    threshold = heap[0].key;
                }
            }
        }
        offset += chunk.len() as u32;
    }
}

/// `values.abs().topk(k).indices` in torch's order, for one 1-D tensor of bit patterns.
///
/// * `values_bits`: the tensor's elements as bfloat16 or float16 bit patterns (`dtype`).
/// * returns k flat indices, largest |value| first; NaN (any sign/payload) ranks above
///   +inf; +0 and -0 tie; ties resolved exactly as torch 2.6.0 on CPU (module docs).
///
/// # Errors
/// * [`ToplocError::TopkExceedsBatch`] when `k > values_bits.len()` (torch: "selected
///   index k out of range").
/// * [`ToplocError::BatchTooLarge`] beyond `i32::MAX` values.
///
/// `k = 0` gives an empty list, as torch does.
pub fn select_topk(values_bits: &[u16], dtype: Dtype, k: usize) -> Result<Vec<u32>, ToplocError> {
    let n = values_bits.len();
    if n > i32::MAX as usize {
        return Err(ToplocError::BatchTooLarge {
            batch: 0,
            batch_len: n,
        });
    }
    if k > n {
        return Err(ToplocError::TopkExceedsBatch {
            batch: 0,
            batch_len: n,
            topk: k,
        });
    }
    if k == 0 {
        return Ok(Vec::new());
    }
    let mut scratch = TopkScratch::default();
    let selected = topk_into(&[values_bits], n, dtype, k, &mut scratch);
    Ok(selected.iter().map(|e| e.idx).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(keys: &[u16]) -> Vec<Entry> {
        keys.iter()
            .enumerate()
            .map(|(i, &k)| Entry {
                key: k,
                bits: k,
                idx: i as u32,
            })
            .collect()
    }

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        *seed >> 33
    }

    #[test]
    fn std_sort_sorts_descending_and_permutes() {
        let mut seed = 7;
        for n in [0usize, 1, 2, 3, 5, 16, 17, 33, 100, 1000] {
            for levels in [2u64, 5, 1000] {
                let keys: Vec<u16> = (0..n).map(|_| (lcg(&mut seed) % levels) as u16).collect();
                let mut v = entries(&keys);
                std_sort(&mut v);
                assert!(v.windows(2).all(|w| w[0].key >= w[1].key));
                let mut idx: Vec<u32> = v.iter().map(|e| e.idx).collect();
                idx.sort_unstable();
                assert_eq!(idx, (0..n as u32).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn nth_element_partitions() {
        let mut seed = 11;
        for n in [1usize, 2, 4, 9, 64, 300, 5000] {
            for nth in [0, n / 3, n - 1] {
                let keys: Vec<u16> = (0..n).map(|_| (lcg(&mut seed) % 7) as u16).collect();
                let mut v = entries(&keys);
                nth_element(&mut v, nth);
                let pivot = v[nth].key;
                assert!(v[..nth].iter().all(|e| e.key >= pivot));
                assert!(v[nth + 1..].iter().all(|e| e.key <= pivot));
            }
        }
    }

    #[test]
    fn streaming_heap_equals_slice_partial_sort() {
        let mut seed = 3;
        for _ in 0..200 {
            let n = 64 + (lcg(&mut seed) % 3000) as usize;
            let k = 1 + (lcg(&mut seed) as usize % (n / 64));
            let bits: Vec<u16> = (0..n).map(|_| (lcg(&mut seed) % 6) as u16 * 0x80).collect();
            let mut q = entries(&bits.iter().map(|&b| key_of(b, 0x7F81)).collect::<Vec<_>>());
            for (e, &b) in q.iter_mut().zip(&bits) {
                e.bits = b;
            }
            partial_sort(&mut q, k);
            let split = (lcg(&mut seed) as usize) % n;
            let (a, b) = bits.split_at(split);
            let mut scratch = TopkScratch::default();
            let got = topk_into(&[a, b], n, Dtype::Bf16, k, &mut scratch);
            assert_eq!(got, &q[..k]);
        }
    }

    #[test]
    fn readme_examples() {
        // README "torch.topk order": all-equal n=64, k=8 (nth_element+sort path).
        let ones = vec![0x3F80u16; 64];
        assert_eq!(
            select_topk(&ones, Dtype::Bf16, 8).unwrap(),
            vec![44, 41, 42, 43, 46, 47, 40, 45]
        );
        // all-equal n=4096, k=8 (partial_sort path).
        let ones = vec![0x3F80u16; 4096];
        assert_eq!(
            select_topk(&ones, Dtype::Bf16, 8).unwrap(),
            vec![7, 4, 1, 3, 5, 0, 2, 6]
        );
    }

    #[test]
    fn nan_and_zero_keys() {
        assert_eq!(key_of(0x8000, 0x7F81), 0);
        assert_eq!(key_of(0xFFFF, 0x7F81), 0x7F81);
        assert_eq!(key_of(0x7FC0, 0x7F81), 0x7F81);
        assert_eq!(key_of(0xFF80, 0x7F81), 0x7F80);
        assert_eq!(key_of(0xFC00, 0x7C01), 0x7C00);
        assert_eq!(key_of(0x7E00, 0x7C01), 0x7C01);
    }
}
