/* Q6_K rows four at a time (format Q6_K_X4): kvserve's own layout of a GGUF Q6_K tensor,
 * made once at load as gguf_k_x4.h's are for Q4_K and Q5_K, so that one decode row's
 * products serve four weight rows per instruction. Included by gguf_linear.c.
 *
 * A Q6_K super-block of 256 values keeps the low four bits of each code in ql[128], the
 * top two in qh[64], one int8 scale per 16 values and a float16 d. Value 128h + 32p + j
 * (h < 2, p < 4, j < 32) is nibble (p < 2: low, else high) of ql[64h + 32(p & 1) + j] and
 * bits 2p, 2p + 1 of qh[32h + j]. A run of four rows is k / 256 groups (X6_GROUP_BYTES),
 * one a super-block of each of the rows r = 0..3:
 *   0    codes   for half h = 0..1, eighth u = 0..3, 96 bytes: values j = 8u..8u+7 of
 *                quarters p = 0, 1, 2 of the half, each as rows 0, 1, 2, 3 (one 32-byte
 *                load each), a byte a value: its 6-bit code in bits 0-5, and in bits
 *                6-7 two bits of quarter 3's code of the same j (bits 0-1, 2-3, 4-5)
 *   768  scales  for quartet q = 0..3 of the 16 scales: rows 0..3's scales 4q..4q+3
 *   832  d[4]    the rows' float16 scales
 * The same 840 bytes as the four rows in the file, and unpacking gives them back. A
 * code of quarters 0-2 is one AND away, quarter 3's three shifts: eleven operations for
 * 128 codes where the file's nibbles and top bits take seventeen.
 *
 * Against a Q8_K row, as row_q6_k_q8k: codes 0-63 as unsigned bytes, each 16 values'
 * products scaled by their int8 scale in integers (two eighths' pair sums add up in 16
 * bits first: at most 2 x 2 x 63 x 127), the codes' offset of 32 taken off through the
 * 16-sums, one float multiply a super-block. */
#define X6_GROUP_BYTES 840

/* Code p of value 128h + 32p + j of a Q6_K super-block b, 0-63 */
static inline int q6_code(const uint8_t *b, int h, int p, int j) {
    const int nibble = (b[64 * h + 32 * (p & 1) + j] >> (p >= 2 ? 4 : 0)) & 0xF;
    return nibble | ((b[128 + 32 * h + j] >> (2 * p)) & 3) << 4;
}

static void q6_k_x4_pack(const uint8_t *rows, int64_t row_bytes, int64_t k, uint8_t *out) {
    for (int64_t i = 0; i < k / 256; i++, out += X6_GROUP_BYTES)
        for (int r = 0; r < 4; r++) {
            const uint8_t *b = rows + r * row_bytes + i * 210;
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 32; j++) {
                    uint8_t *at = out + 96 * (4 * h + j / 8) + 8 * r + j % 8;
                    const int c3 = q6_code(b, h, 3, j);
                    at[0] = (uint8_t)(q6_code(b, h, 0, j) | (c3 & 3) << 6);
                    at[32] = (uint8_t)(q6_code(b, h, 1, j) | (c3 >> 2 & 3) << 6);
                    at[64] = (uint8_t)(q6_code(b, h, 2, j) | (c3 >> 4) << 6);
                }
            for (int s = 0; s < 16; s++) out[768 + 16 * (s / 4) + 4 * r + s % 4] = b[192 + s];
            memcpy(out + 832 + 2 * r, b + 208, 2);
        }
}

static void q6_k_x4_unpack(const uint8_t *g, int64_t k, uint8_t *rows, int64_t row_bytes) {
    for (int64_t i = 0; i < k / 256; i++, g += X6_GROUP_BYTES)
        for (int r = 0; r < 4; r++) {
            uint8_t *b = rows + r * row_bytes + i * 210;
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 32; j++) {
                    const uint8_t *at = g + 96 * (4 * h + j / 8) + 8 * r + j % 8;
                    const int c0 = at[0] & 63, c1 = at[32] & 63, c2 = at[64] & 63;
                    const int c3 = at[0] >> 6 | (at[32] >> 6) << 2 | (at[64] >> 6) << 4;
                    b[64 * h + j] = (uint8_t)((c0 & 0xF) | (c2 & 0xF) << 4);
                    b[64 * h + 32 + j] = (uint8_t)((c1 & 0xF) | (c3 & 0xF) << 4);
                    b[128 + 32 * h + j] = (uint8_t)(c0 >> 4 | (c1 >> 4) << 2 | (c2 >> 4) << 4
                                                    | (c3 >> 4) << 6);
                }
            for (int s = 0; s < 16; s++) b[192 + s] = g[768 + 16 * (s / 4) + 4 * r + s % 4];
            memcpy(b + 208, g + 832 + 2 * r, 2);
        }
}

#ifdef __AVX2__
/* Quartet q of a group's scales widened to 16 bits: rows 0, 1's four in the low 128-bit
 * lane, rows 2, 3's in the high. */
static inline __m256i q6_x4_quartet(const uint8_t *g, int q) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(g + 768 + 16 * q)));
}

/* Scale s (s < 4) of a widened quartet's rows 0..3, each in four 16-bit lanes: the rows'
 * lanes of a 32-byte product's pair sums (one in-lane shuffle: each lane holds its two
 * rows' scales). */
static inline __m256i q6_x4_scale(__m256i quartet, int s) {
    const char a = (char)(2 * s), b = (char)(2 * s + 1);
    const char c = (char)(8 + 2 * s), d = (char)(9 + 2 * s);
    return _mm256_shuffle_epi8(quartet, _mm256_setr_epi8(
        a, b, a, b, a, b, a, b, c, d, c, d, c, d, c, d,
        a, b, a, b, a, b, a, b, c, d, c, d, c, d, c, d));
}

/* The codes of eighth u of half h of a group (rows 0..3, 8 bytes each) in the four
 * quarters p of the half, one byte a code (0-63). */
static inline __attribute__((always_inline)) void q6_x4_codes(const uint8_t *g, int h, int u,
                                                              __m256i codes[4]) {
    const __m256i low6 = _mm256_set1_epi8(0x3F);
    const uint8_t *c = g + 96 * (4 * h + u);
    const __m256i a = _mm256_loadu_si256((const __m256i *)c);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(c + 32));
    const __m256i d = _mm256_loadu_si256((const __m256i *)(c + 64));
    codes[0] = _mm256_and_si256(a, low6);
    codes[1] = _mm256_and_si256(b, low6);
    codes[2] = _mm256_and_si256(d, low6);
    /* bits 6-7 of a, b and d to bits 0-1, 2-3 and 4-5 (16-bit shifts: what crosses a
     * byte lands outside the bits kept) */
    codes[3] = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 6), _mm256_set1_epi8(0x03)),
                        _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0C))),
        _mm256_and_si256(_mm256_srli_epi16(d, 2), _mm256_set1_epi8(0x30)));
}

/* A run's codes one byte each: for half h, eighth u, quarter p, 32 bytes at
 * 128 (4h + u) + 32p of a group's X4_CODES_BYTES (gguf_k_x4.h), decoded once for the many
 * rows of a prompt chunk. */
static void q6_k_x4_decode(const uint8_t *g, int64_t k, uint8_t *codes) {
    for (int64_t i = 0; i < k / 256; i++, g += X6_GROUP_BYTES, codes += X4_CODES_BYTES)
        for (int h = 0; h < 2; h++)
            for (int u = 0; u < 4; u++) {
                __m256i c[4];
                q6_x4_codes(g, h, u, c);
                for (int p = 0; p < 4; p++)
                    _mm256_storeu_si256((__m256i *)(codes + 128 * (4 * h + u) + 32 * p), c[p]);
            }
}

/* A group's sums into one x row's accumulators (lanes r0 r0 r1 r1 | r2 r2 r3 r3): its
 * products isum, and the codes' offset of 32 (the rows' scales against x's 16-sums bs),
 * each times the rows' d and x's scale xd. */
static inline void q6_x4_add_group(const __m256i quartet[4], const int16_t *bs, __m256 dw,
                                   float xd, __m256i isum, __m256 *acc, __m256 *acc_off) {
    __m256i off = _mm256_setzero_si256();
    for (int q = 0; q < 4; q++) {
        int64_t sums;
        memcpy(&sums, bs + 4 * q, 8);
        off = madd_s16_add(off, quartet[q], _mm256_set1_epi64x(sums));
    }
    const __m256 d = _mm256_permutevar8x32_ps(_mm256_mul_ps(dw, _mm256_set1_ps(xd)),
                                              _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, *acc);
    *acc_off = _mm256_fmadd_ps(_mm256_cvtepi32_ps(off), d, *acc_off);
}

/* One x row's sums of the four rows into out[0..3] */
static inline void q6_x4_store(__m256 acc, __m256 acc_off, float *out) {
    const __m256 sums = _mm256_fnmadd_ps(_mm256_set1_ps(32.f), acc_off, acc);
    const __m256 pairs = _mm256_hadd_ps(sums, sums); /* r0 r1 r0 r1 | r2 r3 r2 r3 */
    _mm_storel_pi((__m64 *)out, _mm256_castps256_ps128(pairs));
    _mm_storel_pi((__m64 *)(out + 2), _mm256_extractf128_ps(pairs, 1));
}

/* The four rows of a run against `rows` Q8_K rows (1-4) with the run's codes decoded
 * (q6_k_x4_decode): q6_k_x4_q8k's sums, a quarter at a time across the rows. */
static inline __attribute__((always_inline)) void q6_k_x4_q8k_decoded(
    int rows, const int8_t *xq, const float *xd, const int16_t *bsums, int64_t k,
    const uint8_t *g, const uint8_t *codes, float *out, int64_t out_stride) {
    const int64_t nsb = k / 256;
    __m256 acc[4], acc_off[4];
    for (int r = 0; r < rows; r++) acc[r] = acc_off[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++, g += X6_GROUP_BYTES, codes += X4_CODES_BYTES) {
        const __m256 dw = _mm256_cvtph_ps(_mm_loadl_epi64((const __m128i *)(g + 832)));
        __m256i quartet[4];
        for (int q = 0; q < 4; q++) quartet[q] = q6_x4_quartet(g, q);
        __m256i isum[4];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
            for (int pair = 0; pair < 2; pair++)
#pragma GCC unroll 4
                for (int part = 0; part < 4; part++) { /* scale 8h + 2 part + pair */
                    const int s = 8 * h + 2 * part + pair;
                    const __m256i scale = q6_x4_scale(quartet[s / 4], s % 4);
                    const uint8_t *c0 = codes + 128 * (4 * h + 2 * pair) + 32 * part;
                    const __m256i code0 = _mm256_loadu_si256((const __m256i *)c0);
                    const __m256i code1 = _mm256_loadu_si256((const __m256i *)(c0 + 128));
                    for (int r = 0; r < rows; r++) {
                        const int8_t *x = xq + r * k + 256 * i + 128 * h + 32 * part + 16 * pair;
                        int64_t x0, x1;
                        memcpy(&x0, x, 8);
                        memcpy(&x1, x + 8, 8);
                        const __m256i p = _mm256_add_epi16(
                            _mm256_maddubs_epi16(code0, _mm256_set1_epi64x(x0)),
                            _mm256_maddubs_epi16(code1, _mm256_set1_epi64x(x1)));
                        isum[r] = madd_s16_add(isum[r], p, scale);
                    }
                }
        for (int r = 0; r < rows; r++)
            q6_x4_add_group(quartet, bsums + r * (k / 16) + 16 * i, dw, xd[r * nsb + i],
                            isum[r], &acc[r], &acc_off[r]);
    }
    for (int r = 0; r < rows; r++) q6_x4_store(acc[r], acc_off[r], out + r * out_stride);
}

/* The four rows of a run against `rows` Q8_K rows (1-2, laid out as k_x4_q8k's):
 * out[r * out_stride + 0..3], each x row's sums those it gets alone. The sums run in
 * lanes r0 r0 r1 r1 | r2 r2 r3 r3, as k_x4_q8k's. */
static inline __attribute__((always_inline)) void q6_k_x4_q8k(
    int rows, const int8_t *xq, const float *xd, const int16_t *bsums, int64_t k,
    const uint8_t *g, float *out, int64_t out_stride) {
    const int64_t nsb = k / 256;
    __m256 acc[2], acc_off[2];
    for (int r = 0; r < rows; r++) acc[r] = acc_off[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nsb; i++, g += X6_GROUP_BYTES) {
        for (int line = 0; line < X6_GROUP_BYTES; line += 64)
            _mm_prefetch((const char *)(g + 2 * PREFETCH_BYTES + line), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadl_epi64((const __m128i *)(g + 832)));
        __m256i quartet[4];
        for (int q = 0; q < 4; q++) quartet[q] = q6_x4_quartet(g, q);
        __m256i isum[2];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
#pragma GCC unroll 2
            for (int pair = 0; pair < 2; pair++) { /* eighths 2 pair, 2 pair + 1: one scale */
                __m256i p[2][4];
                for (int r = 0; r < rows; r++)
                    for (int part = 0; part < 4; part++) p[r][part] = _mm256_setzero_si256();
#pragma GCC unroll 2
                for (int e = 0; e < 2; e++) {
                    const int u = 2 * pair + e;
                    __m256i codes[4];
                    q6_x4_codes(g, h, u, codes);
#pragma GCC unroll 4
                    for (int part = 0; part < 4; part++)
                        for (int r = 0; r < rows; r++) {
                            int64_t xs;
                            memcpy(&xs, xq + r * k + 256 * i + 128 * h + 32 * part + 8 * u, 8);
#ifdef VNNI_DOT /* 4 products' sums in 32 bits, times the scale below: madd's integers */
                            p[r][part] = dot_u8s8_add(p[r][part], codes[part],
                                                      _mm256_set1_epi64x(xs));
#else
                            p[r][part] = _mm256_add_epi16(p[r][part], _mm256_maddubs_epi16(
                                codes[part], _mm256_set1_epi64x(xs)));
#endif
                        }
                }
#pragma GCC unroll 4
                for (int part = 0; part < 4; part++) { /* scale 8h + 2 part + pair */
                    const int s = 8 * h + 2 * part + pair;
                    const __m256i scale = q6_x4_scale(quartet[s / 4], s % 4);
#ifdef VNNI_DOT /* each 32-bit lane of scale holds its int16 scale twice */
                    const __m256i scale32 = _mm256_srai_epi32(scale, 16);
                    for (int r = 0; r < rows; r++)
                        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(p[r][part], scale32));
#else
                    for (int r = 0; r < rows; r++)
                        isum[r] = madd_s16_add(isum[r], p[r][part], scale);
#endif
                }
            }
        }
        for (int r = 0; r < rows; r++)
            q6_x4_add_group(quartet, bsums + r * (k / 16) + 16 * i, dw, xd[r * nsb + i],
                            isum[r], &acc[r], &acc_off[r]);
    }
    for (int r = 0; r < rows; r++) q6_x4_store(acc[r], acc_off[r], out + r * out_stride);
}
#endif
