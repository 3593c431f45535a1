/* y = x W^T + b for few rows of x (float32, CPU): the decode steps' matmuls.
 *
 * With a handful of rows a linear layer is a stream over its weights. MKL's GEMM
 * streams them at about half of what this machine's memory delivers when the batch
 * has 1..32 rows (measured on bench-100m's layer shapes, weights cold in DRAM): it
 * is tuned for larger blocks. Here each thread takes a run of output rows and reads
 * each weight row once per x row while it stays in L1, four weight rows at a time so
 * four loads are in flight; that keeps the stream near the bandwidth of a plain read.
 *
 * Layouts: x [M, K], w [N, K] (nn.Linear's), bias [N] or NULL, y [M, N]; contiguous.
 */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>

static inline float hsum(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#endif

static float dot(const float *a, const float *b, int64_t k) {
    float s = 0.f;
    for (int64_t i = 0; i < k; i++) s += a[i] * b[i];
    return s;
}

/* Four output columns [n0, n0 + 4) of every row of y. */
static void four_columns(const float *x, const float *w, float *y, int64_t m_rows,
                         int64_t n, int64_t k, int64_t n0) {
    const float *w0 = w + n0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    for (int64_t m = 0; m < m_rows; m++) {
        const float *xm = x + m * k;
        float *ym = y + m * n + n0;
        int64_t i = 0;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#ifdef __AVX2__
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (; i + 8 <= k; i += 8) {
            const __m256 xv = _mm256_loadu_ps(xm + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
        }
        s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
#endif
        ym[0] = s0 + dot(xm + i, w0 + i, k - i);
        ym[1] = s1 + dot(xm + i, w1 + i, k - i);
        ym[2] = s2 + dot(xm + i, w2 + i, k - i);
        ym[3] = s3 + dot(xm + i, w3 + i, k - i);
    }
}

void few_rows_linear(const float *x, const float *w, const float *bias, float *y,
                     int64_t m_rows, int64_t n, int64_t k) {
    const int64_t n4 = n - n % 4;
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < n4; n0 += 4) four_columns(x, w, y, m_rows, n, k, n0);
    for (int64_t c = n4; c < n; c++)
        for (int64_t m = 0; m < m_rows; m++) y[m * n + c] = dot(x + m * k, w + c * k, k);
    if (bias != 0)
        for (int64_t m = 0; m < m_rows; m++)
            for (int64_t c = 0; c < n; c++) y[m * n + c] += bias[c];
}
