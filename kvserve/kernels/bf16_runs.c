/* bfloat16 weights against a few bfloat16 rows (decode steps of a bf16 model), on
 * weights kept in runs of sixteen rows, for CPUs with AVX512-BF16: every vdpbf16ps takes
 * a whole 64-byte load of weights and leaves each row's sum in its own lane, so a step
 * of several rows reads each weight once and costs about what one row does until the
 * multiplications bound it.
 *
 * Layout of the runs (bf16_pack_runs): the weight's rows in runs of sixteen (the last run
 * repeats its last row); within a run, for each pair of columns c, c+1, the 16 rows'
 * two values one row after the other: 64 bytes, one vector. Broadcasting x[c], x[c+1] to
 * every 32-bit lane, vdpbf16ps adds row i's two products into lane i.
 *
 * Each product of two bfloat16 values is exact in float32; the sums are float32, in
 * column order two at a time, so a row's result does not depend on the other rows of the
 * step. The outputs are rounded to bfloat16 (nearest even) after the bias (float32) is
 * added, as oneDNN's bf16 GEMM rounds its float32 sums; a GGUF BF16 layer's (format
 * BF16_X16, gguf_linear.c) stay float32, as llama.cpp keeps them.
 */
#include <stdint.h>
#include <string.h>
#include "row_runs.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define BF16_RUN_ROWS 16
#define BF16_RUNS_PREFETCH_BYTES 2048
#define BF16_RUNS_X_ROWS 64 /* the rows of x each run is read from memory for */


/* runs [ceil(n / 16), k / 2, 16, 2] bfloat16 (as uint16) from w [n, k]; 1 (nothing
 * written) where this build has no kernel for the runs or k is odd, else 0. */
int64_t bf16_pack_runs(const uint16_t *w, int64_t n, int64_t k, uint16_t *runs) {
#ifndef BF16_RUNS_KERNEL
    (void)w, (void)n, (void)k, (void)runs;
    return 1;
#else
    if (k % 2 || n < 1) return 1;
    pack_row_runs((const uint8_t *)w, n, 2 * k, BF16_RUN_ROWS, 4, (uint8_t *)runs);
    return 0;
#endif
}

#ifdef BF16_RUNS_KERNEL
/* The float32 sums of nx rows of x (x_stride values apart) with nw runs (1 or 2) from w
 * (runs 16 k values apart): s[b][r] lane i = row r . row i of run b. The sums stay in
 * registers (acc) until the end: summed into s, the compiler stores them every step. */
static inline __attribute__((always_inline)) void bf16_runs_tile(
    const uint16_t *x, int64_t x_stride, int nx, int64_t k, const uint16_t *w, int nw,
    int prefetch, __m512 s[2][8]) {
    __m512 acc[2][8];
    for (int b = 0; b < nw; b++)
        for (int r = 0; r < nx; r++) acc[b][r] = _mm512_setzero_ps();
    const int64_t run_values = k * BF16_RUN_ROWS;
    for (int64_t c = 0; c < k; c += 2) {
        __m512bh wv[2];
        for (int b = 0; b < nw; b++) {
            const uint16_t *p = w + b * run_values + c * BF16_RUN_ROWS;
            if (prefetch)
                _mm_prefetch((const char *)p + BF16_RUNS_PREFETCH_BYTES, _MM_HINT_T0);
            wv[b] = (__m512bh)_mm512_loadu_si512(p);
        }
        for (int r = 0; r < nx; r++) {
            int32_t pair;
            memcpy(&pair, x + r * x_stride + c, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < nw; b++) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], xv, wv[b]);
        }
    }
    for (int b = 0; b < nw; b++)
        for (int r = 0; r < nx; r++) s[b][r] = acc[b][r];
}

/* nx, nw and prefetch constants in each case: one loop of its own each, no branch in it */
#define BF16_TILE_CASE(NX)                                                        \
    case NX:                                                                      \
        if (nw == 2 && prefetch) bf16_runs_tile(x, x_stride, NX, k, w, 2, 1, s);  \
        else if (nw == 2) bf16_runs_tile(x, x_stride, NX, k, w, 2, 0, s);         \
        else if (prefetch) bf16_runs_tile(x, x_stride, NX, k, w, 1, 1, s);        \
        else bf16_runs_tile(x, x_stride, NX, k, w, 1, 0, s);                      \
        break;

static void bf16_runs_tile_any(const uint16_t *x, int64_t x_stride, int nx, int64_t k,
                               const uint16_t *w, int nw, int prefetch, __m512 s[2][8]) {
    switch (nx) {
        BF16_TILE_CASE(1) BF16_TILE_CASE(2) BF16_TILE_CASE(3) BF16_TILE_CASE(4)
        BF16_TILE_CASE(5) BF16_TILE_CASE(6) BF16_TILE_CASE(7) BF16_TILE_CASE(8)
    }
}

/* y's rows first..end - 1 (see bf16_runs_share) against the pair of runs from `run` on
 * (the last run alone where the count is odd), eight rows of x at a time; the runs are
 * prefetched on the first eight. */
static void bf16_runs_pair(const uint16_t *x, int64_t x_stride, int64_t first, int64_t end,
                           int64_t k, const uint16_t *runs, int64_t run, int64_t n,
                           const float *bias, uint16_t *y_bf16, float *y_f32,
                           int64_t y_stride) {
    const int64_t num_runs = (n + BF16_RUN_ROWS - 1) / BF16_RUN_ROWS;
    const int nw = run + 1 < num_runs ? 2 : 1;
    const uint16_t *w = runs + run * k * BF16_RUN_ROWS;
    for (int64_t r0 = first; r0 < end; r0 += 8) {
        const int nx = end - r0 < 8 ? (int)(end - r0) : 8;
        __m512 s[2][8];
        bf16_runs_tile_any(x + r0 * x_stride, x_stride, nx, k, w, nw, r0 == first, s);
        for (int b = 0; b < nw; b++) {
            const int64_t j0 = (run + b) * BF16_RUN_ROWS;
            const int valid = n - j0 < BF16_RUN_ROWS ? (int)(n - j0) : BF16_RUN_ROWS;
            const __mmask16 keep = (__mmask16)((1u << valid) - 1);
            const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias + j0)
                                    : _mm512_setzero_ps();
            for (int r = 0; r < nx; r++) {
                const __m512 sums = _mm512_add_ps(s[b][r], add);
                if (y_f32) {
                    _mm512_mask_storeu_ps(y_f32 + (r0 + r) * y_stride + j0, keep, sums);
                } else {
                    const __m256bh out = _mm512_cvtneps_pbh(sums);
                    _mm256_mask_storeu_epi16(y_bf16 + (r0 + r) * y_stride + j0, keep,
                                             (__m256i)out);
                }
            }
        }
    }
}

/* The threads' shares of y [m, n] = x [m, k] bfloat16 (rows x_stride values apart) @ w
 * [n, k] transposed (+ bias [n] float32 where given), from w's runs (bf16_pack_runs):
 * BF16_RUNS_X_ROWS rows of x at a time (a prompt chunk's block stays in cache while the
 * weight streams past it), an orphaned `omp for` over the runs, two at a time. y is
 * float32 where y_f32 is given, else bfloat16 (y_bf16), rows y_stride apart. */
static void bf16_runs_share(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                            const uint16_t *runs, int64_t n, const float *bias,
                            uint16_t *y_bf16, float *y_f32, int64_t y_stride) {
    const int64_t pairs = ((n + BF16_RUN_ROWS - 1) / BF16_RUN_ROWS + 1) / 2;
    for (int64_t first = 0; first < m; first += BF16_RUNS_X_ROWS) {
        const int64_t end = first + BF16_RUNS_X_ROWS < m ? first + BF16_RUNS_X_ROWS : m;
#pragma omp for schedule(static) nowait
        for (int64_t pair = 0; pair < pairs; pair++)
            bf16_runs_pair(x, x_stride, first, end, k, runs, 2 * pair, n, bias, y_bf16,
                           y_f32, y_stride);
    }
}
#endif

/* y [m, n] bfloat16 (rows y_stride apart) = x [m, k] bfloat16 @ w [n, k] transposed
 * (+ bias [n] float32 where given), from w's runs (bf16_pack_runs), the float32 sums
 * rounded to bfloat16 once, after the bias. 1 where this build has no kernel for the
 * runs, else 0. */
int64_t bf16_runs_matmul(const uint16_t *x, int64_t m, int64_t k, const uint16_t *runs,
                         int64_t n, const float *bias, uint16_t *y, int64_t y_stride) {
#ifndef BF16_RUNS_KERNEL
    (void)x, (void)m, (void)k, (void)runs, (void)n, (void)bias, (void)y, (void)y_stride;
    return 1;
#else
    if (k % 2) return 1;
#pragma omp parallel
    bf16_runs_share(x, k, m, k, runs, n, bias, y, NULL, y_stride);
    return 0;
#endif
}

/* step_parts.h: the float32 sums y[r * y_stride + j] (j < n) of x's rows (x_stride
 * values apart) with w's runs, the calling thread's share; 1 (nothing written) where
 * this build has no kernel for the runs. */
int64_t bf16_runs_rows_part(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                            const uint16_t *runs, int64_t n, float *y, int64_t y_stride) {
#ifndef BF16_RUNS_KERNEL
    (void)x, (void)x_stride, (void)m, (void)k, (void)runs, (void)n, (void)y, (void)y_stride;
    return 1;
#else
    if (k % 2) return 1;
    bf16_runs_share(x, x_stride, m, k, runs, n, NULL, NULL, y, y_stride);
    return 0;
#endif
}
