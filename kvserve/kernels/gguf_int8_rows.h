/* The integer products of GGUF blocks against decode rows rounded to int8, as llama.cpp
 * sums them (AVX2; VNNI's fused dot products where the build has them, vec_math.h): x rounded per 32 values (its Q8_0) against Q8_0 blocks, per 256 with
 * 16-value sums (its Q8_K) against the K formats; each block's scales applied in
 * integers, one float multiply a block. Few-row kernels first, then one row's (a single
 * stream's step) kept in registers. Included by gguf_linear.c, after gguf_float_rows.h
 * (hsum_epi32_128; half_to_float, PREFETCH_BYTES). */
#ifdef __AVX2__
/* The rows of x as int8 in blocks of 32 with one scale each (llama.cpp's Q8_0 for
 * activations): xq = rint(x / xd), xd = max|x| / 127 over the block. */
static void quantize_blocks_q8(const float *x, int64_t count, int8_t *xq, float *xd) {
    const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < count; b++, x += 32, xq += 32) {
        const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8),
                     v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        const __m256 mx = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v0, no_sign), _mm256_and_ps(v1, no_sign)),
            _mm256_max_ps(_mm256_and_ps(v2, no_sign), _mm256_and_ps(v3, no_sign)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        xd[b] = amax / 127.f;
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, inv), mode)),
                      i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, inv), mode)),
                      i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, inv), mode)),
                      i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, inv), mode));
        /* the packs interleave 128-bit lanes: put them back in order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i *)xq, _mm256_permutevar8x32_epi32(
            p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
}

/* 32 int8 products of a signed weight block and an activation block, as 8 int32 sums */
static inline __m256i dot_s8(__m256i w, __m256i x) {
    return dot_u8s8_add(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static void row_q8_0_q8(const int8_t *xq, const float *xd, int64_t m, int64_t k,
                        const uint8_t *w, float *sums) {
    __m256 acc[MAX_ROWS];
    const int64_t nb = k / 32;
    for (int64_t r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 34) {
        const float d = half_to_float(w);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 2));
        for (int64_t r = 0; r < m; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * k + 32 * b));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r * nb + b]),
                                     _mm256_cvtepi32_ps(dot_s8(q, x)), acc[r]);
        }
    }
    for (int64_t r = 0; r < m; r++) sums[r] = hsum(acc[r]);
}

/* The rows of x as llama.cpp's Q8_K, the activations its K-format products take: per 256
 * values one scale xd = max / -127 (max: the first value of largest magnitude, its sign
 * kept), xq = rint(x / xd) capped at 127 (rounded to nearest even, as lrintf), and bsums
 * the sums of each 16 of xq. */
static void quantize_blocks_q8_k(const float *x, int64_t count, int8_t *xq, float *xd,
                                 int16_t *bsums) {
    const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t b = 0; b < count; b++, x += 256, xq += 256, bsums += 16) {
        __m256 top = _mm256_setzero_ps();
        for (int t = 0; t < 256; t += 8)
            top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + t), no_sign));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (amax == 0.f) {
            xd[b] = 0.f;
            memset(xq, 0, 256);
            memset(bsums, 0, 16 * sizeof(int16_t));
            continue;
        }
        float max = 0.f;
        const __m256 amax8 = _mm256_set1_ps(amax);
        for (int t = 0; t < 256; t += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(
                _mm256_and_ps(_mm256_loadu_ps(x + t), no_sign), amax8, _CMP_EQ_OQ));
            if (hit) {
                max = x[t + __builtin_ctz((unsigned)hit)];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m256 scale8 = _mm256_set1_ps(iscale);
        const __m256i cap = _mm256_set1_epi32(127);
        for (int t = 0; t < 256; t += 32) {
            __m256i v[4];
            for (int j = 0; j < 4; j++)
                v[j] = _mm256_min_epi32(cap, _mm256_cvtps_epi32(
                    _mm256_mul_ps(scale8, _mm256_loadu_ps(x + t + 8 * j))));
            for (int j = 0; j < 2; j++) {
                const __m256i sum16 = _mm256_add_epi32(v[2 * j], v[2 * j + 1]);
                bsums[t / 16 + j] = (int16_t)hsum_epi32_128(_mm_add_epi32(
                    _mm256_castsi256_si128(sum16), _mm256_extracti128_si256(sum16, 1)));
            }
            /* the packs interleave 128-bit lanes: put them back in order */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                                 _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256((__m256i *)(xq + t), _mm256_permutevar8x32_epi32(
                p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        xd[b] = 1.f / iscale;
    }
}

/* A K format's 8 scales and 8 mins (6 bits each, packed in 12 bytes) as 16 int16:
 * the scales, then the mins */
static inline __m256i k4_scales_mins(const uint8_t *q) {
    uint32_t packed[3];
    memcpy(packed, q, 12);
    /* put together in registers: four 32-bit stores read back as one 128-bit load would
     * wait for the stores to retire, at every super-block */
    const uint32_t sm0 = packed[0] & 0x3f3f3f3f, sm2 = packed[1] & 0x3f3f3f3f;
    const uint32_t sm1 = (packed[2] & 0x0f0f0f0f) | ((packed[0] >> 6) & 0x03030303) << 4;
    const uint32_t sm3 = ((packed[2] >> 4) & 0x0f0f0f0f) | ((packed[1] >> 6) & 0x03030303) << 4;
    return _mm256_cvtepu8_epi16(_mm_set_epi32((int)sm3, (int)sm2, (int)sm1, (int)sm0));
}

/* Q4_K (Q5_K with five) against Q8_K rows: each 32-value sub-block's integer products
 * scaled by its 6-bit scale in integers, one float multiply a super-block; the mins from
 * the 16-sums. */
static void row_k_q8k(int five, const int8_t *xq, const float *xd, const int16_t *bsums,
                      int64_t m, int64_t k, const uint8_t *w, float *sums) {
    __m256 acc[MAX_ROWS];
    float mins[MAX_ROWS];
    const int64_t nsb = k / 256;
    for (int64_t r = 0; r < m; r++) {
        acc[r] = _mm256_setzero_ps();
        mins[r] = 0.f;
    }
    const __m256i low4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const uint8_t *qs = w + (five ? 48 : 16);
    for (int64_t i = 0; i < nsb; i++, w += five ? 176 : 144, qs += five ? 176 : 144) {
        const float d = half_to_float(w), dmin = half_to_float(w + 2);
        const __m256i sc_mn = k4_scales_mins(w + 4);
        const __m128i mins16 = _mm256_extracti128_si256(sc_mn, 1);
        /* each sub-block's scale in every 16-bit lane */
        const __m256i scales = _mm256_permute2x128_si256(sc_mn, sc_mn, 0x00);
        __m256i codes[8], scale[8];
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            codes[2 * c] = _mm256_and_si256(bytes, low4);
            codes[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
        }
        if (five) { /* Q5_K: sub-block s's fifth bits are bit s of the 32 bytes at 16 */
            const __m256i high = _mm256_loadu_si256((const __m256i *)(w + 16));
            for (int s = 0; s < 8; s++)
                codes[s] = _mm256_or_si256(codes[s], _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(high, s), one), 4));
        }
        for (int s = 0; s < 8; s++)
            scale[s] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * s)));
        for (int64_t r = 0; r < m; r++) {
            const int8_t *q8 = xq + r * k + 256 * i;
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(bsums + (r * nsb + i) * 16));
            __m256i sumi = _mm256_setzero_si256();
            for (int s = 0; s < 8; s++) {
                const __m256i p = _mm256_maddubs_epi16(
                    codes[s], _mm256_loadu_si256((const __m256i *)(q8 + 32 * s)));
                sumi = madd_s16_add(sumi, scale[s], p);
            }
            /* the 32-sums (pairs of 16-sums) against the mins */
            const __m128i sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs),
                                                  _mm256_extracti128_si256(bs, 1));
            const __m128i summ = _mm_madd_epi16(mins16, sums32);
            const float dx = xd[r * nsb + i];
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc[r]);
            mins[r] += dmin * dx * (float)hsum_epi32_128(summ);
        }
    }
    for (int64_t r = 0; r < m; r++) sums[r] = hsum(acc[r]) - mins[r];
}

/* Q6_K against Q8_K rows: the 6-bit codes as unsigned bytes (0-63) in registers, each 16
 * values' products scaled by their int8 scale in integers; the codes' offset of 32 taken
 * off through the 16-sums. */
static void row_q6_k_q8k(const int8_t *xq, const float *xd, const int16_t *bsums, int64_t m,
                         int64_t k, const uint8_t *w, float *sums) {
    __m256 acc[MAX_ROWS];
    float offs[MAX_ROWS];
    const int64_t nsb = k / 256;
    for (int64_t r = 0; r < m; r++) {
        acc[r] = _mm256_setzero_ps();
        offs[r] = 0.f;
    }
    const __m256i low4 = _mm256_set1_epi8(0xF), low2 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < nsb; i++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = half_to_float(w + 208);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i codes[8], scales[8];
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            /* scales 8h-8h+7 in both halves of a register */
            const __m256i half = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                   : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            for (int part = 0; part < 4; part++) {
                const __m256i lo = part & 1 ? l1 : l0;
                const __m256i nib = part < 2 ? _mm256_and_si256(lo, low4)
                                             : _mm256_and_si256(_mm256_srli_epi16(lo, 4), low4);
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * part), low2);
                codes[4 * h + part] = _mm256_or_si256(nib, _mm256_slli_epi16(top, 4));
                /* values 128h + 32 part + 0-15 and + 16-31: scales 8h + 2 part and + 1 */
                const short lo_pick = (short)(0x0100 + 0x0202 * (2 * part)),
                            hi_pick = (short)(0x0100 + 0x0202 * (2 * part + 1));
                scales[4 * h + part] = _mm256_shuffle_epi8(
                    half, _mm256_setr_epi16(lo_pick, lo_pick, lo_pick, lo_pick, lo_pick,
                                            lo_pick, lo_pick, lo_pick, hi_pick, hi_pick,
                                            hi_pick, hi_pick, hi_pick, hi_pick, hi_pick,
                                            hi_pick));
            }
        }
        for (int64_t r = 0; r < m; r++) {
            const int8_t *q8 = xq + r * k + 256 * i;
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(bsums + (r * nsb + i) * 16));
            __m256i sumi = _mm256_setzero_si256();
            for (int v = 0; v < 8; v++) {
                const __m256i p = _mm256_maddubs_epi16(
                    codes[v], _mm256_loadu_si256((const __m256i *)(q8 + 32 * v)));
                sumi = madd_s16_add(sumi, scales[v], p);
            }
            /* the codes' offset: 32 x each 16 values' scale x their 16-sum */
            const __m256i off = _mm256_madd_epi16(sc16, bs);
            const float dx = xd[r * nsb + i];
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sumi), acc[r]);
            offs[r] += 32.f * d * dx * (float)hsum_epi32_128(_mm_add_epi32(
                _mm256_castsi256_si128(off), _mm256_extracti128_si256(off, 1)));
        }
    }
    for (int64_t r = 0; r < m; r++) sums[r] = hsum(acc[r]) - offs[r];
}
#endif

#ifdef __AVX2__
/* One row (a single stream's decode step), kept in registers: the kernels above with
 * m = 1, where nothing is reused across rows, so nothing is decoded ahead. */
static inline __m256i k4_scale(__m256i scales, int s) {
    return _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * s)));
}

static float row_q8_0_q8_1(const int8_t *xq, const float *xd, int64_t k, const uint8_t *w) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const int64_t nb = k / 32;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2, w += 68) {
        _mm_prefetch((const char *)(w + PREFETCH_BYTES), _MM_HINT_T0);
        const __m256i q0 = _mm256_loadu_si256((const __m256i *)(w + 2));
        const __m256i q1 = _mm256_loadu_si256((const __m256i *)(w + 36));
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 32 * b + 32));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w) * xd[b]),
                               _mm256_cvtepi32_ps(dot_s8(q0, x0)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w + 34) * xd[b + 1]),
                               _mm256_cvtepi32_ps(dot_s8(q1, x1)), acc1);
    }
    for (; b < nb; b++, w += 34)
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w) * xd[b]),
                               _mm256_cvtepi32_ps(dot_s8(
                                   _mm256_loadu_si256((const __m256i *)(w + 2)),
                                   _mm256_loadu_si256((const __m256i *)(xq + 32 * b)))),
                               acc0);
    return hsum(_mm256_add_ps(acc0, acc1));
}

static float row_q4_k_q8k_1(const int8_t *xq, const float *xd, const int16_t *bsums,
                            int64_t k, const uint8_t *w) {
    __m256 acc = _mm256_setzero_ps();
    __m128 acc_m = _mm_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0xF);
    for (int64_t i = 0; i < k / 256; i++, w += 144, xq += 256, bsums += 16) {
        _mm_prefetch((const char *)(w + PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH_BYTES + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PREFETCH_BYTES + 128), _MM_HINT_T0);
        const __m256i sc_mn = k4_scales_mins(w + 4);
        const __m256i scales = _mm256_permute2x128_si256(sc_mn, sc_mn, 0x00);
        const __m256i bs = _mm256_loadu_si256((const __m256i *)bsums);
        const __m128i summ = _mm_madd_epi16(
            _mm256_extracti128_si256(sc_mn, 1),
            _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1)));
        __m256i sumi0 = _mm256_setzero_si256(), sumi1 = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * c));
            const __m256i p0 = _mm256_maddubs_epi16(
                _mm256_and_si256(bytes, low4), _mm256_loadu_si256((const __m256i *)(xq + 64 * c)));
            const __m256i p1 = _mm256_maddubs_epi16(
                _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4),
                _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32)));
            sumi0 = madd_s16_add(sumi0, k4_scale(scales, 2 * c), p0);
            sumi1 = madd_s16_add(sumi1, k4_scale(scales, 2 * c + 1), p1);
        }
        const float dx = xd[i];
        acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w) * dx),
                              _mm256_cvtepi32_ps(_mm256_add_epi32(sumi0, sumi1)), acc);
        acc_m = _mm_fmadd_ps(_mm_set1_ps(half_to_float(w + 2) * dx), _mm_cvtepi32_ps(summ),
                             acc_m);
    }
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    return hsum(acc) - _mm_cvtss_f32(acc_m);
}

/* Two Q4_K rows against one Q8_K row: each activation load and 16-sum serves both, and
 * the two rows' chains run side by side. Each row's sums are row_q4_k_q8k_1's. */
static void row_q4_k_q8k_pair(const int8_t *xq, const float *xd, const int16_t *bsums,
                              int64_t k, const uint8_t *w0, const uint8_t *w1, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 min0 = _mm_setzero_ps(), min1 = _mm_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0xF);
    for (int64_t i = 0; i < k / 256; i++, w0 += 144, w1 += 144, xq += 256, bsums += 16) {
        for (int line = 0; line < 144; line += 64) {
            _mm_prefetch((const char *)(w0 + PREFETCH_BYTES + line), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + PREFETCH_BYTES + line), _MM_HINT_T0);
        }
        const __m256i sc_mn0 = k4_scales_mins(w0 + 4), sc_mn1 = k4_scales_mins(w1 + 4);
        const __m256i scales0 = _mm256_permute2x128_si256(sc_mn0, sc_mn0, 0x00);
        const __m256i scales1 = _mm256_permute2x128_si256(sc_mn1, sc_mn1, 0x00);
        const __m256i bs = _mm256_loadu_si256((const __m256i *)bsums);
        const __m128i sums32 = _mm_hadd_epi16(_mm256_castsi256_si128(bs),
                                              _mm256_extracti128_si256(bs, 1));
        const __m128i summ0 = _mm_madd_epi16(_mm256_extracti128_si256(sc_mn0, 1), sums32);
        const __m128i summ1 = _mm_madd_epi16(_mm256_extracti128_si256(sc_mn1, 1), sums32);
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
        for (int c = 0; c < 4; c++) {
            const __m256i xlo = _mm256_loadu_si256((const __m256i *)(xq + 64 * c));
            const __m256i xhi = _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32));
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(w0 + 16 + 32 * c));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(w1 + 16 + 32 * c));
            a0 = madd_s16_add(a0, k4_scale(scales0, 2 * c),
                              _mm256_maddubs_epi16(_mm256_and_si256(q0, low4), xlo));
            a1 = madd_s16_add(a1, k4_scale(scales0, 2 * c + 1), _mm256_maddubs_epi16(
                _mm256_and_si256(_mm256_srli_epi16(q0, 4), low4), xhi));
            b0 = madd_s16_add(b0, k4_scale(scales1, 2 * c),
                              _mm256_maddubs_epi16(_mm256_and_si256(q1, low4), xlo));
            b1 = madd_s16_add(b1, k4_scale(scales1, 2 * c + 1), _mm256_maddubs_epi16(
                _mm256_and_si256(_mm256_srli_epi16(q1, 4), low4), xhi));
        }
        const float dx = xd[i];
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w0) * dx),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w1) * dx),
                               _mm256_cvtepi32_ps(_mm256_add_epi32(b0, b1)), acc1);
        min0 = _mm_fmadd_ps(_mm_set1_ps(half_to_float(w0 + 2) * dx), _mm_cvtepi32_ps(summ0),
                            min0);
        min1 = _mm_fmadd_ps(_mm_set1_ps(half_to_float(w1 + 2) * dx), _mm_cvtepi32_ps(summ1),
                            min1);
    }
    min0 = _mm_add_ps(min0, _mm_movehl_ps(min0, min0));
    min0 = _mm_add_ss(min0, _mm_movehdup_ps(min0));
    min1 = _mm_add_ps(min1, _mm_movehl_ps(min1, min1));
    min1 = _mm_add_ss(min1, _mm_movehdup_ps(min1));
    out[0] = hsum(acc0) - _mm_cvtss_f32(min0);
    out[1] = hsum(acc1) - _mm_cvtss_f32(min1);
}

static float row_q6_k_q8k_1(const int8_t *xq, const float *xd, const int16_t *bsums,
                            int64_t k, const uint8_t *w) {
    __m256 acc = _mm256_setzero_ps(), acc_off = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0xF), low2 = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < k / 256; i++, w += 210, xq += 256, bsums += 16) {
        for (int line = 0; line < 210; line += 64)
            _mm_prefetch((const char *)(w + PREFETCH_BYTES + line), _MM_HINT_T0);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192)));
        const float dd = half_to_float(w + 208) * xd[i];
        __m256i sumi0 = _mm256_setzero_si256(), sumi1 = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(w + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(w + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            const __m256i half = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)
                                   : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            for (int part = 0; part < 4; part++) {
                const __m256i lo = part & 1 ? l1 : l0;
                const __m256i nib = part < 2 ? _mm256_and_si256(lo, low4)
                                             : _mm256_and_si256(_mm256_srli_epi16(lo, 4), low4);
                const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * part), low2);
                const __m256i codes = _mm256_or_si256(nib, _mm256_slli_epi16(top, 4));
                const short a = (short)(0x0100 + 0x0202 * (2 * part)),
                            b = (short)(0x0100 + 0x0202 * (2 * part + 1));
                const __m256i scale = _mm256_shuffle_epi8(
                    half, _mm256_setr_epi16(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b));
                const __m256i p = _mm256_maddubs_epi16(
                    codes, _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * part)));
                if (part & 1)
                    sumi1 = madd_s16_add(sumi1, scale, p);
                else
                    sumi0 = madd_s16_add(sumi0, scale, p);
            }
        }
        const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)bsums));
        const __m256 ddv = _mm256_set1_ps(dd);
        acc = _mm256_fmadd_ps(ddv, _mm256_cvtepi32_ps(_mm256_add_epi32(sumi0, sumi1)), acc);
        acc_off = _mm256_fmadd_ps(ddv, _mm256_cvtepi32_ps(off), acc_off);
    }
    return hsum(acc) - 32.f * hsum(acc_off);
}
#endif
