/* BF16 weights against activation rows rounded to bfloat16, as llama.cpp multiplies a
 * BF16 tensor (its activations become BF16 too): each product of two bfloat16 values is
 * exact in float32, and the products are summed in float32. Included by gguf_linear.c,
 * after gguf_float_rows.h.
 *
 * The rows are rounded to nearest even (NaN kept a quiet NaN), the same on every build.
 * With AVX512-BF16 they are kept packed, two bytes a value, and vdpbf16ps takes 32
 * products an instruction; elsewhere each rounded value is kept as a float32 and the
 * 16-bit float kernels (row_16bit, row_buffered) widen the weights and sum with FMAs:
 * the same products, summed in another order. Either way a row's values start k floats
 * after the last row's (rows_from's stride). */

/* x [count] rounded to bfloat16: the 16 bits of each */
static inline uint16_t bf16_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 64);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* One row's k values of x rounded into out: packed bfloat16 with AVX512-BF16, else
 * float32 holding the rounded values */
static void round_row_bf16(const float *x, int64_t k, float *out) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    uint16_t *packed = (uint16_t *)out;
#pragma omp simd
    for (int64_t i = 0; i < k; i++) packed[i] = bf16_bits(x[i]);
#else
#pragma omp simd
    for (int64_t i = 0; i < k; i++) {
        const uint32_t u = (uint32_t)bf16_bits(x[i]) << 16;
        memcpy(out + i, &u, 4);
    }
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define BF16_TILES 1
static inline __m512bh bf16_load(const void *p) {
    return (__m512bh)_mm512_loadu_si512(p);
}

/* The products of nx x rows (x[0..nx-1]: packed, k values; nx 1 or 4) with four BF16
 * weight rows (w[0..3]): out[4 a + b] = x_a . w_b. Every pair is summed in one order,
 * whatever the tile: one sum of 16 lanes, 32 values a step, then its lanes added. So a
 * row's products are the same bits in a decode step as in a prompt chunk's tiles. Four
 * by four keeps sixteen sums in flight and loads 8 vectors for 16 vdpbf16ps (a prompt's
 * rows are bound by them); one row by four, four sums, enough for a read from memory. */
static inline __attribute__((always_inline)) void bf16_tile(
    const uint16_t *const *x, int nx, const uint8_t *const *w, int64_t k, int prefetch,
    float *out) {
    __m512 s[16];
    for (int p = 0; p < 4 * nx; p++) s[p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        if (prefetch)
            for (int b = 0; b < 4; b++)
                _mm_prefetch((const char *)(w[b] + 2 * i + PREFETCH_BYTES), _MM_HINT_T0);
        __m512bh wv[4];
        for (int b = 0; b < 4; b++) wv[b] = bf16_load(w[b] + 2 * i);
        for (int a = 0; a < nx; a++) {
            const __m512bh xv = bf16_load(x[a] + i);
            for (int b = 0; b < 4; b++) s[4 * a + b] = _mm512_dpbf16_ps(s[4 * a + b], wv[b], xv);
        }
    }
    for (int p = 0; p < 4 * nx; p++) out[p] = _mm512_reduce_add_ps(s[p]);
}

/* y[r * y_stride + j] for r < m, j < n: BF16 weight rows (k values, 2k bytes each)
 * against x's packed rows (xr, k floats apart), in tiles of four weight rows by four x
 * rows (one by four for the last m % 4), BF16_ROW_BLOCK rows of x at a time (their
 * rounded rows stay in L2 while the weight streams past), the threads splitting the
 * weight rows; a short last run of weight rows repeats its last. */
#define BF16_ROW_BLOCK 64
static void bf16_rows_part(const float *xr, int64_t m, int64_t k, const uint8_t *w,
                           int64_t n, float *y, int64_t y_stride) {
    for (int64_t r0 = 0; r0 < m; r0 += BF16_ROW_BLOCK) {
        const int64_t end = r0 + BF16_ROW_BLOCK < m ? r0 + BF16_ROW_BLOCK : m;
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < n; j += 4) {
            const uint8_t *wj[4];
            for (int b = 0; b < 4; b++) wj[b] = w + 2 * k * (j + b < n ? j + b : n - 1);
            for (int64_t r = r0; r < end;) {
                const int nx = end - r >= 4 ? 4 : 1;
                const uint16_t *xs[4];
                for (int a = 0; a < nx; a++) xs[a] = (const uint16_t *)(xr + (r + a) * k);
                float sums[16];
                if (nx == 4)
                    bf16_tile(xs, 4, wj, k, r == r0, sums);
                else
                    bf16_tile(xs, 1, wj, k, r == r0, sums);
                for (int a = 0; a < nx; a++)
                    for (int b = 0; b < 4 && j + b < n; b++)
                        y[(r + a) * y_stride + j + b] = sums[4 * a + b];
                r += nx;
            }
        }
    }
}
#else
/* sums[r] = (x row r rounded to bfloat16) . w for r < m: w one row of k BF16 weights, xr
 * the rows as round_row_bf16 left them, through the widening kernels */
static void row_bf16_rounded(const float *xr, int64_t m, int64_t k, const uint8_t *w,
                             float *sums) {
#ifdef __AVX2__
    row_16bit(1, xr, m, k, w, sums);
#else
    row_buffered(BF16, xr, m, k, w, sums);
#endif
}
#endif
