/* The float passes around an int8 matmul (kvserve.model.quantization), one pass each
 * instead of six to eight torch ops: per-row symmetric quantization of the activations,
 * and rescaling of the int32 sums back to float32. Same formulas and order of
 * operations as the torch forms (x / scale rounded half to even; (sum * row scale) *
 * column scale + bias): for finite inputs the int8 values and scales are bit-identical
 * to torch's, the rescaled outputs agree to float32 rounding (the compiler may fuse the
 * bias add).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "vec_math.h"

/* q[r, :] = clamp(rint(x[r, :] / scale[r]), -128, 127), scale[r] = max|x[r, :]| / divisor
 * (1 for an all-zero row): with divisor 127 the codes stay within -127..127, with 127.5
 * (compressed-tensors') a value of -max rounds to -128. */
void quantize_rows_int8(const float *x, int8_t *q, float *scale, int64_t rows, int64_t cols,
                        float divisor) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        int8_t *qr = q + r * cols;
        float amax = 0.f;
        int64_t i = 0;
#ifdef __AVX2__
        /* four running maxima: the compiler does not vectorise fmaxf (NaN rules) */
        const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        __m256 m0 = _mm256_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
        for (; i + 32 <= cols; i += 32) {
            m0 = _mm256_max_ps(m0, _mm256_and_ps(no_sign, _mm256_loadu_ps(xr + i)));
            m1 = _mm256_max_ps(m1, _mm256_and_ps(no_sign, _mm256_loadu_ps(xr + i + 8)));
            m2 = _mm256_max_ps(m2, _mm256_and_ps(no_sign, _mm256_loadu_ps(xr + i + 16)));
            m3 = _mm256_max_ps(m3, _mm256_and_ps(no_sign, _mm256_loadu_ps(xr + i + 24)));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, lanes[j]);
#endif
        for (; i < cols; i++) amax = fmaxf(amax, fabsf(xr[i]));
        const float s = amax > 0.f ? amax / divisor : 1.f;
        scale[r] = s;
        i = 0;
#ifdef __AVX2__
        const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-128.f),
                     hi = _mm256_set1_ps(127.f);
        for (; i + 8 <= cols; i += 8) {
            __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xr + i), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m256i n = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
            const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(n),
                                              _mm256_extracti128_si256(n, 1));
            _mm_storel_epi64((__m128i *)(qr + i), _mm_packs_epi16(w, w));
        }
#endif
        for (; i < cols; i++) {
            const float v = rintf(xr[i] / s);
            qr[i] = (int8_t)(v != v ? 0.f : v < -128.f ? -128.f : v > 127.f ? 127.f : v);
        }
    }
}

/* out[r, c] = (acc[r, c] * row_scale[r]) * col_scale[c] (+ bias[c] when bias is given). */
void rescale_int32(const int32_t *acc, const float *row_scale, const float *col_scale,
                   const float *bias, float *out, int64_t rows, int64_t cols) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int32_t *a = acc + r * cols;
        float *o = out + r * cols;
        const float rs = row_scale[r];
        if (bias) {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = ((float)a[c] * rs) * col_scale[c] + bias[c];
        } else {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) o[c] = ((float)a[c] * rs) * col_scale[c];
        }
    }
}

/* acc[r, j] = sum_i x[r, i] * w[j, i] for r < m, j < n, exactly in int32 (x [m, k] and
 * w [n, k] int8, any values): torch._int_mm's sums, for CPUs whose int8 GEMM it runs
 * without VNNI through a slow path. Each weight row is read once for MAX_INT8_ROWS rows
 * of x at a time. 32 products at a time as |w| (unsigned) times x carrying w's sign,
 * summed in pairs to int16 (vpmaddubsw; VNNI's vpdpbusd sums four in int32 where the
 * build has it: the same integers), then in int32: exact while |x| <= 127, so an
 * activation of -128 is taken as -127 and each weight it met is subtracted once more
 * (-128 * w = -127 * w - w). Threads split the weight rows. */
#define MAX_INT8_ROWS 4
int64_t int8_matmul(const int8_t *x, int64_t m, int64_t k, const int8_t *w, int64_t n,
                    int32_t *acc) {
    /* each row's columns that held -128, and (only where there are any) x with them
     * raised to -127 */
    int64_t lows = 0;
    for (int64_t t = 0; t < m * k; t++) lows += x[t] == -128;
    int64_t *low_first = malloc((size_t)(m + 1) * sizeof(int64_t));
    int64_t *low_cols = malloc((size_t)(lows > 0 ? lows : 1) * sizeof(int64_t));
    int8_t *raised = lows > 0 ? malloc((size_t)(m * k)) : NULL;
    if (!low_first || !low_cols || (lows > 0 && !raised)) {
        free(low_first);
        free(low_cols);
        free(raised);
        return -1;
    }
    lows = 0;
    for (int64_t r = 0; r < m; r++) {
        low_first[r] = lows;
        for (int64_t i = 0; i < k; i++) {
            const int8_t v = x[r * k + i];
            if (v == -128) low_cols[lows++] = i;
            if (raised) raised[r * k + i] = v == -128 ? -127 : v;
        }
    }
    low_first[m] = lows;
    const int8_t *xc = raised ? raised : x;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const int8_t *wj = w + j * k;
        for (int64_t r0 = 0; r0 < m; r0 += MAX_INT8_ROWS) {
            const int64_t rows = m - r0 < MAX_INT8_ROWS ? m - r0 : MAX_INT8_ROWS;
            int32_t sums[MAX_INT8_ROWS] = {0, 0, 0, 0};
            int64_t i = 0;
#ifdef __AVX2__
            __m256i s[MAX_INT8_ROWS];
            for (int64_t r = 0; r < rows; r++) s[r] = _mm256_setzero_si256();
            for (; i + 32 <= k; i += 32) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(wj + i));
                const __m256i aw = _mm256_abs_epi8(wv);
                for (int64_t r = 0; r < rows; r++) {
                    const __m256i xv = _mm256_sign_epi8(
                        _mm256_loadu_si256((const __m256i *)(xc + (r0 + r) * k + i)), wv);
                    s[r] = dot_u8s8_add(s[r], aw, xv);
                }
            }
            for (int64_t r = 0; r < rows; r++) {
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s[r]),
                                          _mm256_extracti128_si256(s[r], 1));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
                sums[r] = _mm_cvtsi128_si32(t);
            }
#endif
            for (int64_t r = 0; r < rows; r++) {
                const int8_t *xr = xc + (r0 + r) * k;
                for (int64_t t = i; t < k; t++) sums[r] += (int32_t)xr[t] * (int32_t)wj[t];
                for (int64_t c = low_first[r0 + r]; c < low_first[r0 + r + 1]; c++)
                    sums[r] -= wj[low_cols[c]];
                acc[(r0 + r) * n + j] = sums[r];
            }
        }
    }
    free(raised);
    free(low_first);
    free(low_cols);
    return 0;
}
