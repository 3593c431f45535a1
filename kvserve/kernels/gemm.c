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
 * Blocking: k in slices of GEMM_KC (a whole layer's k, for most models: each output tile
 * is then written once), and rows in groups of GEMM_MC, whose inputs stay in L2 while
 * each panel's slice (at most 64 KiB, also from L2) passes over all of the group's row
 * blocks. The threads split the panels; a thread's panels are contiguous in memory, so
 * it streams its part of the weight once per row group. The sizes were chosen by
 * measurement on AVX2 Zen 3 (docs/performance-avx2.md).
 *
 * Whether this beats oneDNN's packed GEMM, and up to how many rows, depends on the CPU:
 * it is measured at start (worker/panel_gemm.py). The tile is AVX2's; built without AVX2
 * and FMA, the same loops run in plain C. */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define GEMM_MR 6    /* rows of a register tile */
#define GEMM_NR 16   /* columns of a panel and of a tile */
#define GEMM_KC 1024 /* k of one slice */
#define GEMM_MC 96   /* rows of one group (a multiple of GEMM_MR) */
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

/* x [m, k] contiguous; panels as above (n a multiple of 16); bias [n] or NULL; y [m, n].
 * Returns 0, or -1 when the interleaved copy of x could not be allocated. */
int64_t gemm_panels(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                    const float *bias, float *y) {
    const int64_t blocks = (m + GEMM_MR - 1) / GEMM_MR, num_panels = n / GEMM_NR;
    const int64_t group = GEMM_MC / GEMM_MR;
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
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t first = num_panels * t / threads, last = num_panels * (t + 1) / threads;
        for (int64_t k0 = 0; k0 < k; k0 += GEMM_KC) {
            const int64_t kc = k - k0 < GEMM_KC ? k - k0 : GEMM_KC;
            for (int64_t g0 = 0; g0 < blocks; g0 += group) {
                const int64_t g1 = g0 + group < blocks ? g0 + group : blocks;
                for (int64_t p = first; p < last; p++) {
                    const float *slice = panels + (p * k + k0) * GEMM_NR;
                    for (int64_t blk = g0; blk < g1; blk++) {
                        const int64_t left = m - blk * GEMM_MR;
                        tile_rows(xi + blk * GEMM_MR * k + k0 * GEMM_MR, slice, kc,
                                  y + blk * GEMM_MR * n + p * GEMM_NR, n,
                                  left < GEMM_MR ? (int)left : GEMM_MR, k0 > 0,
                                  bias ? bias + p * GEMM_NR : 0);
                    }
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
 * (measured on AVX2 Zen 3, docs/performance-avx2.md). */
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
void gemv_panels(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                 const float *bias, float *y) {
    const int64_t num_panels = n / GEMM_NR;
#pragma omp parallel
    {
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
}
