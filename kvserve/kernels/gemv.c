/* Few-row linear layers at the memory's pace: y[m, n] = x[m, :] . w[n, :] (+ bias[n])
 * for 1-8 rows of x, with w the layer's dense [N, K] float32 weight.
 *
 * At one to eight rows a linear layer is a stream over its weight: every weight element
 * is read once and used for each row. The threads split the output columns; each takes
 * a tile of weight rows at a time and reads them side by side, their sums for every x
 * row held in registers: 16 sums of 16 lanes with AVX-512 (4 weight rows for up to 4 x
 * rows, 2 for up to 8), 8 of 8 lanes with AVX2's 16 registers (4 weight rows for up to
 * 2 x rows, 2 for up to 4, 1 for up to 8).
 * Whether this beats oneDNN's packed GEMM on a layer is measured at start
 * (worker/small_gemm.py, worker/captured_step.py). */
#include <stdint.h>
#include "step_parts.h"
#include "vec_math.h"

#define MAX_ROWS 8

#ifdef __AVX2__
#define SUMS (VEC_LANES == 16 ? 16 : 8) /* accumulators the registers hold */

/* The last k - i elements of each sum, where K is not a multiple of the lanes: kept out
 * of line, since a tile's own epilogue is paid once per few kilobytes of weight. */
static __attribute__((noinline)) void add_tails(
        const float *x, int64_t m, int64_t wt, int64_t k, int64_t i, const float *const *wr,
        float s[][4]) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < wt; j++)
            for (int64_t t = i; t < k; t++) s[r][j] += x[r * k + t] * wr[j][t];
}

/* M x rows against WT weight rows n0.. (nt of them real). M and WT are constants at
 * each call site below, so the loops unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void tile(
        const float *x, const int64_t M, const int64_t WT, int64_t k, const float *w,
        int64_t n0, int64_t nt, const float *bias, float *y, int64_t n) {
    /* from two x rows on, the next tile's rows are fetched while this one's are summed:
     * the weight streams with more reads in flight than the hardware prefetcher keeps.
     * At one row the prefetches only take load slots from a loop that is nothing but
     * loads, and the stream is faster without them (measured on Zen 5). */
    const float *next = M >= 2 && n0 + 2 * WT <= n ? w + (n0 + WT) * k : 0;
    vecf acc[MAX_ROWS][4];
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < WT; j++) acc[r][j] = vec_zero();
    const float *wr[4];
    for (int64_t j = 0; j < WT; j++) wr[j] = w + (n0 + (j < nt ? j : 0)) * k;
    int64_t i = 0;
    for (; i + VEC_LANES <= k; i += VEC_LANES) {
        vecf wv[4];
        for (int64_t j = 0; j < WT; j++) wv[j] = vec_load(wr[j] + i);
        if (next)
            for (int64_t j = 0; j < WT; j++)
                _mm_prefetch((const char *)(next + j * k + i), _MM_HINT_T0);
        for (int64_t r = 0; r < M; r++) {
            const vecf xv = vec_load(x + r * k + i);
            for (int64_t j = 0; j < WT; j++) acc[r][j] = vec_fmadd(xv, wv[j], acc[r][j]);
        }
    }
    if (i < k) { /* rare: the sums through memory, for the tails */
        float s[MAX_ROWS][4];
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < WT; j++) s[r][j] = vec_reduce_add(acc[r][j]);
        add_tails(x, M, WT, k, i, wr, s);
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < WT; j++)
                if (j < nt) y[r * n + n0 + j] = bias ? s[r][j] + bias[n0 + j] : s[r][j];
        return;
    }
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < WT; j++) {
            const float v = vec_reduce_add(acc[r][j]);
            if (j < nt) y[r * n + n0 + j] = bias ? v + bias[n0 + j] : v;
        }
}

/* the widest tile of weight rows whose sums for m x rows fit the registers */
static inline int64_t tile_width(int64_t m) {
    const int64_t wt = SUMS / m;
    return wt >= 4 ? 4 : wt >= 2 ? 2 : 1;
}

#define TILE_CASE(M)                                                              \
    case M:                                                                       \
        if (wt == 4) tile(xr, M, 4, k, w, n0, nt, bias, yr, n);                   \
        else if (wt == 2) tile(xr, M, 2, k, w, n0, nt, bias, yr, n);              \
        else tile(xr, M, 1, k, w, n0, nt, bias, yr, n);                           \
        break;

/* rows r0..r0+m (m <= MAX_ROWS) over every output column, the threads splitting them */
static void row_group(const float *xr, int64_t m, int64_t k, const float *w, int64_t n,
                      const float *bias, float *yr) {
    const int64_t wt = tile_width(m), tiles = (n + wt - 1) / wt;
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * wt, nt = n - n0 < wt ? n - n0 : wt;
        switch (m) {
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
            TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
        }
    }
}
#endif

void gemv_rows_part(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                    const float *bias, float *y) {
#ifdef __AVX2__
    for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS)
        row_group(x + r0 * k, m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS, k, w, n, bias,
                  y + r0 * n);
#else
#pragma omp for schedule(static) nowait
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < m; r++) {
            float s = 0.f;
            for (int64_t t = 0; t < k; t++) s += x[r * k + t] * w[j * k + t];
            y[r * n + j] = bias ? s + bias[j] : s;
        }
#endif
}

void gemv_rows(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
               const float *bias, float *y) {
#pragma omp parallel
    gemv_rows_part(x, m, k, w, n, bias, y);
}
