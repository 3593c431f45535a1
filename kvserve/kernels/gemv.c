/* Few-row linear layers at the memory's pace: y[m, n] = x[m, :] . w[n, :] (+ bias[n])
 * for 1-4 rows of x, with w the layer's dense [N, K] float32 weight.
 *
 * At one to four rows a linear layer is a stream over its weight: every weight element
 * is read once and used for each row. The threads split the output columns; each takes
 * W_TILE weight rows at a time and reads them side by side, their sums for every x row
 * held in registers (4 x 4 of 16 lanes with AVX-512, 4 x 2 of 8 with AVX2's 16
 * registers). Whether this beats oneDNN's packed GEMM on a layer is measured at start
 * (worker/small_gemm.py). */
#include <stdint.h>
#include "vec_math.h"

#define MAX_ROWS 4

#ifdef __AVX2__
#if VEC_LANES == 16
#define W_TILE 4
#else
#define W_TILE 2
#endif

static inline void tile(const float *x, int64_t m, int64_t k, const float *w, int64_t n0,
                        int64_t nt, const float *bias, float *y, int64_t n) {
    /* the next tile's rows are fetched while this one's are summed: the weight streams
     * from memory with more reads in flight than the hardware prefetcher keeps */
    const float *next = n0 + 2 * W_TILE <= n ? w + (n0 + W_TILE) * k : 0;
    vecf acc[MAX_ROWS][W_TILE];
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < W_TILE; j++) acc[r][j] = vec_zero();
    const float *wr[W_TILE];
    for (int64_t j = 0; j < W_TILE; j++) wr[j] = w + (n0 + (j < nt ? j : 0)) * k;
    int64_t i = 0;
    for (; i + VEC_LANES <= k; i += VEC_LANES) {
        vecf wv[W_TILE];
        for (int64_t j = 0; j < W_TILE; j++) wv[j] = vec_load(wr[j] + i);
        if (next)
            for (int64_t j = 0; j < W_TILE; j++)
                _mm_prefetch((const char *)(next + j * k + i), _MM_HINT_T0);
        for (int64_t r = 0; r < m; r++) {
            const vecf xv = vec_load(x + r * k + i);
            for (int64_t j = 0; j < W_TILE; j++) acc[r][j] = vec_fmadd(xv, wv[j], acc[r][j]);
        }
    }
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < nt; j++) {
            float s = vec_reduce_add(acc[r][j]);
            for (int64_t t = i; t < k; t++) s += x[r * k + t] * wr[j][t];
            y[r * n + n0 + j] = bias ? s + bias[n0 + j] : s;
        }
}
#endif

void gemv_rows(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
               const float *bias, float *y) {
#ifdef __AVX2__
    const int64_t tiles = (n + W_TILE - 1) / W_TILE;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * W_TILE, nt = n - n0 < W_TILE ? n - n0 : W_TILE;
        for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS)
            tile(x + r0 * k, m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS, k, w, n0, nt, bias,
                 y + r0 * n, n);
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t r = 0; r < m; r++) {
            float s = 0.f;
            for (int64_t t = 0; t < k; t++) s += x[r * k + t] * w[j * k + t];
            y[r * n + j] = bias ? s + bias[j] : s;
        }
#endif
}
