/* The attention kernel for one KV element type; included once per type by
 * paged_attention.c with these macros defined:
 *   KV_T            the pool's element type (float, or uint16_t for float16 / bfloat16)
 *   KV_NAME(f)      f with the type's suffix (paged_attention_rows -> ..._f16)
 *   KV_LOAD8(p)     eight elements at p as an __m256 (AVX2 builds)
 *   KV_LOAD16(p)    sixteen as an __m512 (AVX-512 builds); KV_LOADV(p): the build's vecf
 *   KV_LOAD1(p)     one element at p as a float
 *   KV_VECTOR       1 when KV_LOAD8 can be built (float16 needs F16C besides AVX2)
 * Queries, scores, sums and outputs are float32 whatever the pool holds: a lower-
 * precision pool only halves the bytes streamed per key, the bound of decode attention.
 * Pool layout (see paged_attention.c): k [blocks][KVH][D][bs], v [blocks][KVH][bs][D].
 * The register tiles these paths use are in paged_attention_tiles.h, included before.
 */

#if defined(__AVX2__) && KV_VECTOR
/* The rows r = 0..R-1 of one prompt chunk, whose contexts are the first len0 + r keys of
 * the same block table, none cut by a window: per kv head, the R x group query vectors
 * are scored in tiles of six against each key, softmaxed, and summed over the values in
 * tiles sharing each value load. Where the row path reads a key or value for the group's
 * heads of one row, this reads it for R rows at once. A row's scores past its own length
 * are set to 0 before the values pass, adding exact zeros, so each row gets the bits the
 * row path gives it. scores: nq x stride floats, stride >= len rounded up to 16. */
static inline __attribute__((always_inline)) void KV_NAME(attend_rows_avx2)(
        const float *qs, int64_t q_stride, const KV_T *k_pool, const KV_T *v_pool,
        const int64_t *table, float *os, float *scores, int64_t stride, int64_t len0, int64_t R,
        int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale,
        const int64_t D) {
    const int64_t group = num_heads / num_kv_heads, nq = R * group, len = len0 + R - 1;
    const int64_t run = D * block_size, block_elems = num_kv_heads * run;
    const int nt = block_size % 16 == 0 ? 16 : 8;
    const __m256 vscale = _mm256_set1_ps(scale);
    const float *qv[KV_MAX_ROW_QUERIES];
    float *srow[KV_MAX_ROW_QUERIES], *orow[KV_MAX_ROW_QUERIES], *out[KV_SCORE_TILE];
    for (int64_t g = 0; g < num_kv_heads; g++) {
        for (int64_t i = 0; i < nq; i++) {
            const int64_t head = g * group + i % group;
            qv[i] = qs + (i / group) * q_stride + head * D;
            orow[i] = os + ((i / group) * num_heads + head) * D;
            srow[i] = scores + i * stride;
        }
        for (int64_t i0 = 0; i0 < nq; i0 += KV_SCORE_TILE) {
            const int tq = nq - i0 < KV_SCORE_TILE ? (int)(nq - i0) : KV_SCORE_TILE;
#ifdef __AVX512F__
            if (nt == 16) { /* KV_SCORE_CHUNKS chunks of 16 keys a tile, across blocks */
                const __m512 vs = _mm512_set1_ps(scale);
                const int64_t end = (len + 15) / 16;
                const KV_T *keys[KV_SCORE_CHUNKS];
                int64_t offs[KV_SCORE_CHUNKS];
                for (int64_t c0 = 0; c0 < end; c0 += KV_SCORE_CHUNKS) {
                    for (int j = 0; j < KV_SCORE_CHUNKS; j++) {
                        const int64_t t = (c0 + j < end ? c0 + j : end - 1) * 16;
                        keys[j] = k_pool + table[t / block_size] * block_elems + g * run
                                  + t % block_size;
                        offs[j] = t;
                    }
                    KV_NAME(score_chunks16_any)(qv + i0, keys, block_size, srow + i0, offs, vs,
                                                tq, KV_SCORE_CHUNKS, D);
                }
                continue;
            }
#endif
            for (int64_t b = 0; b * block_size < len; b++) {
                const KV_T *kb = k_pool + table[b] * block_elems + g * run;
                for (int64_t j = 0; j < block_size && b * block_size + j < len; j += nt) {
                    for (int i = 0; i < tq; i++) out[i] = srow[i0 + i] + b * block_size + j;
                    KV_NAME(score_tile_any)(qv + i0, kb + j, block_size, out, vscale, tq, nt, D);
                }
            }
        }
        for (int64_t i = 0; i < nq; i++) {
            const int64_t n = len0 + i / group;
            softmax(srow[i], n);
            for (int64_t t = n; t < len; t++) srow[i][t] = 0.f;
        }
        for (int64_t i0 = 0; i0 < nq; i0 += KV_VALUE_TILE) {
            const int tq = nq - i0 < KV_VALUE_TILE ? (int)(nq - i0) : KV_VALUE_TILE;
            for (int64_t c = 0; c < D; c += KV_VALUE_DIMS) {
                for (int i = 0; i < tq; i++) out[i] = orow[i0 + i] + c;
                KV_NAME(value_tile_any)(srow + i0, v_pool + g * run + c, table, len,
                                        block_elems, block_size, out, tq, D);
            }
        }
    }
}

#ifdef __AVX512F__
/* The one-row path's scores [H, n] with AVX-512 and blocks of whole chunks of 16 tokens:
 * each query tile scores KV_SCORE_CHUNKS chunks at once (consecutive in the context,
 * whichever blocks hold them), so that 3 query heads of a kv head keep 12 FMA chains in
 * flight instead of 3, and the kv head's runs of several blocks stream side by side.
 * Every score is the same chain as score_chunks16's with one chunk: the same bits. */
static inline __attribute__((always_inline)) void KV_NAME(row_scores16)(
        const float *qs, const KV_T *k_pool, const int64_t *table, float *scores,
        int64_t first, int64_t len, int64_t pf_len, int64_t num_heads, int64_t num_kv_heads,
        int64_t block_elems, int64_t block_size, __m512 vscale, const int64_t D) {
    const int64_t group = num_heads / num_kv_heads, n = len - first;
    const int64_t run = D * block_size;
    float tile[KV_SCORE_TILE * 16 * KV_SCORE_CHUNKS];
    float *out[KV_SCORE_TILE];
    const float *qv[KV_SCORE_TILE];
    const int64_t offs[KV_SCORE_CHUNKS] = {0, 16, 32, 48};
    for (int i = 0; i < KV_SCORE_TILE; i++) out[i] = tile + i * 16 * KV_SCORE_CHUNKS;
    const int64_t c_end = (len + 15) / 16;
    for (int64_t c0 = first / 16; c0 < c_end; c0 += KV_SCORE_CHUNKS) {
        const int nc = c_end - c0 >= KV_SCORE_CHUNKS ? KV_SCORE_CHUNKS : (int)(c_end - c0);
        for (int64_t g = 0; g < num_kv_heads; g++) {
            const KV_T *keys[KV_SCORE_CHUNKS];
            for (int j = 0; j < nc; j++) {
                const int64_t t0 = (c0 + j) * 16, b = t0 / block_size;
                keys[j] = k_pool + table[b] * block_elems + g * run + t0 % block_size;
                if (t0 % block_size == 0 && next_block_jumps(table, b, pf_len, block_size))
                    prefetch_run(k_pool + table[b + 1] * block_elems + g * run,
                                 run * sizeof(KV_T));
            }
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += KV_SCORE_TILE) {
                const int th = (g + 1) * group - h0 < KV_SCORE_TILE
                                   ? (int)((g + 1) * group - h0) : KV_SCORE_TILE;
                for (int i = 0; i < th; i++) qv[i] = qs + (h0 + i) * D;
                if (nc == KV_SCORE_CHUNKS)
                    KV_NAME(score_chunks16_any)(qv, keys, block_size, out, offs, vscale, th,
                                                KV_SCORE_CHUNKS, D);
                else
                    for (int j = 0; j < nc; j++)
                        KV_NAME(score_chunks16_any)(qv, keys + j, block_size, out, offs + j,
                                                    vscale, th, 1, D);
                for (int j = 0; j < nc; j++) {
                    const int64_t t0 = (c0 + j) * 16;
                    const int64_t lo = t0 > first ? t0 : first, hi = t0 + 16 < len ? t0 + 16 : len;
                    for (int i = 0; i < th; i++)
                        memcpy(scores + (h0 + i) * n + (lo - first),
                               out[i] + 16 * j + (lo - t0), sizeof(float) * (size_t)(hi - lo));
                }
            }
        }
    }
}
#endif

/* One row with head_dim D known at compile time (inlined per D); block_size % 8 == 0.
 * Keys: block by block, kv head by kv head, each of the kv head's query heads in tiles
 * of up to six sharing the key loads. Values: per query head, the block's value rows
 * summed into an output held in registers. Both passes read each block's runs in
 * address order. Same sums as the generic path in another order: results agree to
 * float rounding. */
static inline __attribute__((always_inline)) void KV_NAME(attend_row_avx2)(
        const float *qs, const KV_T *k_pool, const KV_T *v_pool, const int64_t *table,
        float *os, float *scores, int64_t first, int64_t len, int64_t pf_len,
        int64_t num_heads, int64_t num_kv_heads, int64_t block_elems, int64_t block_size,
        float scale, const int64_t D) {
    const int64_t group = num_heads / num_kv_heads, n = len - first;
    const int64_t run = D * block_size;
    const int nt = block_size % 16 == 0 ? 16 : 8;
    const __m256 vscale = _mm256_set1_ps(scale);
    float tile[KV_SCORE_TILE * 16];
    const float *qv[KV_SCORE_TILE];
    float *out[KV_SCORE_TILE];
    for (int i = 0; i < KV_SCORE_TILE; i++) out[i] = tile + i * 16;
#ifdef __AVX512F__
    if (nt == 16) {
        KV_NAME(row_scores16)(qs, k_pool, table, scores, first, len, pf_len, num_heads,
                              num_kv_heads, block_elems, block_size, _mm512_set1_ps(scale), D);
        goto values;
    }
#endif
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
                for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += KV_SCORE_TILE) {
                    const int th = (g + 1) * group - h0 < KV_SCORE_TILE
                                       ? (int)((g + 1) * group - h0) : KV_SCORE_TILE;
                    for (int i = 0; i < th; i++) qv[i] = qs + (h0 + i) * D;
                    KV_NAME(score_tile_any)(qv, kg + j, block_size, out, vscale, th, nt, D);
                    for (int i = 0; i < th; i++)
                        memcpy(scores + (h0 + i) * n + (lo - first), tile + i * 16 + (lo - t0),
                               sizeof(float) * (size_t)(hi - lo));
                }
            }
        }
    }
#ifdef __AVX512F__
values:
#endif
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
        int64_t num_kv_heads, int64_t block_elems, int64_t head_dim, int64_t block_size,
        float scale) {
    const int64_t group = num_heads / num_kv_heads, n = len - first;
    const int64_t run = head_dim * block_size;
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

void KV_NAME(paged_attention_rows_part)(const float *q, int64_t q_stride,
                                        const KV_T *k_pool, const KV_T *v_pool,
                                        const int64_t *tables, int64_t table_stride,
                                        const int64_t *seq_lens, float *out,
                                        int64_t num_seqs, int64_t num_heads,
                                        int64_t num_kv_heads, int64_t head_dim,
                                        int64_t block_size, float scale, int64_t window) {
    int vector = 0, row_vector = 0; /* the prompt tiles' head dims; the one-row path's */
#if defined(__AVX2__) && KV_VECTOR
    vector = (head_dim == 64 || head_dim == 128) && block_size % 8 == 0;
    row_vector = vector || (head_dim == 32 && block_size % 8 == 0);
#endif
    int64_t num_groups = 0;
    int64_t *starts = row_groups(tables, table_stride, seq_lens, num_seqs, block_size, window,
                                 vector ? rows_per_group(num_heads / num_kv_heads) : 1,
                                 &num_groups); /* each thread its own copy */
    /* Fewer groups than threads (one stream's decode row): a row's kv heads are split
     * into slices that the threads take apart, each head's sums unchanged. */
    const int64_t threads = omp_get_num_threads();
    const int64_t slices = num_groups >= threads ? 1
                           : num_kv_heads < threads ? num_kv_heads : threads;
    const int64_t block_elems = num_kv_heads * head_dim * block_size;
    const int64_t group = num_heads / num_kv_heads;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t item = 0; item < num_groups * slices; item++) {
        const int64_t gi = item / slices, slice = item % slices;
        const int64_t s = starts[gi], rows = starts[gi + 1] - s;
        const int64_t len = seq_lens[s];
        const int64_t *table = tables + s * table_stride;
        if (rows > 1 && slice > 0) continue; /* a prompt chunk's rows: whole, in slice 0 */
        const int64_t g0 = rows > 1 ? 0 : num_kv_heads * slice / slices;
        const int64_t g1 = rows > 1 ? num_kv_heads : num_kv_heads * (slice + 1) / slices;
        const int64_t heads = (g1 - g0) * group, kv_offset = g0 * head_dim * block_size;
        const float *qs = q + s * q_stride + g0 * group * head_dim;
        float *os = out + (s * num_heads + g0 * group) * head_dim;
#if defined(__AVX2__) && KV_VECTOR
        if (rows > 1) { /* first == 0: row_groups leaves rows cut by a window alone */
            const int64_t stride = (len + rows - 1 + 15) / 16 * 16;
            const int64_t nq = rows * (num_heads / num_kv_heads);
            float *scores = malloc(sizeof(float) * (size_t)(nq * stride));
            KV_WITH_DIM(KV_NAME(attend_rows_avx2), qs, q_stride, k_pool, v_pool, table, os,
                        scores, stride, len, rows, num_heads, num_kv_heads, block_size, scale);
            free(scores);
            continue;
        }
#endif
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t n = len - first;
        float *scores = malloc(sizeof(float) * (size_t)(heads * n)); /* [heads, n] */
        /* A row after the first of a prompt chunk finds its keys in cache, put there by
         * the row before it: prefetching them again only costs. */
        const int continues =
            s > 0 && next_token_row(tables, table_stride, seq_lens, s, s - 1, block_size);
        const int64_t pf_len = continues ? 0 : len;
#if defined(__AVX2__) && KV_VECTOR
        if (row_vector) {
            KV_WITH_ROW_DIM(KV_NAME(attend_row_avx2), qs, k_pool + kv_offset,
                            v_pool + kv_offset, table, os, scores, first, len, pf_len, heads,
                            g1 - g0, block_elems, block_size, scale);
            free(scores);
            continue;
        }
#endif
        KV_NAME(attend_row_generic)(qs, k_pool + kv_offset, v_pool + kv_offset, table, os,
                                    scores, first, len, heads, g1 - g0, block_elems, head_dim,
                                    block_size, scale);
        free(scores);
    }
    free(starts);
}

void KV_NAME(paged_attention_rows)(const float *q, int64_t q_stride, const KV_T *k_pool,
                                   const KV_T *v_pool,
                                   const int64_t *tables, int64_t table_stride,
                                   const int64_t *seq_lens, float *out, int64_t num_seqs,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                   int64_t block_size, float scale, int64_t window) {
#pragma omp parallel
    KV_NAME(paged_attention_rows_part)(q, q_stride, k_pool, v_pool, tables, table_stride,
                                       seq_lens, out, num_seqs, num_heads, num_kv_heads,
                                       head_dim, block_size, scale, window);
}

/* Write n tokens' K and V (rows of KVH * D elements of the pool's type, k_stride and
 * v_stride elements apart) into their slots: each key scattered down its block's [D][bs]
 * run, each value row copied whole. */
void KV_NAME(write_kv_part)(const KV_T *k, const KV_T *v, int64_t k_stride,
                            int64_t v_stride, const int64_t *slots, int64_t n, KV_T *k_pool,
                            KV_T *v_pool, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size) {
    const int64_t run = head_dim * block_size;
#pragma omp for schedule(static) nowait
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

/* Rows write distinct slots; in two halves, they share at most one block's lines. A key
 * row is a cache line per dim, cold in a decode step: a call of its own splits from 16
 * rows on, where the threads beat one thread clearly (within a captured step, whose
 * threads are already running, the rows are split whatever their number). */
void KV_NAME(write_kv)(const KV_T *k, const KV_T *v, int64_t k_stride, int64_t v_stride,
                       const int64_t *slots, int64_t n, KV_T *k_pool, KV_T *v_pool,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
#pragma omp parallel if (n >= 16)
    KV_NAME(write_kv_part)(k, v, k_stride, v_stride, slots, n, k_pool, v_pool, num_kv_heads,
                           head_dim, block_size);
}
