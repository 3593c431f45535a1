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
static inline __m512bh bf16_load(const void *p) {
    return (__m512bh)_mm512_loadu_si512(p);
}

static inline __m256bh bf16_load_256(const void *p) {
    return (__m256bh)_mm256_loadu_si256((const __m256i *)p);
}

/* sums[r] = xr[r] . w for r < m (m <= MAX_ROWS): w one row of k bfloat16 weights, row r
 * of x packed at xr + r * k floats; k a multiple of 32 */
static void row_bf16_packed(const float *xr, int64_t m, int64_t k, const uint8_t *w,
                            float *sums) {
    if (m == 1) { /* four sums in flight, 256 bits a load (512: a tenth slower from memory) */
        const uint16_t *x = (const uint16_t *)xr;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t i = 0;
        for (; i + 64 <= k; i += 64) {
            _mm_prefetch((const char *)(w + 2 * i + PREFETCH_BYTES), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + 2 * i + PREFETCH_BYTES + 64), _MM_HINT_T0);
            a0 = _mm256_dpbf16_ps(a0, bf16_load_256(w + 2 * i), bf16_load_256(x + i));
            a1 = _mm256_dpbf16_ps(a1, bf16_load_256(w + 2 * i + 32), bf16_load_256(x + i + 16));
            a2 = _mm256_dpbf16_ps(a2, bf16_load_256(w + 2 * i + 64), bf16_load_256(x + i + 32));
            a3 = _mm256_dpbf16_ps(a3, bf16_load_256(w + 2 * i + 96), bf16_load_256(x + i + 48));
        }
        for (; i < k; i += 32) {
            _mm_prefetch((const char *)(w + 2 * i + PREFETCH_BYTES), _MM_HINT_T0);
            a0 = _mm256_dpbf16_ps(a0, bf16_load_256(w + 2 * i), bf16_load_256(x + i));
            a1 = _mm256_dpbf16_ps(a1, bf16_load_256(w + 2 * i + 32), bf16_load_256(x + i + 16));
        }
        sums[0] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        return;
    }
    /* four rows at a time, two sums in flight a row (a short last group repeats its last
     * row; the weight row is in cache after the first group) */
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const uint16_t *x0 = (const uint16_t *)(xr + r0 * k);
        const uint16_t *x1 = (const uint16_t *)(xr + (r0 + 1 < m ? r0 + 1 : m - 1) * k);
        const uint16_t *x2 = (const uint16_t *)(xr + (r0 + 2 < m ? r0 + 2 : m - 1) * k);
        const uint16_t *x3 = (const uint16_t *)(xr + (r0 + 3 < m ? r0 + 3 : m - 1) * k);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0,
               d0 = a0, d1 = a0;
        int64_t i = 0;
        for (; i + 64 <= k; i += 64) {
            const __m512bh w0 = bf16_load(w + 2 * i), w1 = bf16_load(w + 2 * i + 64);
            a0 = _mm512_dpbf16_ps(a0, w0, bf16_load(x0 + i));
            b0 = _mm512_dpbf16_ps(b0, w0, bf16_load(x1 + i));
            c0 = _mm512_dpbf16_ps(c0, w0, bf16_load(x2 + i));
            d0 = _mm512_dpbf16_ps(d0, w0, bf16_load(x3 + i));
            a1 = _mm512_dpbf16_ps(a1, w1, bf16_load(x0 + i + 32));
            b1 = _mm512_dpbf16_ps(b1, w1, bf16_load(x1 + i + 32));
            c1 = _mm512_dpbf16_ps(c1, w1, bf16_load(x2 + i + 32));
            d1 = _mm512_dpbf16_ps(d1, w1, bf16_load(x3 + i + 32));
        }
        if (i < k) { /* one block of 32 over */
            const __m512bh w0 = bf16_load(w + 2 * i);
            a0 = _mm512_dpbf16_ps(a0, w0, bf16_load(x0 + i));
            b0 = _mm512_dpbf16_ps(b0, w0, bf16_load(x1 + i));
            c0 = _mm512_dpbf16_ps(c0, w0, bf16_load(x2 + i));
            d0 = _mm512_dpbf16_ps(d0, w0, bf16_load(x3 + i));
        }
        const float group[4] = {_mm512_reduce_add_ps(_mm512_add_ps(a0, a1)),
                                _mm512_reduce_add_ps(_mm512_add_ps(b0, b1)),
                                _mm512_reduce_add_ps(_mm512_add_ps(c0, c1)),
                                _mm512_reduce_add_ps(_mm512_add_ps(d0, d1))};
        for (int64_t t = 0; t < 4 && r0 + t < m; t++) sums[r0 + t] = group[t];
    }
}
#endif

/* sums[r] = (x row r rounded to bfloat16) . w for r < m: w one row of k BF16 weights, xr
 * the rows as round_row_bf16 left them */
static void row_bf16_rounded(const float *xr, int64_t m, int64_t k, const uint8_t *w,
                             float *sums) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    row_bf16_packed(xr, m, k, w, sums);
#elif defined(__AVX2__)
    row_16bit(1, xr, m, k, w, sums);
#else
    row_buffered(BF16, xr, m, k, w, sums);
#endif
}
