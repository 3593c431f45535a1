/* The attention kernel for one KV element type; included once per type by
 * paged_attention.c with these macros defined:
 *   KV_T            the pool's element type (float, or uint16_t for float16 / bfloat16)
 *   KV_NAME(f)      f with the type's suffix (paged_attention_rows -> ..._f16)
 *   KV_LOAD8(p)     eight elements at p as an __m256 (AVX2 builds)
 *   KV_LOAD1(p)     one element at p as a float
 *   KV_VECTOR       1 when KV_LOAD8 can be built (float16 needs F16C besides AVX2)
 * Queries, scores, sums and outputs are float32 whatever the pool holds: a lower-
 * precision pool only halves the bytes streamed per key, the bound of decode attention.
 * Pool layout (see paged_attention.c): k [blocks][KVH][D][bs], v [blocks][KVH][bs][D].
 */

#if defined(__AVX2__) && KV_VECTOR
/* Scores of TH query heads of one kv head against NT (8 or 16) tokens of a block,
 * scaled, into tile[i * 16 + j]. The block's keys for the kv head are D rows of
 * block_size tokens: at each dim c, one broadcast query element times NT contiguous
 * keys adds to NT scores at once, with no horizontal sums. */
static inline __attribute__((always_inline)) void KV_NAME(score_tile)(
        const float *qh, const KV_T *keys, int64_t block_size, float *tile, __m256 vscale,
        const int TH, const int NT, const int64_t D) {
    __m256 lo[4], hi[4];
    for (int i = 0; i < TH; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c++) {
        __m256 k0 = KV_LOAD8(keys + c * block_size);
        __m256 k1 = NT == 16 ? KV_LOAD8(keys + c * block_size + 8) : k0;
        /* keep the keys in registers: folded into each FMA as a memory operand, they
         * are loaded once per head, and the loads, not the FMAs, set the pace */
        __asm__("" : "+x"(k0), "+x"(k1));
        for (int i = 0; i < TH; i++) {
            const __m256 qb = _mm256_broadcast_ss(qh + i * D + c);
            lo[i] = _mm256_fmadd_ps(qb, k0, lo[i]);
            if (NT == 16) hi[i] = _mm256_fmadd_ps(qb, k1, hi[i]);
        }
    }
    for (int i = 0; i < TH; i++) {
        _mm256_storeu_ps(tile + i * 16, _mm256_mul_ps(lo[i], vscale));
        if (NT == 16) _mm256_storeu_ps(tile + i * 16 + 8, _mm256_mul_ps(hi[i], vscale));
    }
}

static inline __attribute__((always_inline)) void KV_NAME(score_tile_any)(
        const float *qh, const KV_T *keys, int64_t block_size, float *tile, __m256 vscale,
        int th, int nt, const int64_t D) {
#define KV_TILE(TH_, NT_) KV_NAME(score_tile)(qh, keys, block_size, tile, vscale, TH_, NT_, D)
    if (nt == 16) {
        switch (th) {
        case 4: KV_TILE(4, 16); break;
        case 3: KV_TILE(3, 16); break;
        case 2: KV_TILE(2, 16); break;
        default: KV_TILE(1, 16);
        }
    } else {
        switch (th) {
        case 4: KV_TILE(4, 8); break;
        case 3: KV_TILE(3, 8); break;
        case 2: KV_TILE(2, 8); break;
        default: KV_TILE(1, 8);
        }
    }
#undef KV_TILE
}

/* One row with head_dim D known at compile time (inlined per D); block_size % 8 == 0.
 * Keys: block by block, kv head by kv head, each of the kv head's query heads in tiles
 * of up to four sharing the key loads. Values: per query head, the block's value rows
 * summed into an output held in registers. Both passes read each block's runs in
 * address order. Same sums as the generic path in another order: results agree to
 * float rounding. */
static inline __attribute__((always_inline)) void KV_NAME(attend_row_avx2)(
        const float *qs, const KV_T *k_pool, const KV_T *v_pool, const int64_t *table,
        float *os, float *scores, int64_t first, int64_t len, int64_t pf_len,
        int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
        const int64_t D) {
    const int64_t group = num_heads / num_kv_heads, n = len - first;
    const int64_t run = D * block_size, block_elems = num_kv_heads * run;
    const int nt = block_size % 16 == 0 ? 16 : 8;
    const __m256 vscale = _mm256_set1_ps(scale);
    float tile[4 * 16];
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const KV_T *kb = k_pool + table[b] * block_elems;
        const int jump = next_block_jumps(table, b, pf_len, block_size);
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const KV_T *kg = kb + g * run;
            if (jump)
                prefetch_run(k_pool + table[b + 1] * block_elems + g * run, run * sizeof(KV_T));
            for (int64_t j = 0; j < block_size; j += nt) {
                const int64_t t0 = b * block_size + j;
                const int64_t lo = t0 > first ? t0 : first;
                const int64_t hi = t0 + nt < len ? t0 + nt : len;
                if (hi <= lo) continue;
                for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += 4) {
                    const int th = (g + 1) * group - h0 < 4 ? (int)((g + 1) * group - h0) : 4;
                    KV_NAME(score_tile_any)(qs + h0 * D, kg + j, block_size, tile, vscale,
                                            th, nt, D);
                    for (int i = 0; i < th; i++)
                        memcpy(scores + (h0 + i) * n + (lo - first), tile + i * 16 + (lo - t0),
                               sizeof(float) * (size_t)(hi - lo));
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; h++) softmax(scores + h * n, n);
    __m256 acc[D / 8];
    for (int64_t h = 0; h < num_heads; h++)
        for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(os + h * D + c, _mm256_setzero_ps());
    for (int64_t b = first / block_size; b * block_size < len; b++) {
        const KV_T *vb = v_pool + table[b] * block_elems;
        const int jump = next_block_jumps(table, b, pf_len, block_size);
        const int64_t t0 = b * block_size;
        const int64_t lo = t0 > first ? t0 : first;
        const int64_t hi = t0 + block_size < len ? t0 + block_size : len;
        for (int64_t h = 0; h < num_heads; h++) {
            const KV_T *vg = vb + (h / group) * run;
            if (jump && h % group == 0)
                prefetch_run(v_pool + table[b + 1] * block_elems + (h / group) * run,
                             run * sizeof(KV_T));
            const float *p = scores + h * n + (lo - first);
            for (int64_t c = 0; c < D / 8; c++) acc[c] = _mm256_loadu_ps(os + h * D + 8 * c);
            for (int64_t u = 0; u < hi - lo; u++) {
                const __m256 pu = _mm256_set1_ps(p[u]);
                const KV_T *vrow = vg + (lo - t0 + u) * D;
                for (int64_t c = 0; c < D / 8; c++)
                    acc[c] = _mm256_fmadd_ps(pu, KV_LOAD8(vrow + 8 * c), acc[c]);
            }
            for (int64_t c = 0; c < D / 8; c++) _mm256_storeu_ps(os + h * D + 8 * c, acc[c]);
        }
    }
}
#endif

/* Any head_dim and block size, one key at a time. */
static void KV_NAME(attend_row_generic)(
        const float *qs, const KV_T *k_pool, const KV_T *v_pool, const int64_t *table,
        float *os, float *scores, int64_t first, int64_t len, int64_t num_heads,
        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {
    const int64_t group = num_heads / num_kv_heads, n = len - first;
    const int64_t run = head_dim * block_size, block_elems = num_kv_heads * run;
    for (int64_t t = first; t < len; t++) {
        const KV_T *k = k_pool + table[t / block_size] * block_elems + t % block_size;
        for (int64_t h = 0; h < num_heads; h++) {
            const float *qh = qs + h * head_dim;
            const KV_T *kh = k + (h / group) * run;
            float dot = 0.f;
            for (int64_t i = 0; i < head_dim; i++) dot += qh[i] * KV_LOAD1(kh + i * block_size);
            scores[h * n + (t - first)] = dot * scale;
        }
    }
    for (int64_t h = 0; h < num_heads; h++) softmax(scores + h * n, n);
    for (int64_t i = 0; i < num_heads * head_dim; i++) os[i] = 0.f;
    for (int64_t t = first; t < len; t++) {
        const KV_T *v = v_pool + table[t / block_size] * block_elems + (t % block_size) * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            const float p = scores[h * n + (t - first)];
            const KV_T *vh = v + (h / group) * run;
            float *o = os + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < head_dim; i++) o[i] += p * KV_LOAD1(vh + i);
        }
    }
}

void KV_NAME(paged_attention_rows)(const float *q, const KV_T *k_pool, const KV_T *v_pool,
                                   const int64_t *tables, int64_t table_stride,
                                   const int64_t *seq_lens, float *out, int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, int64_t window) {
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
         * the row before it: prefetching them again only costs. */
        const int continues =
            s > 0 && len == seq_lens[s - 1] + 1 && table[0] == table[-table_stride];
        const int64_t pf_len = continues ? 0 : len;
#if defined(__AVX2__) && KV_VECTOR
        if ((head_dim == 64 || head_dim == 128) && block_size % 8 == 0) {
            if (head_dim == 64)
                KV_NAME(attend_row_avx2)(qs, k_pool, v_pool, table, os, scores, first, len,
                                         pf_len, num_heads, num_kv_heads, block_size, scale, 64);
            else
                KV_NAME(attend_row_avx2)(qs, k_pool, v_pool, table, os, scores, first, len,
                                         pf_len, num_heads, num_kv_heads, block_size, scale,
                                         128);
            free(scores);
            continue;
        }
#endif
        KV_NAME(attend_row_generic)(qs, k_pool, v_pool, table, os, scores, first, len,
                                    num_heads, num_kv_heads, head_dim, block_size, scale);
        free(scores);
    }
}

/* Write n tokens' K and V (rows of KVH * D elements of the pool's type, k_stride and
 * v_stride elements apart) into their slots: each key scattered down its block's [D][bs]
 * run, each value row copied whole. */
void KV_NAME(write_kv)(const KV_T *k, const KV_T *v, int64_t k_stride, int64_t v_stride,
                       const int64_t *slots, int64_t n, KV_T *k_pool, KV_T *v_pool,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t run = head_dim * block_size;
    /* rows write distinct slots; in two halves, they share at most one block's lines */
#pragma omp parallel for schedule(static) if (n >= 256)
    for (int64_t r = 0; r < n; r++) {
        const int64_t block = slots[r] / block_size, off = slots[r] % block_size;
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const KV_T *ks = k + r * k_stride + g * head_dim;
            KV_T *kd = k_pool + (block * num_kv_heads + g) * run + off;
            for (int64_t c = 0; c < head_dim; c++) kd[c * block_size] = ks[c];
            memcpy(v_pool + (block * num_kv_heads + g) * run + off * head_dim,
                   v + r * v_stride + g * head_dim, sizeof(KV_T) * (size_t)head_dim);
        }
    }
}
