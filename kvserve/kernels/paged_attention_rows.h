/* The attention kernel for one KV element type; included once per type by
 * paged_attention.c with these macros defined:
 *   KV_T            the pool's element type (float, or uint16_t for float16 / bfloat16)
 *   KV_NAME(f)      f with the type's suffix (paged_attention_rows -> ..._f16)
 *   KV_LOAD8(p)     eight elements at p as an __m256 (AVX2 builds)
 *   KV_LOAD1(p)     one element at p as a float
 *   KV_VECTOR       1 when KV_LOAD8 can be built (float16 needs F16C besides AVX2)
 * Queries, scores, sums and outputs are float32 whatever the pool holds: a lower-
 * precision pool only halves the bytes streamed per key, the bound of decode attention.
 */

#if defined(__AVX2__) && KV_VECTOR
/* One sequence with head_dim D known at compile time (inlined per D).
 * Scores: eight keys at a time per head, eight running sums reduced together, so the
 * horizontal reduction is paid once per eight keys instead of once per key. Values:
 * one block at a time; each head's output stays in registers while the block's rows
 * (in L1) are summed into it, then is stored once. Same sums as the generic path, in
 * a different order: results agree to float rounding. */
static inline __attribute__((always_inline)) void KV_NAME(decode_seq_avx2)(
        const float *qs, const KV_T *k_pool, const KV_T *v_pool, const int64_t *table,
        float *os, float *scores, int64_t first, int64_t len, int64_t pf_len,
        int64_t num_heads, int64_t group, int64_t block_size, int64_t row, float scale,
        const int64_t D) {
    const int64_t n = len - first;
    const int64_t row_bytes = row * (int64_t)sizeof(KV_T);
    const __m256 vscale = _mm256_set1_ps(scale);
    int64_t t = first;
    for (; t + 8 <= len; t += 8) {
        const KV_T *k[8];
        for (int j = 0; j < 8; j++) {
            k[j] = k_pool + (table[(t + j) / block_size] * block_size + (t + j) % block_size) * row;
            prefetch_next_block_row((const char *)k_pool, table, t + j, pf_len, block_size, row_bytes);
        }
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = qs + h * D;
            const int64_t off = (h / group) * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
                   a6 = a0, a7 = a0;
            for (int64_t c = 0; c < D; c += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + c);
                a0 = _mm256_fmadd_ps(qv, KV_LOAD8(k[0] + off + c), a0);
                a1 = _mm256_fmadd_ps(qv, KV_LOAD8(k[1] + off + c), a1);
                a2 = _mm256_fmadd_ps(qv, KV_LOAD8(k[2] + off + c), a2);
                a3 = _mm256_fmadd_ps(qv, KV_LOAD8(k[3] + off + c), a3);
                a4 = _mm256_fmadd_ps(qv, KV_LOAD8(k[4] + off + c), a4);
                a5 = _mm256_fmadd_ps(qv, KV_LOAD8(k[5] + off + c), a5);
                a6 = _mm256_fmadd_ps(qv, KV_LOAD8(k[6] + off + c), a6);
                a7 = _mm256_fmadd_ps(qv, KV_LOAD8(k[7] + off + c), a7);
            }
            _mm256_storeu_ps(scores + h * n + (t - first),
                             _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
        }
    }
    for (; t < len; t++) {
        const KV_T *k = k_pool + (table[t / block_size] * block_size + t % block_size) * row;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = qs + h * D;
            const KV_T *kh = k + (h / group) * D;
            __m256 a = _mm256_setzero_ps();
            for (int64_t c = 0; c < D; c += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c), KV_LOAD8(kh + c), a);
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
        const KV_T *vb = v_pool + (table[t / block_size] * block_size + t % block_size) * row;
        for (int64_t u = t; u < stop; u++)
            prefetch_next_block_row((const char *)v_pool, table, u, pf_len, block_size, row_bytes);
        for (int64_t h = 0; h < num_heads; h++) {
            const KV_T *vh = vb + (h / group) * D;
            const float *p = scores + h * n + (t - first);
            for (int64_t c = 0; c < D / 8; c++) acc[c] = _mm256_loadu_ps(os + h * D + 8 * c);
            for (int64_t u = 0; u < stop - t; u++) {
                const __m256 pu = _mm256_set1_ps(p[u]);
                for (int64_t c = 0; c < D / 8; c++)
                    acc[c] = _mm256_fmadd_ps(pu, KV_LOAD8(vh + u * row + 8 * c), acc[c]);
            }
            for (int64_t c = 0; c < D / 8; c++) _mm256_storeu_ps(os + h * D + 8 * c, acc[c]);
        }
        t = stop;
    }
}
#endif

void KV_NAME(paged_attention_rows)(const float *q, const KV_T *k_pool, const KV_T *v_pool,
                                   const int64_t *tables, int64_t table_stride,
                                   const int64_t *seq_lens, float *out, int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, int64_t window) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* elements per token in one block */
    const int64_t row_bytes = row * (int64_t)sizeof(KV_T);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t len = seq_lens[s];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t n = len - first;
        const int64_t *table = tables + s * table_stride;
        const float *qs = q + s * num_heads * head_dim;
        float *os = out + s * num_heads * head_dim;
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * n)); /* [H, n] */
        /* A row after the first of a prompt chunk finds its keys in cache, put there by
         * the row before it: prefetching them again only costs (15 % of a prefill). */
        const int continues =
            s > 0 && len == seq_lens[s - 1] + 1 && table[0] == table[-table_stride];
        const int64_t pf_len = continues ? 0 : len;
#if defined(__AVX2__) && KV_VECTOR
        if (head_dim == 64 || head_dim == 128) {
            if (head_dim == 64)
                KV_NAME(decode_seq_avx2)(qs, k_pool, v_pool, table, os, scores, first, len,
                                         pf_len, num_heads, group, block_size, row, scale, 64);
            else
                KV_NAME(decode_seq_avx2)(qs, k_pool, v_pool, table, os, scores, first, len,
                                         pf_len, num_heads, group, block_size, row, scale, 128);
            free(scores);
            continue;
        }
#endif
        for (int64_t t = first; t < len; t++) {
            const KV_T *k = k_pool + (table[t / block_size] * block_size + t % block_size) * row;
            prefetch_next_block_row((const char *)k_pool, table, t, pf_len, block_size, row_bytes);
            for (int64_t h = 0; h < num_heads; h++) {
                const float *qh = qs + h * head_dim;
                const KV_T *kh = k + (h / group) * head_dim;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t i = 0; i < head_dim; i++) dot += qh[i] * KV_LOAD1(kh + i);
                scores[h * n + (t - first)] = dot * scale;
            }
        }
        for (int64_t h = 0; h < num_heads; h++) softmax(scores + h * n, n);
        for (int64_t i = 0; i < num_heads * head_dim; i++) os[i] = 0.f;
        for (int64_t t = first; t < len; t++) {
            const KV_T *v = v_pool + (table[t / block_size] * block_size + t % block_size) * row;
            prefetch_next_block_row((const char *)v_pool, table, t, pf_len, block_size, row_bytes);
            for (int64_t h = 0; h < num_heads; h++) {
                const float p = scores[h * n + (t - first)];
                const KV_T *vh = v + (h / group) * head_dim;
                float *o = os + h * head_dim;
#pragma omp simd
                for (int64_t i = 0; i < head_dim; i++) o[i] += p * KV_LOAD1(vh + i);
            }
        }
        free(scores);
    }
}
