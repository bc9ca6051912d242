// A softmax router's top-k on the device, chosen as torch's CPU `topk` chooses it
// (aten/src/ATen/native/TopKImpl.h: (value, index) pairs ordered by libstdc++'s
// std::nth_element then an insertion sort of the first k - 1, or std::partial_sort when
// k * 64 <= n, with comp(x, y) = isnan(x) && !isnan(y) || x > y). Step for step the host's
// port (src/arch/ops.rs: `torch_topk_indices`, module `stl`), so exact ties come out in the
// same order: which expert runs, and the order the top-k are weighted and summed in.
// One thread per row; the row's (value, index) pairs live in the thread's local memory.
#include <stdint.h>

#define ENGY_TOPK_MAX_N 512

struct Pair {
    float v;
    uint32_t i;
};

__device__ __forceinline__ bool comp(const Pair& x, const Pair& y) {
    return (isnan(x.v) && !isnan(y.v)) || x.v > y.v;
}

__device__ __forceinline__ void swap_at(Pair* q, int a, int b) {
    const Pair t = q[a];
    q[a] = q[b];
    q[b] = t;
}

// std::__insertion_sort of q[first, last).
__device__ void insertion_sort(Pair* q, int first, int last) {
    if (first >= last) return;
    for (int i = first + 1; i < last; ++i) {
        const Pair v = q[i];
        if (comp(v, q[first])) {
            for (int j = i; j > first; --j) q[j] = q[j - 1];
            q[first] = v;
        } else {
            int j = i;
            while (comp(v, q[j - 1])) {
                q[j] = q[j - 1];
                --j;
            }
            q[j] = v;
        }
    }
}

__device__ void move_median_to_first(Pair* q, int r, int a, int b, int c) {
    int m;
    if (comp(q[a], q[b])) {
        if (comp(q[b], q[c])) m = b;
        else if (comp(q[a], q[c])) m = c;
        else m = a;
    } else if (comp(q[a], q[c])) m = a;
    else if (comp(q[b], q[c])) m = c;
    else m = b;
    swap_at(q, r, m);
}

__device__ int unguarded_partition(Pair* q, int first, int last, int pivot) {
    for (;;) {
        while (comp(q[first], q[pivot])) ++first;
        --last;
        while (comp(q[pivot], q[last])) --last;
        if (first >= last) return first;
        swap_at(q, first, last);
        ++first;
    }
}

__device__ void adjust_heap(Pair* q, int first, int hole, int len, Pair value) {
    const int top = hole;
    int child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (comp(q[first + child], q[first + child - 1])) --child;
        q[first + hole] = q[first + child];
        hole = child;
    }
    if (len % 2 == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        q[first + hole] = q[first + child - 1];
        hole = child - 1;
    }
    while (hole > top) {
        const int parent = (hole - 1) / 2;
        if (!comp(q[first + parent], value)) break;
        q[first + hole] = q[first + parent];
        hole = parent;
    }
    q[first + hole] = value;
}

__device__ void make_heap(Pair* q, int first, int last) {
    const int len = last - first;
    if (len < 2) return;
    for (int parent = (len - 2) / 2;; --parent) {
        adjust_heap(q, first, parent, len, q[first + parent]);
        if (parent == 0) return;
    }
}

__device__ void pop_heap(Pair* q, int first, int last, int result) {
    const Pair v = q[result];
    q[result] = q[first];
    adjust_heap(q, first, 0, last - first, v);
}

__device__ void heap_select(Pair* q, int first, int middle, int last) {
    make_heap(q, first, middle);
    for (int i = middle; i < last; ++i)
        if (comp(q[i], q[first])) pop_heap(q, first, middle, i);
}

// std::nth_element(q, q + nth, q + n, comp): introselect.
__device__ void nth_element(Pair* q, int n, int nth) {
    int first = 0, last = n;
    int depth = 2 * (31 - __clz(n > 1 ? n : 1));
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(q, first, nth + 1, last);
            swap_at(q, first, nth);
            return;
        }
        --depth;
        const int mid = first + (last - first) / 2;
        move_median_to_first(q, first, first + 1, mid, last - 1);
        const int cut = unguarded_partition(q, first + 1, last, first);
        if (cut <= nth) first = cut;
        else last = cut;
    }
    insertion_sort(q, first, last);
}

// std::partial_sort(q, q + k, q + n, comp).
__device__ void partial_sort(Pair* q, int n, int k) {
    heap_select(q, 0, k, n);
    for (int last = k; last > 1;) {
        --last;
        pop_heap(q, 0, last, last);
    }
}

// probs [rows, n] f32 → idx [rows, k] (torch's top-k order) and val [rows, k] = probs at idx.
// 1 <= k <= n <= ENGY_TOPK_MAX_N (the launcher checks). Grid-stride over rows.
extern "C" __global__ void engy_torch_topk(
    const float* __restrict__ probs, uint32_t rows, uint32_t n, uint32_t k,
    uint32_t* __restrict__ idx, float* __restrict__ val) {
    Pair q[ENGY_TOPK_MAX_N];
    for (size_t r = (size_t)blockIdx.x * blockDim.x + threadIdx.x; r < rows;
         r += (size_t)gridDim.x * blockDim.x) {
        const float* row = probs + r * n;
        for (uint32_t i = 0; i < n; ++i) q[i] = Pair{row[i], i};
        if ((size_t)k * 64 <= n) {
            partial_sort(q, (int)n, (int)k);
        } else {
            nth_element(q, (int)n, (int)k - 1);
            insertion_sort(q, 0, (int)k - 1);
        }
        for (uint32_t j = 0; j < k; ++j) {
            idx[r * k + j] = q[j].i;
            val[r * k + j] = q[j].v;
        }
    }
}
