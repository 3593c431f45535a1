/* Q4_K and Q5_K rows four at a time (formats Q4_K_X4, Q5_K_X4): kvserve's own layout of a
 * GGUF Q4_K or Q5_K tensor, made once at load (gguf_repack_runs) so that one decode row's
 * products serve four weight rows per instruction. Included by gguf_linear.c.
 *
 * Each run of four rows is k / 256 groups, one a super-block of 256 values of each of
 * the four rows r = 0..3 (X4_GROUP_BYTES, Q5_K's X5_GROUP_BYTES):
 *   0   d[4], dmin[4]    the rows' float16 super-block scales, as the file has them
 *   16  scales[4][8]     each row's 6-bit sub-block scales, a byte each
 *   48  mins             each row's 6-bit sub-block mins, a byte each: sub-blocks 0-3 of
 *                        rows 0..3, then sub-blocks 4-7 of rows 0..3
 *   80  qs               Q4_K: for chunk c = 0..3 (the file's 32 bytes of sub-blocks 2c
 *                        and 2c + 1: low and high nibbles), for eighth u = 0..3, bytes
 *                        8u..8u+7 of rows 0, 1, 2, 3: one 32-byte load
 *   80  codes            Q5_K: for eighth u = 0..3, five 32-byte vectors B0..B4, each
 *                        values 8u..8u+7 of rows 0, 1, 2, 3: byte i holds sub-block i's
 *                        5-bit code in bits 0-4 (i < 5), and in bits 5-7 three bits of
 *                        sub-blocks 5-7's: the low three of 5, 6, 7 in B0, B1, B2; bits
 *                        3-4 of 5 and bit 3 of 6 in B3; bit 4 of 6 and bits 3-4 of 7 in B4
 *                        (sub-blocks 0-4: one AND a code; 5-7: five to eight operations)
 * Nothing is lost: unpacking gives back the file's bytes. 592 bytes hold what four rows
 * kept in 576 (Q5_K: 720 for 704): a row is BLOCK_BYTES[Q4_K_X4] = 148 bytes a
 * super-block (Q5_K_X4: 180).
 *
 * Against a Q8_K row: each 32-byte load of weights meets 8 activation bytes broadcast
 * to all four rows; the 16-bit pair sums of a sub-block add up in 16 bits (at most
 * 4 x 2 x 31 x 127) before one multiply by the four rows' scales; the mins meet x's
 * 32-value sums, made once when x is rounded (gguf_activations' sums32). */
#define X4_GROUP_BYTES 592
#define X5_GROUP_BYTES 720
#define X4_MAX_K 16384 /* the longest rows the layout takes: unpacked runs go on the stack */

/* Value l of a Q5_K super-block's eight sub-blocks (fifth bits qh, nibbles qs) into the
 * five bytes at `at`, 32 apart; and back. */
static void k5_pack_codes(const uint8_t *qh, const uint8_t *qs, int l, uint8_t *at) {
    int code[8];
    for (int s = 0; s < 8; s++)
        code[s] = (qs[32 * (s / 2) + l] >> (4 * (s % 2)) & 0xF) | (qh[l] >> s & 1) << 4;
    const int top[5] = {code[5] & 7, code[6] & 7, code[7] & 7,
                        code[5] >> 3 | (code[6] >> 3 & 1) << 2, code[6] >> 4 | (code[7] >> 3) << 1};
    for (int i = 0; i < 5; i++) at[32 * i] = (uint8_t)(code[i] | top[i] << 5);
}

static void k5_unpack_codes(const uint8_t *at, int l, uint8_t *qh, uint8_t *qs) {
    int code[8], top[5];
    for (int i = 0; i < 5; i++) {
        code[i] = at[32 * i] & 0x1F;
        top[i] = at[32 * i] >> 5;
    }
    code[5] = top[0] | (top[3] & 3) << 3;
    code[6] = top[1] | (top[3] >> 2) << 3 | (top[4] & 1) << 4;
    code[7] = top[2] | (top[4] >> 1) << 3;
    qh[l] = 0;
    for (int s = 0; s < 8; s++) qh[l] |= (uint8_t)((code[s] >> 4) << s);
    for (int c = 0; c < 4; c++)
        qs[32 * c + l] = (uint8_t)((code[2 * c] & 0xF) | (code[2 * c + 1] & 0xF) << 4);
}

/* Four rows of standard Q4_K (Q5_K with five) blocks, row_bytes apart, k values each,
 * into the layout. */
static void k_x4_pack(int five, const uint8_t *rows, int64_t row_bytes, int64_t k,
                      uint8_t *out) {
    const int block = five ? 176 : 144, qs = five ? 48 : 16;
    for (int64_t i = 0; i < k / 256; i++, out += five ? X5_GROUP_BYTES : X4_GROUP_BYTES) {
        for (int r = 0; r < 4; r++) {
            const uint8_t *b = rows + r * row_bytes + i * block;
            memcpy(out + 2 * r, b, 2);
            memcpy(out + 8 + 2 * r, b + 2, 2);
            for (int s = 0; s < 8; s++) {
                float sc, mn;
                scale_min_k4(s, b + 4, &sc, &mn);
                out[16 + 8 * r + s] = (uint8_t)sc;
                out[48 + 16 * (s / 4) + 4 * r + s % 4] = (uint8_t)mn;
            }
            if (five)
                for (int l = 0; l < 32; l++)
                    k5_pack_codes(b + 16, b + qs, l, out + 80 + 160 * (l / 8) + 8 * r + l % 8);
            else
                for (int c = 0; c < 4; c++)
                    for (int u = 0; u < 4; u++)
                        memcpy(out + 80 + 32 * (4 * c + u) + 8 * r, b + qs + 32 * c + 8 * u, 8);
        }
    }
}

/* k_x4_pack's inverse: one run of four rows back into standard rows. */
static void k_x4_unpack(int five, const uint8_t *g, int64_t k, uint8_t *rows,
                        int64_t row_bytes) {
    const int block = five ? 176 : 144, qs = five ? 48 : 16;
    for (int64_t i = 0; i < k / 256; i++, g += five ? X5_GROUP_BYTES : X4_GROUP_BYTES) {
        for (int r = 0; r < 4; r++) {
            uint8_t *b = rows + r * row_bytes + i * block, *q = b + 4;
            memcpy(b, g + 2 * r, 2);
            memcpy(b + 2, g + 8 + 2 * r, 2);
            const uint8_t *sc = g + 16 + 8 * r;
            uint8_t mn[8];
            for (int s = 0; s < 8; s++) mn[s] = g[48 + 16 * (s / 4) + 4 * r + s % 4];
            for (int s = 0; s < 4; s++) {
                q[s] = (uint8_t)(sc[s] | (sc[s + 4] >> 4) << 6);
                q[s + 4] = (uint8_t)(mn[s] | (mn[s + 4] >> 4) << 6);
                q[s + 8] = (uint8_t)((sc[s + 4] & 0xF) | (mn[s + 4] & 0xF) << 4);
            }
            if (five)
                for (int l = 0; l < 32; l++)
                    k5_unpack_codes(g + 80 + 160 * (l / 8) + 8 * r + l % 8, l, b + 16, b + qs);
            else
                for (int c = 0; c < 4; c++)
                    for (int u = 0; u < 4; u++)
                        memcpy(b + qs + 32 * c + 8 * u, g + 80 + 32 * (4 * c + u) + 8 * r, 8);
        }
    }
}

#ifdef __AVX2__
/* The codes of eighth u of chunk c of a group (sub-blocks 2c, 2c + 1 of rows 0..3, 8
 * bytes each): the low sub-block's in lo, the high's in hi, one byte a code. Q5_K:
 * from the five bytes B0..B4 of each value (16-bit shifts: what crosses a byte lands
 * outside the bits kept). */
static inline __attribute__((always_inline)) void k_x4_codes(int five, const uint8_t *g,
                                                             int c, int u, __m256i *lo,
                                                             __m256i *hi) {
    const __m256i low4 = _mm256_set1_epi8(0xF);
    if (!five) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(g + 80 + 32 * (4 * c + u)));
        *lo = _mm256_and_si256(q, low4);
        *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        return;
    }
#define K5_B(i) _mm256_loadu_si256((const __m256i *)(g + 80 + 160 * u + 32 * (i)))
#define K5_BITS(v, shift, mask) \
    _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(mask))
    const __m256i low5 = _mm256_set1_epi8(0x1F);
    if (c < 2) {
        *lo = _mm256_and_si256(K5_B(2 * c), low5);
        *hi = _mm256_and_si256(K5_B(2 * c + 1), low5);
    } else if (c == 2) {
        *lo = _mm256_and_si256(K5_B(4), low5);
        *hi = _mm256_or_si256(K5_BITS(K5_B(0), 5, 0x07), K5_BITS(K5_B(3), 2, 0x18));
    } else {
        const __m256i b3 = K5_B(3), b4 = K5_B(4);
        *lo = _mm256_or_si256(_mm256_or_si256(K5_BITS(K5_B(1), 5, 0x07), K5_BITS(b3, 4, 0x08)),
                              K5_BITS(b4, 1, 0x10));
        *hi = _mm256_or_si256(K5_BITS(K5_B(2), 5, 0x07), K5_BITS(b4, 3, 0x18));
    }
#undef K5_B
#undef K5_BITS
}

/* A run's codes one byte each (k_x4_codes's lo and hi of each (c, u), X4_CODES_BYTES a
 * group), decoded once for the many rows of a prompt chunk. */
#define X4_CODES_BYTES 1024
static void k_x4_decode(int five, const uint8_t *g, int64_t k, uint8_t *codes) {
    const int group = five ? X5_GROUP_BYTES : X4_GROUP_BYTES;
    for (int64_t i = 0; i < k / 256; i++, g += group, codes += X4_CODES_BYTES)
        for (int c = 0; c < 4; c++)
            for (int u = 0; u < 4; u++) {
                __m256i lo, hi;
                k_x4_codes(five, g, c, u, &lo, &hi);
                _mm256_storeu_si256((__m256i *)(codes + 64 * (4 * c + u)), lo);
                _mm256_storeu_si256((__m256i *)(codes + 64 * (4 * c + u) + 32), hi);
            }
}

/* The four rows of a run against `rows` Q8_K rows (1-4; k values each, row r's at
 * xq + r * k, its scales and 32-sums at xd + r * (k / 256), sums32 + r * (k / 32)):
 * out[r * out_stride + 0..3]. Each weight load and decode serves every x row; each x
 * row's sums are those it gets alone (integers, then the same float operations in the
 * same order). The sums run in lanes r0 r0 r1 r1 | r2 r2 r3 r3; each row's pair is added
 * at the end. five: Q5_K_X4. codes: the run's codes from k_x4_decode, or NULL to decode
 * them here. */
static inline __attribute__((always_inline)) void k_x4_q8k(
    int five, int rows, const int8_t *xq, const float *xd, const int16_t *sums32, int64_t k,
    const uint8_t *g, const uint8_t *codes, float *out, int64_t out_stride) {
    const int group = five ? X5_GROUP_BYTES : X4_GROUP_BYTES;
    const int64_t nsb = k / 256;
    __m256 acc[4], acc_m[4];
    for (int r = 0; r < rows; r++) acc[r] = acc_m[r] = _mm256_setzero_ps();
    const __m256i d_lanes = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i dmin_lanes = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    for (int64_t i = 0; i < nsb; i++, g += group) {
        if (!codes)
            for (int line = 0; line < group; line += 64)
                _mm_prefetch((const char *)(g + 2 * PREFETCH_BYTES + line), _MM_HINT_T0);
        /* the rows' d in the lanes of their sums, and their dmin: each times x's scale
         * below (the products a permute of dw * xd would give) */
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        const __m256 dw_d = _mm256_permutevar8x32_ps(dw, d_lanes),
                     dw_min = _mm256_permutevar8x32_ps(dw, dmin_lanes);
        const __m256i scales = _mm256_loadu_si256((const __m256i *)(g + 16));
        const __m256i mins_lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 48)));
        const __m256i mins_hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(g + 64)));
        __m256i isum[4];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            /* sub-block s's scale of rows 0, 1 (2, 3 in the upper half) as 16-bit lanes */
            const short lo0 = (short)(0x8000 | (2 * c)), lo1 = (short)(0x8000 | (8 + 2 * c));
            const short hi0 = (short)(lo0 + 1), hi1 = (short)(lo1 + 1);
            const __m256i scale_lo = _mm256_shuffle_epi8(scales, _mm256_setr_epi16(
                lo0, lo0, lo0, lo0, lo1, lo1, lo1, lo1, lo0, lo0, lo0, lo0, lo1, lo1, lo1, lo1));
            const __m256i scale_hi = _mm256_shuffle_epi8(scales, _mm256_setr_epi16(
                hi0, hi0, hi0, hi0, hi1, hi1, hi1, hi1, hi0, hi0, hi0, hi0, hi1, hi1, hi1, hi1));
            /* AVX2: each 16-bit pair sum over the eighths, then madd by the scales; VNNI:
             * each 4 products' sum over the eighths in 32 bits, then times the scale (each
             * 32-bit lane of scale_lo holds its scale twice): madd's integers */
            __m256i p_lo[4], p_hi[4];
            for (int r = 0; r < rows; r++) p_lo[r] = p_hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int u = 0; u < 4; u++) {
                __m256i lo, hi;
                if (codes) {
                    const uint8_t *at = codes + i * X4_CODES_BYTES + 64 * (4 * c + u);
                    lo = _mm256_loadu_si256((const __m256i *)at);
                    hi = _mm256_loadu_si256((const __m256i *)(at + 32));
                } else {
                    k_x4_codes(five, g, c, u, &lo, &hi);
                }
                for (int r = 0; r < rows; r++) {
                    const int8_t *x = xq + r * k + 256 * i + 64 * c + 8 * u;
                    int64_t x_lo, x_hi;
                    memcpy(&x_lo, x, 8);
                    memcpy(&x_hi, x + 32, 8);
#ifdef VNNI_DOT
                    p_lo[r] = dot_u8s8_add(p_lo[r], lo, _mm256_set1_epi64x(x_lo));
                    p_hi[r] = dot_u8s8_add(p_hi[r], hi, _mm256_set1_epi64x(x_hi));
#else
                    p_lo[r] = _mm256_add_epi16(p_lo[r],
                                               _mm256_maddubs_epi16(lo, _mm256_set1_epi64x(x_lo)));
                    p_hi[r] = _mm256_add_epi16(p_hi[r],
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi64x(x_hi)));
#endif
                }
            }
#ifdef VNNI_DOT
            const __m256i scale32_lo = _mm256_srli_epi32(scale_lo, 16),
                          scale32_hi = _mm256_srli_epi32(scale_hi, 16);
            if (!five) /* Q4_K: each lane's sum fits 16 bits (at most 16 x 15 x 127), so
                        * dpwssd's pair (sum, sign) . (scale, 0) is the product */
                for (int r = 0; r < rows; r++)
                    isum[r] = madd_s16_add(madd_s16_add(isum[r], p_lo[r], scale32_lo), p_hi[r],
                                           scale32_hi);
            else
            for (int r = 0; r < rows; r++)
                isum[r] = _mm256_add_epi32(isum[r],
                                           _mm256_add_epi32(_mm256_mullo_epi32(p_lo[r], scale32_lo),
                                                            _mm256_mullo_epi32(p_hi[r], scale32_hi)));
#else
            for (int r = 0; r < rows; r++)
                isum[r] = madd_s16_add(madd_s16_add(isum[r], p_lo[r], scale_lo), p_hi[r], scale_hi);
#endif
        }
        for (int r = 0; r < rows; r++) {
            /* the 32-value sums of x: sub-blocks 0-3 in every quarter, then 4-7 */
            int64_t sums_lo, sums_hi;
            memcpy(&sums_lo, sums32 + r * (k / 32) + 8 * i, 8);
            memcpy(&sums_hi, sums32 + r * (k / 32) + 8 * i + 4, 8);
            const __m256i mins = madd_s16_add(
                _mm256_madd_epi16(mins_lo, _mm256_set1_epi64x(sums_lo)), mins_hi,
                _mm256_set1_epi64x(sums_hi));
            const __m256 xdr = _mm256_set1_ps(xd[r * nsb + i]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw_d, xdr),
                                     acc[r]);
            acc_m[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dw_min, xdr),
                                       acc_m[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        const __m256 sums = _mm256_sub_ps(acc[r], acc_m[r]);
        const __m256 pairs = _mm256_hadd_ps(sums, sums); /* r0 r1 r0 r1 | r2 r3 r2 r3 */
        _mm_storel_pi((__m64 *)(out + r * out_stride), _mm256_castps256_ps128(pairs));
        _mm_storel_pi((__m64 *)(out + r * out_stride + 2), _mm256_extractf128_ps(pairs, 1));
    }
}
#endif
