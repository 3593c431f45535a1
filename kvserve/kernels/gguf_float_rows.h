/* The products of GGUF blocks against float decode rows (gguf_rows): dequantize-then-
 * multiply's products, summed per block, scaled, then added. Every format decodes a block
 * into a small float buffer in L1 and sums from there (the path without AVX2, and the one
 * for Q4_0, Q5_K and Q6_K); Q8_0, Q4_K and the 16-bit floats decode in registers with
 * AVX2. Included by gguf_linear.c, after decode_block (and half_to_float, scale_min_k4,
 * BLOCK_VALUES, BLOCK_BYTES, PREFETCH_BYTES). */
/* The buffer path: each block decoded to floats, then summed against every x row. */
static void row_buffered(int fmt, const float *x, int64_t m, int64_t k, const uint8_t *w,
                         float *sums) {
    const int64_t bv = BLOCK_VALUES[fmt], bb = BLOCK_BYTES[fmt];
    float buf[256];
    for (int64_t r = 0; r < m; r++) sums[r] = 0.f;
    for (int64_t i = 0; i < k; i += bv, w += bb) {
        decode_block(fmt, w, buf);
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k + i;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t t = 0; t < bv; t++) s += xr[t] * buf[t];
            sums[r] += s;
        }
    }
}

#ifdef __AVX2__
/* the sum of 4 int32 */
static inline int hsum_epi32_128(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4e));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xb1));
    return _mm_cvtsi128_si32(v);
}

/* 8 bytes of int8 (or, unsigned, of 4-bit codes) as 8 floats */
static inline __m256 i8_to_ps(const void *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline __m256 u8_to_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

/* Q8_0 in registers: 32 int8 of a block as four vectors, summed against each row. */
static void row_q8_0(const float *x, int64_t m, int64_t k, const uint8_t *w, float *sums) {
    __m256 acc[MAX_ROWS];
    for (int64_t r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 32, w += 34) {
        const __m256 d = _mm256_set1_ps(half_to_float(w));
        const __m256 w0 = i8_to_ps(w + 2), w1 = i8_to_ps(w + 10), w2 = i8_to_ps(w + 18),
                     w3 = i8_to_ps(w + 26);
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k + i;
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr), w0);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, t);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, t);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, t);
            acc[r] = _mm256_fmadd_ps(d, t, acc[r]);
        }
    }
    for (int64_t r = 0; r < m; r++) sums[r] = hsum(acc[r]);
}

/* BF16 or F16 rows in registers: 8 weights widened to float32 at a time (bfloat16's
 * bits shifted up; half precision by F16C), four sums in flight for one row, two a row
 * for more. */
static inline __m256 widen16(const uint8_t *p, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                : _mm256_cvtph_ps(h);
}

static void row_16bit(int bf16, const float *x, int64_t m, int64_t k, const uint8_t *w,
                      float *sums) {
    if (m == 1) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < k; i += 32, w += 64) {
            _mm_prefetch((const char *)(w + PREFETCH_BYTES), _MM_HINT_T0);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), widen16(w, bf16), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), widen16(w + 16, bf16), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), widen16(w + 32, bf16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), widen16(w + 48, bf16), a3);
        }
        sums[0] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        return;
    }
    if (m == 2) { /* two sums in flight a row: one a row would wait on each FMA */
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        const float *y = x + k;
        for (int64_t i = 0; i < k; i += 16, w += 32) {
            const __m256 w0 = widen16(w, bf16), w1 = widen16(w + 16, bf16);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), w0, a0);
            b0 = _mm256_fmadd_ps(_mm256_loadu_ps(y + i), w0, b0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), w1, a1);
            b1 = _mm256_fmadd_ps(_mm256_loadu_ps(y + i + 8), w1, b1);
        }
        sums[0] = hsum(_mm256_add_ps(a0, a1));
        sums[1] = hsum(_mm256_add_ps(b0, b1));
        return;
    }
    /* three or more: four rows at a time, two sums in flight a row, all in registers (a
     * short last block repeats its last row; the weight row is in cache after the first) */
    for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const float *x0 = x + r0 * k, *x1 = x + (r0 + 1 < m ? r0 + 1 : m - 1) * k,
                    *x2 = x + (r0 + 2 < m ? r0 + 2 : m - 1) * k,
                    *x3 = x + (r0 + 3 < m ? r0 + 3 : m - 1) * k;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0,
               d1 = a0;
        const uint8_t *wp = w;
        for (int64_t i = 0; i < k; i += 16, wp += 32) {
            const __m256 w0 = widen16(wp, bf16), w1 = widen16(wp + 16, bf16);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i), w0, a0);
            b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i), w0, b0);
            c0 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i), w0, c0);
            d0 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + i), w0, d0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i + 8), w1, a1);
            b1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i + 8), w1, b1);
            c1 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i + 8), w1, c1);
            d1 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + i + 8), w1, d1);
        }
        const float block[4] = {hsum(_mm256_add_ps(a0, a1)), hsum(_mm256_add_ps(b0, b1)),
                                hsum(_mm256_add_ps(c0, c1)), hsum(_mm256_add_ps(d0, d1))};
        for (int64_t t = 0; t < 4 && r0 + t < m; t++) sums[r0 + t] = block[t];
    }
}

/* Q4_K in registers: sub-block s contributes d*sc_s * (codes . x) - dmin*m_s * sum(x);
 * xsum holds each row's sums of x over its 32-value sub-blocks. */
static void row_q4_k(const float *x, const float *xsum, int64_t m, int64_t k,
                     const uint8_t *w, float *sums) {
    __m256 acc[MAX_ROWS];
    float mins[MAX_ROWS];
    for (int64_t r = 0; r < m; r++) {
        acc[r] = _mm256_setzero_ps();
        mins[r] = 0.f;
    }
    const __m128i low4 = _mm_set1_epi8(0xF);
    for (int64_t i = 0; i < k; i += 256, w += 144) {
        const float d = half_to_float(w), dmin = half_to_float(w + 2);
        for (int c = 0; c < 4; c++) {
            const __m128i b0 = _mm_loadu_si128((const __m128i *)(w + 16 + 32 * c));
            const __m128i b1 = _mm_loadu_si128((const __m128i *)(w + 32 + 32 * c));
            for (int half = 0; half < 2; half++) {
                const int s = 2 * c + half;
                float sc, mn;
                scale_min_k4(s, w + 4, &sc, &mn);
                const __m128i c0 = half ? _mm_and_si128(_mm_srli_epi16(b0, 4), low4)
                                        : _mm_and_si128(b0, low4);
                const __m128i c1 = half ? _mm_and_si128(_mm_srli_epi16(b1, 4), low4)
                                        : _mm_and_si128(b1, low4);
                const __m256 w0 = u8_to_ps(c0), w1 = u8_to_ps(_mm_srli_si128(c0, 8)),
                             w2 = u8_to_ps(c1), w3 = u8_to_ps(_mm_srli_si128(c1, 8));
                const __m256 a = _mm256_set1_ps(d * sc);
                const float dm = dmin * mn;
                for (int64_t r = 0; r < m; r++) {
                    const float *xr = x + r * k + i + 32 * s;
                    __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr), w0);
                    t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, t);
                    t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w2, t);
                    t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w3, t);
                    acc[r] = _mm256_fmadd_ps(a, t, acc[r]);
                    mins[r] += dm * xsum[r * (k / 32) + (i / 32) + s];
                }
            }
        }
    }
    for (int64_t r = 0; r < m; r++) sums[r] = hsum(acc[r]) - mins[r];
}
#endif
