/* Small AVX2 (and AVX-512) helpers shared by the kernels. */
#ifndef KVSERVE_VEC_MATH_H
#define KVSERVE_VEC_MATH_H
#ifdef __AVX2__
#include <immintrin.h>

static inline float hsum(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

/* e^x: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor series to r^6 (relative error
 * ~1e-7, float32 rounding level), then 2^n put in the exponent bits. x is clamped to
 * 88 above (e^88 is near float's largest) and below -87 the result is 0, as expf's
 * underflow. glibc's expf is scalar: vectorised, softmax and SiLU run several times
 * faster. */
static inline __m256 exp_avx2(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#ifdef __AVX512F__
/* exp_avx2 sixteen lanes at a time: the same steps, so each lane's bits are the same. */
static inline __m512 exp_avx512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~underflow, p, _mm512_castsi512_ps(bits));
}
#endif
/* Integer dot products of 32 bytes, in the int32 lanes of 4 bytes each: AVX-512 VNNI's
 * vpdpbusd and vpdpwssd on 256-bit registers where the build has them (one instruction,
 * the sum taken in 32 bits), else AVX2's vpmaddubsw and vpmaddwd (pairs summed in 16
 * bits first). The lanes are the same integers either way wherever a pair of byte
 * products fits in 16 bits, as every caller's operands do (a code or |w| <= 128 against
 * |x| <= 127). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI_DOT 1
/* acc + the sums of 4 products u * s (u unsigned bytes, s signed) */
static inline __m256i dot_u8s8_add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(acc, u, s);
}
/* acc + the sums of 2 products a * b (int16) */
static inline __m256i madd_s16_add(__m256i acc, __m256i a, __m256i b) {
    return _mm256_dpwssd_epi32(acc, a, b);
}
#else
static inline __m256i dot_u8s8_add(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
}
static inline __m256i madd_s16_add(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
#endif

/* The widest float32 vector of the build, for loops written once for either width:
 * sixteen lanes with AVX-512 (full speed where the CPU runs 512-bit ops whole), eight with
 * AVX2. A lane computes the same bits in both; only sums across lanes differ. */
#if defined(__AVX512F__)
typedef __m512 vecf;
#define VEC_LANES 16
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_set1 _mm512_set1_ps
#define vec_zero _mm512_setzero_ps
#define vec_add _mm512_add_ps
#define vec_sub _mm512_sub_ps
#define vec_mul _mm512_mul_ps
#define vec_div _mm512_div_ps
#define vec_max _mm512_max_ps
#define vec_fmadd _mm512_fmadd_ps
#define vec_exp exp_avx512
#define vec_reduce_add _mm512_reduce_add_ps
#define vec_reduce_max _mm512_reduce_max_ps
#elif defined(__AVX2__)
typedef __m256 vecf;
#define VEC_LANES 8
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_set1 _mm256_set1_ps
#define vec_zero _mm256_setzero_ps
#define vec_add _mm256_add_ps
#define vec_sub _mm256_sub_ps
#define vec_mul _mm256_mul_ps
#define vec_div _mm256_div_ps
#define vec_max _mm256_max_ps
#define vec_fmadd _mm256_fmadd_ps
#define vec_exp exp_avx2
#define vec_reduce_add hsum
static inline float vec_reduce_max(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
#endif
#endif
#endif
