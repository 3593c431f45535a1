/* Weight-only 4-bit linear layers with float activations (compressed-tensors'
 * pack-quantized W4A16, grouped, symmetric or asymmetric):
 * y[r, j] = sum_k x[r, k] * (q[j, k] - z[j, g]) * s[j, g], g = k / group.
 *
 * The weight stays 4 bits a value: codes [n, k/2] uint8, each run of 16 bytes holding
 * 32 values (byte i: value i in the low nibble, value i + 16 in the high one), the
 * codes unsigned (0..15); scales [n, k/group] float32; zeros [n, k/group] int8, the
 * code that means 0 (8 for a symmetric layer). Codes are widened to float in registers
 * and each group's sum is scaled once (dequantize-then-multiply's products, another
 * order). int4_dequantize writes the exact dequantized floats, (q - z) * s, for the
 * tiles that longer steps multiply with torch's GEMM. Threads split the weight rows.
 */
#include <stdint.h>
#include "vec_math.h"

#define MAX_ROWS 8

static inline int valid(int64_t m, int64_t k, int64_t group) {
    return group >= 32 && group % 32 == 0 && k % group == 0 && m >= 1 && m <= MAX_ROWS;
}

/* the 32 codes of a run of 16 bytes, minus the zero, as floats */
static inline void widen_run(const uint8_t *b, int z, float *out) {
    for (int i = 0; i < 16; i++) {
        out[i] = (float)((b[i] & 0xF) - z);
        out[i + 16] = (float)((b[i] >> 4) - z);
    }
}

#ifdef __AVX2__
static void row_int4(const float *x, int64_t m, int64_t k, const uint8_t *w,
                     const float *scales, const int8_t *zeros, int64_t group, float *sums) {
    const __m128i low = _mm_set1_epi8(0xF);
    for (int64_t r = 0; r < m; r++) sums[r] = 0.f;
    for (int64_t g = 0; g < k / group; g++) {
        const __m256 zf = _mm256_set1_ps((float)zeros[g]);
        __m256 acc[MAX_ROWS];
        for (int64_t r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += 32) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(w + i / 2));
            const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
            const __m256 w0 = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), zf);
            const __m256 w1 = _mm256_sub_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), zf);
            const __m256 w2 = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), zf);
            const __m256 w3 = _mm256_sub_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), zf);
            for (int64_t r = 0; r < m; r++) {
                const float *xr = x + r * k + i;
                __m256 a = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r]);
                a = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a);
                a = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), a);
                acc[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), a);
            }
        }
        for (int64_t r = 0; r < m; r++) sums[r] += hsum(acc[r]) * scales[g];
    }
}
#else
static void row_int4(const float *x, int64_t m, int64_t k, const uint8_t *w,
                     const float *scales, const int8_t *zeros, int64_t group, float *sums) {
    float buf[32];
    for (int64_t r = 0; r < m; r++) sums[r] = 0.f;
    for (int64_t g = 0; g < k / group; g++) {
        float part[MAX_ROWS] = {0};
        for (int64_t i = g * group; i < (g + 1) * group; i += 32) {
            widen_run(w + i / 2, zeros[g], buf);
            for (int64_t r = 0; r < m; r++) {
                const float *xr = x + r * k + i;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int t = 0; t < 32; t++) s += xr[t] * buf[t];
                part[r] += s;
            }
        }
        for (int64_t r = 0; r < m; r++) sums[r] += part[r] * scales[g];
    }
}
#endif

/* y[r * y_stride + j] = x[r, :] . dequantized w[j, :] for r < m (1-8), j < n. Returns
 * 0, or -1 when the group is not a multiple of 32 dividing k, or m is out of range. */
int64_t int4_rows(const float *x, int64_t m, int64_t k, const uint8_t *codes,
                  const float *scales, const int8_t *zeros, int64_t group, int64_t n,
                  float *y, int64_t y_stride) {
    if (!valid(m, k, group)) return -1;
    const int64_t groups = k / group;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float sums[MAX_ROWS];
        row_int4(x, m, k, codes + j * (k / 2), scales + j * groups, zeros + j * groups, group,
                 sums);
        for (int64_t r = 0; r < m; r++) y[r * y_stride + j] = sums[r];
    }
    return 0;
}

/* out [n, k] = (q - z) * s, the dequantized rows. Returns 0, or -1 for a bad group. */
int64_t int4_dequantize(const uint8_t *codes, const float *scales, const int8_t *zeros,
                        int64_t group, int64_t n, int64_t k, float *out) {
    if (!valid(1, k, group)) return -1;
    const int64_t groups = k / group;
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        float buf[32];
        for (int64_t i = 0; i < k; i += 32) {
            const int64_t g = j * groups + i / group;
            widen_run(codes + j * (k / 2) + i / 2, zeros[g], buf);
            for (int t = 0; t < 32; t++) out[j * k + i + t] = buf[t] * scales[g];
        }
    }
    return 0;
}
