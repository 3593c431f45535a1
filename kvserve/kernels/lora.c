/* LoRA adapters' products, every row of a step in one call (kvserve/lora/layers.py).
 *
 * Row t reads slot s = slots[t] (-1: no adapter, the row is left as it is). A slot's
 * A stack holds each output slice's A in max_rank rows ([slices * max_rank, in]); its
 * B stack the same rows over the output columns, each slice's under its own columns
 * only. Only the slot's first ranks[s] rows of each slice are read: the padding up to
 * max_rank is skipped. out[t] += B_i^T (A_i x[t]) over the slices i.
 *
 * Rows are grouped by slot, so each adapter's weights are read once a call however many
 * rows use it (as punica's grouped kernels do on GPUs): the shrink splits the A rows of
 * every slot over the threads, each A row applied to all of its slot's rows; the expand
 * splits the output columns into blocks, and each of the slot's rows sums its products
 * over a block's columns in registers, chunk by chunk, reading the block's B rows from
 * the L1 cache (adding into the output row by row instead would store and reload it at
 * every rank, at strides of whole pages that alias in the cache).
 * ``shrunk`` [rows, slices * max_rank] is the caller's scratch. B's rows are
 * ``b_stride`` floats apart: padded past the output width so that a block's rows do not
 * all fall in the same cache sets (as rows a power of two apart would).
 */
#include <stdint.h>
#include <stdlib.h>

#include "vec_math.h"

#define MAX_LORA_SLOTS 256
#define COLUMN_BLOCK 256 /* output columns a thread's expand task covers */

/* the dot products of the A row ``a`` with the rows x0..x3 (n each) into out0..out3:
 * four independent sums, so the FMAs do not wait on each other */
static inline void dot4(const float *a, const float *x0, const float *x1, const float *x2,
                        const float *x3, int64_t n, float *out0, float *out1, float *out2,
                        float *out3) {
    int64_t i = 0;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#ifdef VEC_LANES
    vecf acc0 = vec_zero(), acc1 = vec_zero(), acc2 = vec_zero(), acc3 = vec_zero();
    for (; i + VEC_LANES <= n; i += VEC_LANES) {
        const vecf av = vec_load(a + i);
        acc0 = vec_fmadd(av, vec_load(x0 + i), acc0);
        acc1 = vec_fmadd(av, vec_load(x1 + i), acc1);
        acc2 = vec_fmadd(av, vec_load(x2 + i), acc2);
        acc3 = vec_fmadd(av, vec_load(x3 + i), acc3);
    }
    s0 = vec_reduce_add(acc0), s1 = vec_reduce_add(acc1);
    s2 = vec_reduce_add(acc2), s3 = vec_reduce_add(acc3);
#endif
    for (; i < n; i++) {
        s0 += a[i] * x0[i], s1 += a[i] * x1[i], s2 += a[i] * x2[i], s3 += a[i] * x3[i];
    }
    *out0 = s0, *out1 = s1, *out2 = s2, *out3 = s3;
}

#define CHUNK 64 /* output columns one row accumulates in registers */

/* y[0..n) += sum_k c[k] * w[k * stride + 0..n) for k < r, n <= CHUNK: y read and written
 * once, its sums kept in registers over the rank */
static inline void expand_chunk(const float *c, int64_t r, const float *w, int64_t stride,
                                float *y, int64_t n) {
#ifdef VEC_LANES
    if (n == CHUNK) {
        vecf acc[CHUNK / VEC_LANES];
        for (int v = 0; v < CHUNK / VEC_LANES; v++) acc[v] = vec_load(y + v * VEC_LANES);
        for (int64_t k = 0; k < r; k++) {
            const vecf ck = vec_set1(c[k]);
            const float *wk = w + k * stride;
            for (int v = 0; v < CHUNK / VEC_LANES; v++)
                acc[v] = vec_fmadd(ck, vec_load(wk + v * VEC_LANES), acc[v]);
        }
        for (int v = 0; v < CHUNK / VEC_LANES; v++) vec_store(y + v * VEC_LANES, acc[v]);
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
        float sum = y[j];
        for (int64_t k = 0; k < r; k++) sum += c[k] * w[k * stride + j];
        y[j] = sum;
    }
}

int64_t lora_rows(const float *x, int64_t rows, int64_t in_dim, const int64_t *slots,
                  int64_t num_slots, const float *a, const float *b, int64_t b_stride,
                  const int64_t *ranks, int64_t max_rank, const int64_t *bounds,
                  int64_t num_slices, float *shrunk, float *out) {
    const int64_t width = num_slices * max_rank, out_dim = bounds[num_slices];
    if (num_slots > MAX_LORA_SLOTS) return -1;
    /* the rows of each slot, by counting */
    int64_t first[MAX_LORA_SLOTS + 1] = {0};
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] >= 0 && slots[t] < num_slots) first[slots[t] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) first[s + 1] += first[s];
    int64_t *order = malloc(sizeof(int64_t) * (first[num_slots] ? first[num_slots] : 1));
    if (!order) return -2;
    int64_t fill[MAX_LORA_SLOTS];
    for (int64_t s = 0; s < num_slots; s++) fill[s] = first[s];
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] >= 0 && slots[t] < num_slots) order[fill[slots[t]]++] = t;
    /* tasks: (slot, A row) for the shrink, (slot, column block) for the expand */
    const int64_t shrink_tasks = num_slots * width;
    const int64_t blocks = (out_dim + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < shrink_tasks; task++) {
            const int64_t s = task / width, row = task % width;
            if (first[s] == first[s + 1] || row % max_rank >= ranks[s]) continue;
            const float *ar = a + (s * width + row) * in_dim;
            for (int64_t i = first[s]; i < first[s + 1]; i += 4) {
                /* up to four of the slot's rows at once (a short group repeats its last) */
                int64_t t[4];
                for (int q = 0; q < 4; q++)
                    t[q] = order[i + q < first[s + 1] ? i + q : first[s + 1] - 1];
                dot4(ar, x + t[0] * in_dim, x + t[1] * in_dim, x + t[2] * in_dim,
                     x + t[3] * in_dim, in_dim, shrunk + t[0] * width + row,
                     shrunk + t[1] * width + row, shrunk + t[2] * width + row,
                     shrunk + t[3] * width + row);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_slots * blocks; task++) {
            const int64_t s = task / blocks, j0 = (task % blocks) * COLUMN_BLOCK;
            const int64_t j1 = j0 + COLUMN_BLOCK < out_dim ? j0 + COLUMN_BLOCK : out_dim;
            if (first[s] == first[s + 1]) continue;
            for (int64_t sl = 0; sl < num_slices; sl++) {
                const int64_t lo = bounds[sl] > j0 ? bounds[sl] : j0;
                const int64_t hi = bounds[sl + 1] < j1 ? bounds[sl + 1] : j1;
                if (lo >= hi) continue;
                const float *bs = b + (s * width + sl * max_rank) * b_stride;
                for (int64_t i = first[s]; i < first[s + 1]; i++) {
                    const int64_t t = order[i];
                    const float *c = shrunk + t * width + sl * max_rank;
                    for (int64_t c0 = lo; c0 < hi; c0 += CHUNK)
                        expand_chunk(c, ranks[s], bs + c0, b_stride, out + t * out_dim + c0,
                                     hi - c0 < CHUNK ? hi - c0 : CHUNK);
                }
            }
        }
    }
    free(order);
    return 0;
}
