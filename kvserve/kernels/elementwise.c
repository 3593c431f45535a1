/* The layers' elementwise work in one pass each (CPU; float32, and bfloat16 below):
 * RMSNorm, SiLU-and-multiply, rotary embedding. As torch ops they are five to ten
 * small kernels per call, each reading and writing the whole activation; in a step of
 * a few hundred tokens that traffic and the per-op dispatch cost several percent of the
 * step. Each follows torch's formula and order of operations, so results differ from
 * torch's only by float32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "step_parts.h"
#include "vec_math.h"

/* o = weight * (x * 1/sqrt(mean(x^2) + eps)) for one row of dim. */
static inline void rms_norm_row(const float *xr, const float *weight, float *o, int64_t dim,
                                float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (xr[i] * inv);
}

void rms_norm_part(const float *x, const float *weight, float *out, int64_t rows,
                   int64_t dim, float eps) {
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * dim, weight, out + r * dim, dim, eps);
}

void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
              float eps) {
#pragma omp parallel
    rms_norm_part(x, weight, out, rows, dim, eps);
}

/* Each q and k head of a fused qkv activation RMSNormed over its head_dim, in place
 * (Qwen3's q_norm and k_norm): row t holds num_q then num_k heads from its start, rows
 * row_stride floats apart; the q heads take q_weight, the k heads k_weight. */
void head_rms_norm_part(float *qkv, int64_t row_stride, int64_t rows, const float *q_weight,
                        const float *k_weight, int64_t num_q, int64_t num_k, int64_t head_dim,
                        float eps) {
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < num_q + num_k; h++) {
            float *x = qkv + t * row_stride + h * head_dim;
            rms_norm_row(x, h < num_q ? q_weight : k_weight, x, head_dim, eps);
        }
}

void head_rms_norm(float *qkv, int64_t row_stride, int64_t rows, const float *q_weight,
                   const float *k_weight, int64_t num_q, int64_t num_k, int64_t head_dim,
                   float eps) {
#pragma omp parallel
    head_rms_norm_part(qkv, row_stride, rows, q_weight, k_weight, num_q, num_k, head_dim, eps);
}

/* residual += x, then out = RMSNorm(residual), row by row: the residual add and the next
 * norm in one pass over rows still in cache (as separate ops, each read the activation a
 * GEMM had just left in the other core's cache). The same sums as add, then rms_norm. */
void add_rms_norm_part(const float *x, float *residual, const float *weight, float *out,
                       int64_t rows, int64_t dim, float eps) {
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < rows; r++) {
        float *res = residual + r * dim;
        const float *xr = x + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) res[i] = res[i] + xr[i];
        rms_norm_row(res, weight, out + r * dim, dim, eps);
    }
}

void add_rms_norm(const float *x, float *residual, const float *weight, float *out,
                  int64_t rows, int64_t dim, float eps) {
#pragma omp parallel
    add_rms_norm_part(x, residual, weight, out, rows, dim, eps);
}

/* out[r, i] = silu(gate) * up with gate_up[r] = [gate (inter) | up (inter)];
 * silu(g) = g / (1 + e^-g), as torch computes it. */
void silu_mul_part(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#ifdef __AVX2__ /* each lane the same steps whatever the width: the same bits */
        const vecf one = vec_set1(1.f), zero = vec_zero();
        for (; i + VEC_LANES <= inter; i += VEC_LANES) {
            const vecf gv = vec_load(g + i);
            const vecf s = vec_div(gv, vec_add(one, vec_exp(vec_sub(zero, gv))));
            vec_store(o + i, vec_mul(s, vec_load(u + i)));
        }
#if VEC_LANES == 16 /* a last eight */
        for (; i + 8 <= inter; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sv, _mm256_loadu_ps(u + i)));
        }
#endif
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel
    silu_mul_part(gate_up, out, rows, inter);
}

/* Rotate-half rotary embedding, in place, on the q and k heads of each row of a fused
 * qkv activation: row t holds num_q then num_k heads of head_dim from its start,
 * rows are row_stride floats apart. cos/sin: [positions, head_dim] tables. */
void rotary_part(float *qkv, int64_t row_stride, int64_t rows, const int64_t *positions,
                 const float *cos_table, const float *sin_table, int64_t num_q,
                 int64_t num_k, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp for schedule(static) nowait
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

void rotary(float *qkv, int64_t row_stride, int64_t rows, const int64_t *positions,
            const float *cos_table, const float *sin_table, int64_t num_q, int64_t num_k,
            int64_t head_dim) {
#pragma omp parallel
    rotary_part(qkv, row_stride, rows, positions, cos_table, sin_table, num_q, num_k,
                head_dim);
}

/* The same three for bfloat16 activations (a bf16 model), computed in float32 and
 * rounded to bf16 where torch's bf16 ops round: after x * 1/rms and after the weight
 * product; after each rotary product and after their sum. (SiLU-and-multiply in bf16
 * measured slower than torch's and stays there.) */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef __AVX2__
/* The same conversions eight at a time. */
static inline __m256 bf16x8_load(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline __m256 bf16x8_round(__m256 f) { /* to the nearest bf16, kept as float32 */
    const __m256i bits = _mm256_castps_si256(f), high = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_and_si256(
        _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), high);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_and_si256(bits, high),
                                              _mm256_set1_epi32(0x00400000));
    const __m256 is_nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return _mm256_castsi256_ps(
        _mm256_blendv_epi8(rounded, quiet_nan, _mm256_castps_si256(is_nan)));
}

static inline void bf16x8_store(uint16_t *p, __m256 f) {
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(bf16x8_round(f)), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0xd8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#endif

static inline void rms_norm_row_bf16(const uint16_t *xr, const uint16_t *weight, uint16_t *o,
                                     int64_t dim, float eps) {
    float ss = 0.f;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= dim; i += 8) {
        const __m256 v = bf16x8_load(xr + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    ss = hsum(acc);
#endif
    for (; i < dim; i++) ss += bf16_to_f32(xr[i]) * bf16_to_f32(xr[i]);
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
    i = 0;
#ifdef __AVX2__
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= dim; i += 8) {
        const __m256 normed = bf16x8_round(_mm256_mul_ps(bf16x8_load(xr + i), vinv));
        bf16x8_store(o + i, _mm256_mul_ps(bf16x8_load(weight + i), normed));
    }
#endif
    for (; i < dim; i++)
        o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows,
                   int64_t dim, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row_bf16(x + r * dim, weight, out + r * dim, dim, eps);
}

/* add_rms_norm for bfloat16: the sum rounded to bfloat16, as torch's bf16 add. */
void add_rms_norm_bf16(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *res = residual + r * dim;
        const uint16_t *xr = x + r * dim;
        for (int64_t i = 0; i < dim; i++)
            res[i] = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(xr[i]));
        rms_norm_row_bf16(res, weight, out + r * dim, dim, eps);
    }
}

void rotary_bf16(uint16_t *qkv, int64_t row_stride, int64_t rows, const int64_t *positions,
                 const uint16_t *cos_table, const uint16_t *sin_table, int64_t num_q,
                 int64_t num_k, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *c = cos_table + positions[t] * head_dim;
        const uint16_t *s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < num_q + num_k; h++) {
            uint16_t *x = qkv + t * row_stride + h * head_dim;
            int64_t i = 0;
#ifdef __AVX2__
            for (; i + 8 <= half; i += 8) {
                const __m256 a = bf16x8_load(x + i), b = bf16x8_load(x + i + half);
                const __m256 neg_b = _mm256_xor_ps(b, _mm256_set1_ps(-0.f));
                const __m256 lo = _mm256_add_ps(
                    bf16x8_round(_mm256_mul_ps(a, bf16x8_load(c + i))),
                    bf16x8_round(_mm256_mul_ps(neg_b, bf16x8_load(s + i))));
                const __m256 hi = _mm256_add_ps(
                    bf16x8_round(_mm256_mul_ps(b, bf16x8_load(c + i + half))),
                    bf16x8_round(_mm256_mul_ps(a, bf16x8_load(s + i + half))));
                bf16x8_store(x + i, lo);
                bf16x8_store(x + i + half, hi);
            }
#endif
            for (; i < half; i++) {
                const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[i + half]);
                x[i] = f32_to_bf16(round_bf16(a * bf16_to_f32(c[i]))
                                   + round_bf16(-b * bf16_to_f32(s[i])));
                x[i + half] = f32_to_bf16(round_bf16(b * bf16_to_f32(c[i + half]))
                                          + round_bf16(a * bf16_to_f32(s[i + half])));
            }
        }
    }
}
