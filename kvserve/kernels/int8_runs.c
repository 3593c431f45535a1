/* int8 x int8 -> int32 sums (W8A8 linear layers) on weights kept in runs of eight rows,
 * for CPUs with AVX-512 VNNI: every vpdpbusd takes a whole 64-byte load of weights, with
 * no per-row reduction in the loop and no sign tricks, so a step of several rows costs
 * about what one row does until the multiplications, not the weight read, bound it.
 *
 * Layout of the runs (int8_pack_runs): the weight's rows in runs of eight (the last run
 * repeats its last row); within a run, for each 8 columns c, the 8 rows' bytes
 * w[row][c..c+7] one after the other: 64 bytes, one vector. Broadcasting x[c..c+7] to
 * every 64-bit lane pairs it with each row's 8 bytes, so 32-bit lane 2i sums row i's
 * columns c..c+3 and lane 2i+1 its columns c+4..c+7.
 *
 * vpdpbusd multiplies unsigned by signed bytes: x is taken as x + 128 (x ^ 0x80), and
 * 128 times each weight row's sum (kept beside the runs) is subtracted at the end. The
 * sums are exact int32 (torch._int_mm's values) for any int8 x and w while
 * k <= INT8_RUNS_MAX_K: a lane sums k / 2 products of at most 255 * 128.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "row_runs.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define RUN_ROWS 8
#define INT8_RUNS_MAX_K 16384
#define RUNS_PREFETCH_BYTES 2048

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define INT8_RUNS_KERNEL 1
#endif

/* runs [ceil(n / 8), k / 8, 8, 8] int8 and row_sums [n] from w [n, k]; 1 (nothing
 * written) where this build has no kernel for the runs or k is not a multiple of 8 up to
 * INT8_RUNS_MAX_K; 0 when packed. */
int64_t int8_pack_runs(const int8_t *w, int64_t n, int64_t k, int8_t *runs,
                       int32_t *row_sums) {
#ifndef INT8_RUNS_KERNEL
    (void)w, (void)n, (void)k, (void)runs, (void)row_sums;
    return 1;
#else
    if (k % 8 || k > INT8_RUNS_MAX_K || n < 1) return 1;
    pack_row_runs((const uint8_t *)w, n, k, RUN_ROWS, 8, (uint8_t *)runs);
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < n; row++) {
        int32_t sum = 0;
        for (int64_t c = 0; c < k; c++) sum += w[row * k + c];
        row_sums[row] = sum;
    }
    return 0;
#endif
}

#ifdef INT8_RUNS_KERNEL
/* Sums of nx rows of xu (x + 128, k bytes apart) with nw runs (1 or 2) from w (runs
 * k * 8 bytes apart): out[r * 16 + 8 b + i] = row r . row i of run b, before the
 * 128 * row-sum correction. nx and nw are constants where it is inlined. */
static inline __attribute__((always_inline)) void runs_tile(
    const uint8_t *xu, int nx, int64_t k, const int8_t *w, int nw, int prefetch,
    int32_t *out) {
    __m512i s[2][8];
    for (int b = 0; b < nw; b++)
        for (int r = 0; r < nx; r++) s[b][r] = _mm512_setzero_si512();
    const int64_t run_bytes = k * RUN_ROWS;
    for (int64_t c = 0; c < k; c += 8) {
        __m512i wv[2];
        for (int b = 0; b < nw; b++) {
            const int8_t *p = w + b * run_bytes + c * RUN_ROWS;
            if (prefetch) _mm_prefetch((const char *)(p + RUNS_PREFETCH_BYTES), _MM_HINT_T0);
            wv[b] = _mm512_loadu_si512(p);
        }
        for (int r = 0; r < nx; r++) {
            int64_t bits;
            memcpy(&bits, xu + r * k + c, 8);
            const __m512i xv = _mm512_set1_epi64(bits);
            for (int b = 0; b < nw; b++) s[b][r] = _mm512_dpbusd_epi32(s[b][r], xv, wv[b]);
        }
    }
    for (int b = 0; b < nw; b++)
        for (int r = 0; r < nx; r++) {
            /* lane 2i + lane 2i+1, the even lanes gathered into the low eight */
            const __m512i pairs = _mm512_add_epi32(
                s[b][r], _mm512_shuffle_epi32(s[b][r], _MM_PERM_CDAB));
            _mm256_storeu_si256((__m256i *)(out + r * 16 + 8 * b),
                                _mm512_castsi512_si256(_mm512_maskz_compress_epi32(
                                    0x5555, pairs)));
        }
}

/* nx, nw and prefetch constants in each case: one loop of its own each, no branch in it
 * (with the prefetch's branch left in, GCC copies the sums between two register sets
 * every step) */
#define RUNS_TILE_CASE(NX)                                                       \
    case NX:                                                                     \
        if (nw == 2 && prefetch) runs_tile(xu, NX, k, w, 2, 1, out);             \
        else if (nw == 2) runs_tile(xu, NX, k, w, 2, 0, out);                    \
        else if (prefetch) runs_tile(xu, NX, k, w, 1, 1, out);                   \
        else runs_tile(xu, NX, k, w, 1, 0, out);                                 \
        break;

static void runs_tile_any(const uint8_t *xu, int nx, int64_t k, const int8_t *w, int nw,
                          int prefetch, int32_t *out) {
    switch (nx) {
        RUNS_TILE_CASE(1) RUNS_TILE_CASE(2) RUNS_TILE_CASE(3) RUNS_TILE_CASE(4)
        RUNS_TILE_CASE(5) RUNS_TILE_CASE(6) RUNS_TILE_CASE(7) RUNS_TILE_CASE(8)
    }
}
#endif

/* acc [m, n] int32 = x [m, k] int8 @ w [n, k] transposed, from w's runs and row sums
 * (int8_pack_runs). Threads split the runs, two at a time; each pair is multiplied with
 * eight rows of x at a time (their sums stay in sixteen registers), so in a step of a few
 * rows each weight run is read from memory once and from cache for the later rows. A
 * long chunk goes in blocks of rows that stay in the cache (X_BLOCK_BYTES of x) while
 * every run passes them. 1 where this build has no kernel for the runs, -1 without
 * memory for x + 128, else 0. */
#define X_BLOCK_BYTES (256 * 1024)
int64_t int8_runs_matmul(const int8_t *x, int64_t m, int64_t k, const int8_t *runs,
                         const int32_t *row_sums, int64_t n, int32_t *acc) {
#ifndef INT8_RUNS_KERNEL
    (void)x, (void)m, (void)k, (void)runs, (void)row_sums, (void)n, (void)acc;
    return 1;
#else
    if (k % 8 || k > INT8_RUNS_MAX_K) return 1;
    uint8_t *xu = malloc((size_t)(m * k));
    if (!xu) return -1;
    for (int64_t t = 0; t < m * k; t++) xu[t] = (uint8_t)x[t] ^ 0x80;
    const int64_t num_runs = (n + RUN_ROWS - 1) / RUN_ROWS;
    const int64_t run_bytes = k * RUN_ROWS;
    const int64_t block = X_BLOCK_BYTES / k / 8 * 8 > 8 ? X_BLOCK_BYTES / k / 8 * 8 : 8;
#pragma omp parallel
    for (int64_t b0 = 0; b0 < m; b0 += block) {
        const int64_t b1 = b0 + block < m ? b0 + block : m;
#pragma omp for schedule(static) nowait
        for (int64_t pair = 0; pair < (num_runs + 1) / 2; pair++) {
            const int64_t run = 2 * pair;
            const int nw = run + 1 < num_runs ? 2 : 1;
            const int8_t *w = runs + run * run_bytes;
            for (int64_t r0 = b0; r0 < b1; r0 += 8) {
                const int nx = b1 - r0 < 8 ? (int)(b1 - r0) : 8;
                int32_t out[8 * 16];
                runs_tile_any(xu + r0 * k, nx, k, w, nw, r0 == b0, out);
                for (int r = 0; r < nx; r++)
                    for (int i = 0; i < RUN_ROWS * nw; i++) {
                        const int64_t j = run * RUN_ROWS + i;
                        if (j < n) acc[(r0 + r) * n + j] = out[r * 16 + i] - 128 * row_sums[j];
                    }
            }
        }
    }
    free(xu);
    return 0;
#endif
}
