/* The layers' elementwise work in one pass each (float32, CPU): RMSNorm, SiLU-and-
 * multiply, rotary embedding. As torch ops they are five to ten small kernels per
 * call, each reading and writing the whole activation; in a step of a few hundred
 * tokens that traffic and the per-op dispatch cost several percent of the step.
 * Each follows torch's formula and order of operations, so results differ from
 * torch's only by float32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include "vec_math.h"

/* out = weight * (x * 1/sqrt(mean(x^2) + eps)) per row of dim. */
void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
              float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* out[r, i] = silu(gate) * up with gate_up[r] = [gate (inter) | up (inter)];
 * silu(g) = g / (1 + e^-g), as torch computes it. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Rotate-half rotary embedding, in place, on the q and k heads of each row of a fused
 * qkv activation: row t holds num_q then num_k heads of head_dim from its start,
 * rows are row_stride floats apart. cos/sin: [positions, head_dim] tables. */
void rotary(float *qkv, int64_t row_stride, int64_t rows, const int64_t *positions,
            const float *cos_table, const float *sin_table, int64_t num_q, int64_t num_k,
            int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_table + positions[t] * head_dim;
        const float *s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < num_q + num_k; h++) {
            float *x = qkv + t * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] + (-b) * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}
