/* Attention straight from the paged KV pool (float32, CPU), one query token per row.
 *
 * A row is a decode token or one token of a prefill chunk: it attends to the first
 * seq_lens[row] keys of its block table (causal order is just each row's own length;
 * the chunk's K/V are in the pool before the call). For each row the scores of every query head
 * against every cached key are computed by following the block table, softmaxed,
 * and used to sum the values. Each token's K and V rows (all kv heads, contiguous in
 * the pool) are read once, in order, with no gathered copy of the context: the pool is
 * streamed like one array, which the hardware prefetcher follows best (tiling per head
 * or per 8 keys measured slower). Query heads that share a kv head (GQA) reuse the row
 * while it is in cache. The softmax's exponentials are vectorised (AVX2): as scalar
 * expf calls they took about a third of the time with the context in cache.
 *
 * Layouts: q/out [S, H, D]; k/v pool [blocks, block_size, KVH, D];
 * tables [S, table_stride] (block ids); seq_lens [S] (keys to attend to).
 * Rows run in parallel; the rows of one prompt chunk share their keys in cache.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "vec_math.h"

#ifdef __AVX2__
static void softmax_avx2(float *sc, int64_t n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sc + t));
    float tmp[8], mx = -INFINITY;
    _mm256_storeu_ps(tmp, vmax);
    for (int i = 0; i < 8; i++) mx = tmp[i] > mx ? tmp[i] : mx;
    for (int64_t u = t; u < n; u++) mx = sc[u] > mx ? sc[u] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (t = 0; t + 8 <= n; t += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc + t), vmx));
        _mm256_storeu_ps(sc + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (int64_t u = t; u < n; u++) { sc[u] = expf(sc[u] - mx); sum += sc[u]; }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(sc + t, _mm256_mul_ps(_mm256_loadu_ps(sc + t), inv));
    for (int64_t u = t; u < n; u++) sc[u] *= 1.f / sum;
}

#endif

static void softmax(float *sc, int64_t n) {
#ifdef __AVX2__
    softmax_avx2(sc, n);
#else
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
    for (int64_t t = 0; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) sc[t] *= inv;
#endif
}

/* Ask for row `t % block_size` of the block after t's, one row per row computed on: the
 * hardware prefetcher stops at page boundaries and the pool's blocks are scattered
 * (measured: 1.4x on randomly placed blocks, no change on blocks in order). */
static inline void prefetch_next_block_row(const float *pool, const int64_t *table,
                                           int64_t t, int64_t len, int64_t block_size,
                                           int64_t row) {
    const int64_t next = t / block_size + 1;
    if (next * block_size >= len) return;
    const char *p = (const char *)(pool + (table[next] * block_size + t % block_size) * row);
    for (int64_t b = 0; b < row * (int64_t)sizeof(float); b += 64) __builtin_prefetch(p + b, 0, 2);
}

#ifdef __AVX2__
/* Lane j of the result is the sum of a[j]'s eight lanes. */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                           __m256 a6, __m256 a7) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                         _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* One sequence with head_dim D known at compile time (inlined per D).
 * Scores: eight keys at a time per head, eight running sums reduced together, so the
 * horizontal reduction is paid once per eight keys instead of once per key. Values:
 * one block at a time; each head's output stays in registers while the block's rows
 * (in L1) are summed into it, then is stored once. Same sums as the generic path, in
 * a different order: results agree to float rounding. */
static inline __attribute__((always_inline)) void decode_seq_avx2(
        const float *qs, const float *k_pool, const float *v_pool, const int64_t *table,
        float *os, float *scores, int64_t first, int64_t len, int64_t num_heads,
        int64_t group, int64_t block_size, int64_t row, float scale, const int64_t D) {
    const int64_t n = len - first;
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t t = first;
    for (; t + 8 <= len; t += 8) {
        const float *k[8];
        for (int j = 0; j < 8; j++) {
            k[j] = k_pool + (table[(t + j) / block_size] * block_size + (t + j) % block_size) * row;
            prefetch_next_block_row(k_pool, table, t + j, len, block_size, row);
        }
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = qs + h * D;
            const int64_t off = (h / group) * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
                   a6 = a0, a7 = a0;
            for (int64_t c = 0; c < D; c += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + c);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + off + c), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + off + c), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + off + c), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + off + c), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + off + c), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + off + c), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + off + c), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + off + c), a7);
            }
            _mm256_storeu_ps(scores + h * n + (t - first),
                             _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
        }
    }
    for (; t < len; t++) {
        const float *k = k_pool + (table[t / block_size] * block_size + t % block_size) * row;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = qs + h * D, *kh = k + (h / group) * D;
            __m256 a = _mm256_setzero_ps();
            for (int64_t c = 0; c < D; c += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c), _mm256_loadu_ps(kh + c), a);
            scores[h * n + (t - first)] = hsum(a) * scale;
        }
    }
    for (int64_t h = 0; h < num_heads; h++) softmax(scores + h * n, n);
    __m256 acc[D / 8];
    for (int64_t h = 0; h < num_heads; h++)
        for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(os + h * D + c, _mm256_setzero_ps());
    for (t = first; t < len;) {
        const int64_t stop = (t / block_size + 1) * block_size < len
                                 ? (t / block_size + 1) * block_size : len;
        const float *vb = v_pool + (table[t / block_size] * block_size + t % block_size) * row;
        for (int64_t u = t; u < stop; u++)
            prefetch_next_block_row(v_pool, table, u, len, block_size, row);
        for (int64_t h = 0; h < num_heads; h++) {
            const float *vh = vb + (h / group) * D;
            const float *p = scores + h * n + (t - first);
            for (int64_t c = 0; c < D / 8; c++) acc[c] = _mm256_loadu_ps(os + h * D + 8 * c);
            for (int64_t u = 0; u < stop - t; u++) {
                const __m256 pu = _mm256_set1_ps(p[u]);
                for (int64_t c = 0; c < D / 8; c++)
                    acc[c] = _mm256_fmadd_ps(pu, _mm256_loadu_ps(vh + u * row + 8 * c), acc[c]);
            }
            for (int64_t c = 0; c < D / 8; c++) _mm256_storeu_ps(os + h * D + 8 * c, acc[c]);
        }
        t = stop;
    }
}
#endif

void paged_attention_rows(const float *q, const float *k_pool, const float *v_pool,
                            const int64_t *tables, int64_t table_stride,
                            const int64_t *seq_lens, float *out, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t window) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per token in one block */
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = seq_lens[s];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t n = len - first;
        const int64_t *table = tables + s * table_stride;
        const float *qs = q + s * num_heads * head_dim;
        float *os = out + s * num_heads * head_dim;
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * n)); /* [H, n] */
#ifdef __AVX2__
        if (head_dim == 64 || head_dim == 128) {
            if (head_dim == 64)
                decode_seq_avx2(qs, k_pool, v_pool, table, os, scores, first, len, num_heads,
                                group, block_size, row, scale, 64);
            else
                decode_seq_avx2(qs, k_pool, v_pool, table, os, scores, first, len, num_heads,
                                group, block_size, row, scale, 128);
            free(scores);
            continue;
        }
#endif
        for (int64_t t = first; t < len; t++) {
            const float *k = k_pool + (table[t / block_size] * block_size + t % block_size) * row;
            prefetch_next_block_row(k_pool, table, t, len, block_size, row);
            for (int64_t h = 0; h < num_heads; h++) {
                const float *qh = qs + h * head_dim;
                const float *kh = k + (h / group) * head_dim;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < head_dim; i++) dot += qh[i] * kh[i];
                scores[h * n + (t - first)] = dot * scale;
            }
        }
        for (int64_t h = 0; h < num_heads; h++) softmax(scores + h * n, n);
        for (int64_t i = 0; i < num_heads * head_dim; i++) os[i] = 0.f;
        for (int64_t t = first; t < len; t++) {
            const float *v = v_pool + (table[t / block_size] * block_size + t % block_size) * row;
            prefetch_next_block_row(v_pool, table, t, len, block_size, row);
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * n + (t - first)];
                const float *vh = v + (h / group) * head_dim;
                float *o = os + h * head_dim;
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) o[i] += p * vh[i];
            }
        }
        free(scores);
    }
}
