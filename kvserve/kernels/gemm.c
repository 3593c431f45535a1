/* Linear layers over a copy of the float32 weight packed into panels of 16 output
 * columns, panels [n / 16][k][16] (the worker packs it once at load):
 * y[m, n] = x[m, :] . w[n, :] (+ bias), at a few dozen to a few hundred rows
 * (gemm_panels) and at one to eight (gemv_panels).
 *
 * From about a dozen rows on a linear layer is bound by the FMAs, not by streaming its
 * weight. The sums are then computed in register tiles of 6 rows by 16 columns: at each
 * k, two vector loads of the panel's 16 weights and six broadcasts of the rows' inputs
 * feed twelve FMAs into twelve accumulators, the classic AVX2 GEMM micro-kernel (the
 * tile fills the 16 registers). The inputs are first copied into blocks of 6 rows
 * interleaved along k ([m / 6][k][6], the last block's missing rows zero), so that the
 * broadcasts read one contiguous stream.
 *
 * Blocking: rows in groups (group_rows), whose inputs stay in L2 while each panel's slice
 * (from L2) passes over all of the group's row blocks, and k in slices of GEMM_KC (a
 * whole layer's k, for most models: each output tile is then written once). The work
 * items are a row group by GEMM_CHUNK panels (contiguous in memory), taken by whichever
 * thread is free: on a shared host one core can run at a fraction of the other's pace
 * for a while, and a fixed split would leave the faster one waiting. The weight is
 * streamed once per row group. The sizes were chosen by measurement on AVX2 Zen 3.
 *
 * With AVX-512 the tile is 6 rows by four panels (64 columns): at each k four loads of
 * 16 weights and six broadcasts feed 24 FMAs into 24 of the 32 registers, so two FMA
 * units stay busy where the AVX2 tile leaves half of each 512-bit unit idle. Each output
 * is still one chain from the bias over k in order: the same bits as the AVX2 tile.
 *
 * Whether this beats oneDNN's packed GEMM, and up to how many rows, depends on the CPU:
 * it is measured at start (worker/panel_gemm.py). Built without AVX2 and FMA, the same
 * loops run in plain C. */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
#include <omp.h>
#include "step_parts.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define GEMM_MR 6    /* rows of a register tile */
#define GEMM_NR 16   /* columns of a panel and of a tile */
#ifndef GEMM_KC
#define GEMM_KC 1024 /* k of one slice */
#endif
#define GEMM_MC 96   /* fewest rows of one group (a multiple of GEMM_MR) */
#ifndef GEMM_MC_MAX
#define GEMM_MC_MAX 384 /* most rows of one group */
#endif
#define GEMM_CHUNK 4 /* panels of one work item */
#define GEMV_AHEAD 1024 /* bytes of panel fetched ahead by the GEMV of two or more rows */
#define GEMV_AHEAD_512 4096 /* ...and by the AVX-512 GEMV, at every row count */

/* The R (1-6, a constant at each call) rows of a tile over one k slice: c = a . b over
 * kc, plus c's own values (add) or the bias (first slice). a: the block's slice [kc][6];
 * b: the panel's slice [kc][16]. */
static inline __attribute__((always_inline)) void tile(
        const float *a, const float *b, int64_t kc, float *c, int64_t ldc, const int R,
        int add, const float *bias) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 lo[GEMM_MR], hi[GEMM_MR];
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
        lo[i] = add ? _mm256_loadu_ps(c + i * ldc) : b0;
        hi[i] = add ? _mm256_loadu_ps(c + i * ldc + 8) : b1;
    }
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_loadu_ps(b + GEMM_NR * k);
        const __m256 w1 = _mm256_loadu_ps(b + GEMM_NR * k + 8);
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
            const __m256 xi = _mm256_broadcast_ss(a + GEMM_MR * k + i);
            lo[i] = _mm256_fmadd_ps(xi, w0, lo[i]);
            hi[i] = _mm256_fmadd_ps(xi, w1, hi[i]);
        }
    }
    _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
        _mm256_storeu_ps(c + i * ldc, lo[i]);
        _mm256_storeu_ps(c + i * ldc + 8, hi[i]);
    }
#else
    for (int i = 0; i < R; i++)
        for (int j = 0; j < GEMM_NR; j++) {
            float s = add ? c[i * ldc + j] : (bias ? bias[j] : 0.f);
            for (int64_t k = 0; k < kc; k++) s += a[GEMM_MR * k + i] * b[GEMM_NR * k + j];
            c[i * ldc + j] = s;
        }
#endif
}

static void tile_rows(const float *a, const float *b, int64_t kc, float *c, int64_t ldc,
                      int rows, int add, const float *bias) {
    switch (rows) {
    case 6: tile(a, b, kc, c, ldc, 6, add, bias); break;
    case 5: tile(a, b, kc, c, ldc, 5, add, bias); break;
    case 4: tile(a, b, kc, c, ldc, 4, add, bias); break;
    case 3: tile(a, b, kc, c, ldc, 3, add, bias); break;
    case 2: tile(a, b, kc, c, ldc, 2, add, bias); break;
    default: tile(a, b, kc, c, ldc, 1, add, bias);
    }
}

#if defined(__AVX512F__)
#define GEMM_WIDE 4 /* panels of one AVX-512 tile */

/* As tile, over GEMM_WIDE consecutive panels: b is the first panel's slice, the others
 * follow every pstride floats; c and bias cover the 64 columns. */
static inline __attribute__((always_inline)) void tile_wide(
        const float *a, const float *b, int64_t pstride, int64_t kc, float *c, int64_t ldc,
        const int R, int add, const float *bias) {
    __m512 acc[GEMM_MR][GEMM_WIDE];
    _Pragma("GCC unroll 6") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < GEMM_WIDE; j++)
            acc[i][j] = add ? _mm512_loadu_ps(c + i * ldc + GEMM_NR * j)
                            : bias ? _mm512_loadu_ps(bias + GEMM_NR * j) : _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m512 w[GEMM_WIDE];
        _Pragma("GCC unroll 4") for (int j = 0; j < GEMM_WIDE; j++)
            w[j] = _mm512_loadu_ps(b + j * pstride + GEMM_NR * k);
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
            const __m512 xi = _mm512_set1_ps(a[GEMM_MR * k + i]);
            _Pragma("GCC unroll 4") for (int j = 0; j < GEMM_WIDE; j++)
                acc[i][j] = _mm512_fmadd_ps(xi, w[j], acc[i][j]);
        }
    }
    _Pragma("GCC unroll 6") for (int i = 0; i < R; i++)
        _Pragma("GCC unroll 4") for (int j = 0; j < GEMM_WIDE; j++)
            _mm512_storeu_ps(c + i * ldc + GEMM_NR * j, acc[i][j]);
}

static void tile_rows_wide(const float *a, const float *b, int64_t pstride, int64_t kc,
                           float *c, int64_t ldc, int rows, int add, const float *bias) {
    switch (rows) {
    case 6: tile_wide(a, b, pstride, kc, c, ldc, 6, add, bias); break;
    case 5: tile_wide(a, b, pstride, kc, c, ldc, 5, add, bias); break;
    case 4: tile_wide(a, b, pstride, kc, c, ldc, 4, add, bias); break;
    case 3: tile_wide(a, b, pstride, kc, c, ldc, 3, add, bias); break;
    case 2: tile_wide(a, b, pstride, kc, c, ldc, 2, add, bias); break;
    default: tile_wide(a, b, pstride, kc, c, ldc, 1, add, bias);
    }
}
#else
#define GEMM_WIDE 1
#endif

/* Rows of one group: as many as keep the group's inputs for one k slice in half of the
 * core's L2 (the panel slices and the outputs share the rest), a multiple of GEMM_MR
 * within GEMM_MC..GEMM_MC_MAX. Fewer groups stream the weight fewer times. */
static int64_t group_rows(int64_t kc) {
    static long l2 = -1; /* a race writes the same value */
    if (l2 < 0) {
        const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
        l2 = size > 0 ? size : 0;
    }
    const int64_t rows = l2 / 2 / (kc * (int64_t)sizeof(float)) / GEMM_MR * GEMM_MR;
    return rows < GEMM_MC ? GEMM_MC : rows > GEMM_MC_MAX ? GEMM_MC_MAX : rows;
}

/* x [m, k] contiguous; panels as above (n a multiple of 16); bias [n] or NULL; y [m, n].
 * Returns 0, or -1 when the interleaved copy of x could not be allocated. */
int64_t gemm_panels(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                    const float *bias, float *y) {
    const int64_t blocks = (m + GEMM_MR - 1) / GEMM_MR, num_panels = n / GEMM_NR;
    const int64_t group = group_rows(k < GEMM_KC ? k : GEMM_KC) / GEMM_MR;
    float *xi = aligned_alloc(64, sizeof(float) * (size_t)((blocks * GEMM_MR * k + 15) / 16 * 16));
    if (!xi) return -1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            float *dst = xi + blk * GEMM_MR * k;
            for (int64_t i = 0; i < GEMM_MR; i++) {
                const int64_t row = blk * GEMM_MR + i;
                for (int64_t kk = 0; kk < k; kk++)
                    dst[kk * GEMM_MR + i] = row < m ? x[row * k + kk] : 0.f;
            }
        }
        /* the implicit barrier above: every block is written before any is read */
        const int64_t groups = (blocks + group - 1) / group;
        const int64_t chunks = (num_panels + GEMM_CHUNK - 1) / GEMM_CHUNK;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < groups * chunks; item++) {
            const int64_t g0 = item / chunks * group;
            const int64_t g1 = g0 + group < blocks ? g0 + group : blocks;
            const int64_t p0 = item % chunks * GEMM_CHUNK;
            const int64_t p1 = p0 + GEMM_CHUNK < num_panels ? p0 + GEMM_CHUNK : num_panels;
            for (int64_t k0 = 0; k0 < k; k0 += GEMM_KC) {
                const int64_t kc = k - k0 < GEMM_KC ? k - k0 : GEMM_KC;
                for (int64_t p = p0; p < p1;) {
                    const int64_t wide = p1 - p >= GEMM_WIDE ? GEMM_WIDE : 1;
                    const float *slice = panels + (p * k + k0) * GEMM_NR;
                    for (int64_t blk = g0; blk < g1; blk++) {
                        const int64_t left = m - blk * GEMM_MR;
                        const float *a = xi + blk * GEMM_MR * k + k0 * GEMM_MR;
                        float *c = y + blk * GEMM_MR * n + p * GEMM_NR;
                        const int rows = left < GEMM_MR ? (int)left : GEMM_MR;
                        const float *pb = bias ? bias + p * GEMM_NR : 0;
#if defined(__AVX512F__)
                        if (wide > 1) {
                            tile_rows_wide(a, slice, k * GEMM_NR, kc, c, n, rows, k0 > 0, pb);
                            continue;
                        }
#endif
                        tile_rows(a, slice, kc, c, n, rows, k0 > 0, pb);
                    }
                    p += wide;
                }
            }
        }
    }
    free(xi);
    return 0;
}

/* One to eight rows: the layer is a stream over its weight, and each thread's panels
 * are one contiguous run of it, a single stream for the hardware prefetcher (the dense
 * [n][k] weight, read a few rows side by side, is several). Per panel the rows go in
 * register tiles of up to 6 (12 sums of 8 lanes); a second tile of rows reads the panel
 * again from the cache. Up to 3 rows the k loop keeps two sets of sums, even and odd k,
 * so the FMAs' latency never paces a panel that comes from the cache. From two rows on,
 * the work per byte leaves the prefetcher behind and the panel is fetched GEMV_AHEAD
 * bytes ahead; at one row the loop is nothing but loads and runs faster without
 * (measured on AVX2 Zen 3). */
static inline __attribute__((always_inline)) void gemv_tile(
        const float *x, int64_t k, const float *b, float *y, int64_t n, const int R,
        const float *bias) {
#if defined(__AVX512F__)
    /* a panel's 16 columns are one vector: one load and one FMA per row at each k,
     * each lane summing its column in the order the AVX2 loop below does (same bits).
     * Fetched further ahead, and at one row too: on the AVX-512 machine measured
     * (an Intel Xeon) the stream ran faster so at every row count. */
    const int SETS = R <= 3 ? 2 : 1;
    __m512 acc[2][GEMM_MR];
    _Pragma("GCC unroll 6") for (int i = 0; i < R; i++)
        for (int s = 0; s < SETS; s++) acc[s][i] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; kk + SETS <= k; kk += SETS)
        _Pragma("GCC unroll 2") for (int s = 0; s < SETS; s++) {
            _mm_prefetch((const char *)(b + GEMM_NR * (kk + s)) + GEMV_AHEAD_512, _MM_HINT_T0);
            const __m512 w = _mm512_loadu_ps(b + GEMM_NR * (kk + s));
            _Pragma("GCC unroll 6") for (int i = 0; i < R; i++)
                acc[s][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * k + kk + s]), w, acc[s][i]);
        }
    if (kk < k) {
        const __m512 w = _mm512_loadu_ps(b + GEMM_NR * kk);
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++)
            acc[0][i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * k + kk]), w, acc[0][i]);
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
        __m512 v = acc[0][i];
        if (SETS == 2) v = _mm512_add_ps(v, acc[SETS - 1][i]);
        _mm512_storeu_ps(y + i * n, _mm512_add_ps(v, bv));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const int SETS = R <= 3 ? 2 : 1; /* a constant once inlined, as R is */
    __m256 lo[2][GEMM_MR], hi[2][GEMM_MR];
    _Pragma("GCC unroll 6") for (int i = 0; i < R; i++)
        for (int s = 0; s < SETS; s++) lo[s][i] = hi[s][i] = _mm256_setzero_ps();
    int64_t kk = 0;
    for (; kk + SETS <= k; kk += SETS)
        _Pragma("GCC unroll 2") for (int s = 0; s < SETS; s++) {
            if (R >= 2)
                _mm_prefetch((const char *)(b + GEMM_NR * (kk + s)) + GEMV_AHEAD, _MM_HINT_T0);
            const __m256 w0 = _mm256_loadu_ps(b + GEMM_NR * (kk + s));
            const __m256 w1 = _mm256_loadu_ps(b + GEMM_NR * (kk + s) + 8);
            _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
                const __m256 xi = _mm256_broadcast_ss(x + i * k + kk + s);
                lo[s][i] = _mm256_fmadd_ps(xi, w0, lo[s][i]);
                hi[s][i] = _mm256_fmadd_ps(xi, w1, hi[s][i]);
            }
        }
    if (kk < k) { /* an odd k's last element, into the first set */
        const __m256 w0 = _mm256_loadu_ps(b + GEMM_NR * kk);
        const __m256 w1 = _mm256_loadu_ps(b + GEMM_NR * kk + 8);
        _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
            const __m256 xi = _mm256_broadcast_ss(x + i * k + kk);
            lo[0][i] = _mm256_fmadd_ps(xi, w0, lo[0][i]);
            hi[0][i] = _mm256_fmadd_ps(xi, w1, hi[0][i]);
        }
    }
    const __m256 b0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    _Pragma("GCC unroll 6") for (int i = 0; i < R; i++) {
        __m256 l = lo[0][i], h = hi[0][i];
        if (SETS == 2) {
            l = _mm256_add_ps(l, lo[SETS - 1][i]);
            h = _mm256_add_ps(h, hi[SETS - 1][i]);
        }
        _mm256_storeu_ps(y + i * n, _mm256_add_ps(l, b0));
        _mm256_storeu_ps(y + i * n + 8, _mm256_add_ps(h, b1));
    }
#else
    for (int i = 0; i < R; i++)
        for (int j = 0; j < GEMM_NR; j++) {
            float s = 0.f;
            for (int64_t kk = 0; kk < k; kk++) s += x[i * k + kk] * b[GEMM_NR * kk + j];
            y[i * n + j] = bias ? s + bias[j] : s;
        }
#endif
}

/* x [m, k] contiguous, m of 1-8; panels, bias and y as for gemm_panels */
void gemv_panels_part(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                      const float *bias, float *y) {
    const int64_t num_panels = n / GEMM_NR;
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = num_panels * t / threads, last = num_panels * (t + 1) / threads;
    for (int64_t p = first; p < last; p++) {
        const float *b = panels + p * k * GEMM_NR, *pb = bias ? bias + p * GEMM_NR : 0;
        for (int64_t r0 = 0; r0 < m; r0 += GEMM_MR) {
            const float *xr = x + r0 * k;
            float *yr = y + r0 * n + p * GEMM_NR;
            switch (m - r0 < GEMM_MR ? m - r0 : GEMM_MR) {
            case 6: gemv_tile(xr, k, b, yr, n, 6, pb); break;
            case 5: gemv_tile(xr, k, b, yr, n, 5, pb); break;
            case 4: gemv_tile(xr, k, b, yr, n, 4, pb); break;
            case 3: gemv_tile(xr, k, b, yr, n, 3, pb); break;
            case 2: gemv_tile(xr, k, b, yr, n, 2, pb); break;
            default: gemv_tile(xr, k, b, yr, n, 1, pb);
            }
        }
    }
}

void gemv_panels(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                 const float *bias, float *y) {
#pragma omp parallel
    gemv_panels_part(x, m, k, panels, n, bias, y);
}
