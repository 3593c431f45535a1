/* The attention kernel's register tiles for one KV element type: scores of a few query
 * vectors against a run of keys, and their weighted sums over a run of values. Included
 * once per type by paged_attention.c, before paged_attention_rows.h (the paths that use
 * them), with the macros that header lists. Each score and each output element is one
 * FMA chain in a fixed order whatever the tile's size or the vector width, so every
 * tiling gives a row the same bits.
 */
#if defined(__AVX2__) && KV_VECTOR
/* Scores of TQ (1-6) query vectors of one kv head against NT (8 or 16) tokens of a
 * block, scaled, into out[i][0..NT). The block's keys for the kv head are D rows of
 * block_size tokens: at each dim c, one broadcast query element times NT contiguous keys
 * adds to NT scores at once, with no horizontal sums. Six queries by sixteen tokens is
 * twelve sums in flight, enough to keep both FMA units busy; each token's score is one
 * chain over c = 0..D-1 whatever the tile, so every tiling gives the same bits. */
static inline __attribute__((always_inline)) void KV_NAME(score_tile)(
        const float *const *qv, const KV_T *keys, int64_t block_size, float *const *out,
        __m256 vscale, const int TQ, const int NT, const int64_t D) {
    __m256 lo[KV_SCORE_TILE], hi[KV_SCORE_TILE];
    for (int i = 0; i < TQ; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c++) {
        __m256 k0 = KV_LOAD8(keys + c * block_size);
        __m256 k1 = NT == 16 ? KV_LOAD8(keys + c * block_size + 8) : k0;
        /* keep the keys in registers: folded into each FMA as a memory operand, they
         * are loaded once per query, and the loads, not the FMAs, set the pace */
        __asm__("" : "+x"(k0), "+x"(k1));
        for (int i = 0; i < TQ; i++) {
            const __m256 qb = _mm256_broadcast_ss(qv[i] + c);
            lo[i] = _mm256_fmadd_ps(qb, k0, lo[i]);
            if (NT == 16) hi[i] = _mm256_fmadd_ps(qb, k1, hi[i]);
        }
    }
    for (int i = 0; i < TQ; i++) {
        _mm256_storeu_ps(out[i], _mm256_mul_ps(lo[i], vscale));
        if (NT == 16) _mm256_storeu_ps(out[i] + 8, _mm256_mul_ps(hi[i], vscale));
    }
}

#ifdef __AVX512F__
/* Scores of TQ query vectors against NC chunks of sixteen tokens (each chunk's keys at
 * its own pointer: chunks of several blocks), into out[i][offs[j] ..+16). Each
 * score is one FMA chain over c = 0..D-1, 4 cycles a link: TQ x NC chains in flight
 * keep both FMA units busy where one chunk's 3 (a group of 3 heads) left them waiting. */
static inline __attribute__((always_inline)) void KV_NAME(score_chunks16)(
        const float *const *qv, const KV_T *const *keys, int64_t block_size,
        float *const *out, const int64_t *offs, __m512 vscale, const int TQ, const int NC,
        const int64_t D) {
    __m512 acc[KV_SCORE_TILE][KV_SCORE_CHUNKS];
    for (int i = 0; i < TQ; i++)
        for (int j = 0; j < NC; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c++) {
        __m512 k[KV_SCORE_CHUNKS];
        for (int j = 0; j < NC; j++) {
            k[j] = KV_LOAD16(keys[j] + c * block_size);
            __asm__("" : "+v"(k[j]));
        }
        for (int i = 0; i < TQ; i++) {
            const __m512 qb = _mm512_set1_ps(qv[i][c]);
            for (int j = 0; j < NC; j++) acc[i][j] = _mm512_fmadd_ps(qb, k[j], acc[i][j]);
        }
    }
    for (int i = 0; i < TQ; i++)
        for (int j = 0; j < NC; j++)
            _mm512_storeu_ps(out[i] + offs[j], _mm512_mul_ps(acc[i][j], vscale));
}

/* nc: 1 or KV_SCORE_CHUNKS, a constant at each (inlined) call */
static inline __attribute__((always_inline)) void KV_NAME(score_chunks16_any)(
        const float *const *qv, const KV_T *const *keys, int64_t block_size,
        float *const *out, const int64_t *offs, __m512 vscale, int tq, const int nc,
        const int64_t D) {
#define KV_TILE(TQ_) KV_NAME(score_chunks16)(qv, keys, block_size, out, offs, vscale, TQ_, nc, D)
    switch (tq) {
    case 6: KV_TILE(6); break;
    case 5: KV_TILE(5); break;
    case 4: KV_TILE(4); break;
    case 3: KV_TILE(3); break;
    case 2: KV_TILE(2); break;
    default: KV_TILE(1);
    }
#undef KV_TILE
}

#endif

static inline __attribute__((always_inline)) void KV_NAME(score_tile_any)(
        const float *const *qv, const KV_T *keys, int64_t block_size, float *const *out,
        __m256 vscale, int tq, int nt, const int64_t D) {
#define KV_TILE(TQ_, NT_) KV_NAME(score_tile)(qv, keys, block_size, out, vscale, TQ_, NT_, D)
#define KV_TILES(NT_)                        \
    switch (tq) {                            \
    case 6: KV_TILE(6, NT_); break;          \
    case 5: KV_TILE(5, NT_); break;          \
    case 4: KV_TILE(4, NT_); break;          \
    case 3: KV_TILE(3, NT_); break;          \
    case 2: KV_TILE(2, NT_); break;          \
    default: KV_TILE(1, NT_);                \
    }
    if (nt == 16) {
#ifdef __AVX512F__ /* the sixteen in one register: the same chains, half the instructions */
        const __m512 vs = _mm512_broadcastss_ps(_mm256_castps256_ps128(vscale));
        const KV_T *chunk[1] = {keys};
        const int64_t at[1] = {0};
        KV_NAME(score_chunks16_any)(qv, chunk, block_size, out, at, vs, tq, 1, D);
#else
        KV_TILES(16)
#endif
    } else {
        KV_TILES(8)
    }
#undef KV_TILES
#undef KV_TILE
}

/* out[i][0..KV_VALUE_DIMS) = sum over the first len tokens t of p[i][t] * value[t][..]
 * for TQ query vectors of one kv head (v_pool offset to the kv head's run and the tile's
 * dims): each value row is loaded once for all TQ queries, and the sums stay in
 * registers over the whole context. Token order and one chain per output element: the
 * row path's sums, whatever the vector width. */
static inline __attribute__((always_inline)) void KV_NAME(value_tile)(
        float *const *p, const KV_T *v_pool, const int64_t *table, int64_t len,
        int64_t block_elems, int64_t block_size, float *const *out, const int TQ,
        const int64_t D) {
    vecf acc[TQ][4]; /* sized by the constant TQ: kept in registers */
    for (int i = 0; i < TQ; i++)
        for (int d = 0; d < 4; d++) acc[i][d] = vec_zero();
    for (int64_t b = 0; b * block_size < len; b++) {
        const KV_T *vb = v_pool + table[b] * block_elems;
        const int64_t t0 = b * block_size;
        const int64_t nb = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t u = 0; u < nb; u++) {
            const KV_T *vr = vb + u * D;
            const vecf v0 = KV_LOADV(vr), v1 = KV_LOADV(vr + VEC_LANES);
            const vecf v2 = KV_LOADV(vr + 2 * VEC_LANES), v3 = KV_LOADV(vr + 3 * VEC_LANES);
#pragma GCC unroll 6
            for (int i = 0; i < TQ; i++) {
                const vecf w = vec_set1(p[i][t0 + u]);
                acc[i][0] = vec_fmadd(w, v0, acc[i][0]);
                acc[i][1] = vec_fmadd(w, v1, acc[i][1]);
                acc[i][2] = vec_fmadd(w, v2, acc[i][2]);
                acc[i][3] = vec_fmadd(w, v3, acc[i][3]);
            }
        }
    }
    for (int i = 0; i < TQ; i++)
        for (int d = 0; d < 4; d++) vec_store(out[i] + VEC_LANES * d, acc[i][d]);
}

static inline __attribute__((always_inline)) void KV_NAME(value_tile_any)(
        float *const *p, const KV_T *v_pool, const int64_t *table, int64_t len,
        int64_t block_elems, int64_t block_size, float *const *out, int tq,
        const int64_t D) {
#define KV_TILE(TQ_) KV_NAME(value_tile)(p, v_pool, table, len, block_elems, block_size, out, \
                                         TQ_, D)
    switch (tq) {
#if KV_VALUE_TILE == 6
    case 6: KV_TILE(6); break;
    case 5: KV_TILE(5); break;
    case 4: KV_TILE(4); break;
    case 3: KV_TILE(3); break;
#endif
    case 2: KV_TILE(2); break;
    default: KV_TILE(1);
    }
#undef KV_TILE
}
#endif
