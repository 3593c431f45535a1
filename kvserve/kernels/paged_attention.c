/* Attention straight from the paged KV pool (CPU), one query token per row.
 *
 * A row is a decode token or one token of a prefill chunk: it attends to the first
 * seq_lens[row] keys of its block table (causal order is just each row's own length;
 * the chunk's K/V are in the pool before the call). For each row the scores of every query head
 * against every cached key are computed by following the block table, softmaxed,
 * and used to sum the values, with no gathered copy of the context.
 *
 * Decode attention streams each context from memory once per step, so the pool is laid
 * out for streaming: within a block, each kv head's keys and values are one contiguous
 * run, and keys are stored transposed ([D][bs]) so that a query scores eight keys per
 * vector operation with no horizontal sums. A sequence whose blocks follow each other is
 * then read like one array, which the hardware prefetcher follows (decode attention
 * reads clearly faster than from a token-major pool); where the table jumps, the next
 * block's run is prefetched. The softmax's exponentials are vectorised (AVX2/AVX-512):
 * as scalar expf calls they took a large share of the time with the context in cache.
 *
 * Layouts: q/out [S, H, D] float32, out contiguous, q rows q_stride floats apart (the
 * queries of a fused qkv activation are read in place); k pool [blocks, KVH, D,
 * block_size], v pool [blocks, KVH, block_size, D], of float32, float16 or bfloat16
 * (paged_attention_rows_f32 / _f16 / _bf16, one body in paged_attention_rows.h); tables
 * [S, table_stride] (block ids); seq_lens [S] (keys to attend to). Rows run in parallel.
 *
 * A prompt chunk's rows read the same keys and values, from cache. With one row at a
 * time each key load feeds a group of query heads, and the loads, not the FMAs, set the
 * pace; consecutive rows of one chunk are therefore attended a few at a time, each key
 * and value load shared by all their query heads (much faster), with each row's result
 * the same bits as alone.
 *
 * Built for a CPU with AVX-512, the compute-bound parts (prompt scores, value sums,
 * softmax) run sixteen lanes a vector, the scores in chunks of 16 keys across blocks so
 * that enough FMA chains are in flight (a clear gain on a CPU that runs 512-bit operations
 * whole). A decode row's scores take chunks across blocks too: with three query heads a
 * kv head, one chunk left its FMA chains' latency setting the pace even with the keys
 * coming from memory.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "step_parts.h"
#include "vec_math.h"

#ifdef __AVX2__
/* In VEC_LANES partial sums: an AVX-512 build's bits differ from an AVX2 build's at float
 * rounding; within a build every path shares this function. */
static void softmax_vec(float *sc, int64_t n) {
    vecf vmax = vec_set1(-INFINITY);
    int64_t t = 0;
    for (; t + VEC_LANES <= n; t += VEC_LANES) vmax = vec_max(vmax, vec_load(sc + t));
    float mx = vec_reduce_max(vmax);
    for (int64_t u = t; u < n; u++) mx = sc[u] > mx ? sc[u] : mx;
    const vecf vmx = vec_set1(mx);
    vecf vsum = vec_zero();
    for (t = 0; t + VEC_LANES <= n; t += VEC_LANES) {
        const vecf e = vec_exp(vec_sub(vec_load(sc + t), vmx));
        vec_store(sc + t, e);
        vsum = vec_add(vsum, e);
    }
    float sum = vec_reduce_add(vsum);
    for (int64_t u = t; u < n; u++) { sc[u] = expf(sc[u] - mx); sum += sc[u]; }
    const vecf inv = vec_set1(1.f / sum);
    for (t = 0; t + VEC_LANES <= n; t += VEC_LANES)
        vec_store(sc + t, vec_mul(vec_load(sc + t), inv));
    for (int64_t u = t; u < n; u++) sc[u] *= 1.f / sum;
}
#endif

static void softmax(float *sc, int64_t n) {
#ifdef __AVX2__
    softmax_vec(sc, n);
#else
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
    for (int64_t t = 0; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) sc[t] *= inv;
#endif
}

/* Whether the block after block b of a row's context (len keys) sits elsewhere in the
 * pool than right after it: the hardware prefetcher, which follows the blocks that do,
 * stops at the jump. */
static inline int next_block_jumps(const int64_t *table, int64_t b, int64_t len,
                                   int64_t block_size) {
    return (b + 1) * block_size < len && table[b + 1] != table[b] + 1;
}

/* Ask for a run of the pool ahead of its use (into the outer caches: measured better than
 * the inner ones, which the current block's loads need). */
static inline void prefetch_run(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, 1);
}

/* Register tiles of the prompt path (attend_rows_avx2): queries scored at once against
 * each key (6 x 16 tokens: 12 sums + 2 keys + 1 query element fit AVX2's 16 registers),
 * and queries summed at once over each value row (x 32 dims: 4 values + 1 weight + 4 sums
 * a query, so 2 in 16 registers, 6 in AVX-512's 32). */
#define KV_SCORE_TILE 6
#ifdef __AVX512VL__
#define KV_VALUE_TILE 6
#else
#define KV_VALUE_TILE 2
#endif
/* dims of one value tile: 4 vectors a query (value_tile) */
#define KV_VALUE_DIMS (4 * VEC_LANES)
#define KV_MAX_ROW_QUERIES 32
#define KV_SCORE_CHUNKS 4 /* AVX-512 prompt scores: chunks of 16 keys a tile */

/* fn(args..., D) with the head dim a constant, so that fn is inlined for it (64 or 128;
 * KV_WITH_ROW_DIM also 32, which the one-row path handles and the prompt tiles do not) */
#define KV_WITH_DIM(fn, ...)                  \
    do {                                      \
        if (head_dim == 64)                   \
            fn(__VA_ARGS__, 64);              \
        else                                  \
            fn(__VA_ARGS__, 128);             \
    } while (0)

#define KV_WITH_ROW_DIM(fn, ...)              \
    do {                                      \
        if (head_dim == 32)                   \
            fn(__VA_ARGS__, 32);              \
        else                                  \
            KV_WITH_DIM(fn, __VA_ARGS__);     \
    } while (0)

static int64_t gcd64(int64_t a, int64_t b) { return b == 0 ? a : gcd64(b, a % b); }

/* Rows of one prompt chunk attended together: enough that rows x (query heads per kv
 * head) fills whole score tiles (a group of 3 heads: 2 rows; of 1: 6). A kv head with
 * six or more query heads fills tiles from one row. */
static int64_t rows_per_group(int64_t group) {
    return group >= KV_SCORE_TILE ? 1 : KV_SCORE_TILE / gcd64(KV_SCORE_TILE, group);
}

/* Whether row s (s > 0) is the next token of row s - 1's context: one more key, over
 * the same blocks as row `same` (s - 1 or an earlier row of that context). Compared by
 * table contents, not by request: two rows with the same blocks and consecutive lengths
 * attend to the same keys whoever they belong to, and rows that share only a prefix's
 * blocks differ in the block of their last key. */
static int next_token_row(const int64_t *tables, int64_t table_stride, const int64_t *seq_lens,
                          int64_t s, int64_t same, int64_t block_size) {
    const int64_t len = seq_lens[s];
    return len == seq_lens[s - 1] + 1 &&
           memcmp(tables + s * table_stride, tables + same * table_stride,
                  sizeof(int64_t) * (size_t)((len + block_size - 1) / block_size)) == 0;
}

/* Split the rows into runs attended together, returned as starts [*count + 1] (the last
 * entry num_rows; free() it): a row joins the run before it when it is the next token of
 * the same context and no window cuts its context, up to max_rows rows a run. */
static int64_t *row_groups(const int64_t *tables, int64_t table_stride,
                           const int64_t *seq_lens, int64_t num_rows, int64_t block_size,
                           int64_t window, int64_t max_rows, int64_t *count) {
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(num_rows + 1)), n = 0;
    for (int64_t s = 0; s < num_rows; s++) {
        const int64_t start = n ? starts[n - 1] : 0;
        const int joins = n > 0 && s - start < max_rows &&
                          (window <= 0 || seq_lens[s] <= window) &&
                          next_token_row(tables, table_stride, seq_lens, s, start, block_size);
        if (!joins) starts[n++] = s;
    }
    starts[n] = num_rows;
    *count = n;
    return starts;
}

#ifdef __F16C__
#include <immintrin.h>
#endif

/* float16 and bfloat16 to float32, one element (the AVX2 path converts eight at once). */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float f;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        f = ldexpf((float)man, -24);
        uint32_t bits;
        memcpy(&bits, &f, 4);
        bits |= sign;
        memcpy(&f, &bits, 4);
        return f;
    }
    const uint32_t bits = sign | (exp == 0x1f ? 0x7f800000u | (man << 13)
                                              : ((exp + 112) << 23) | (man << 13));
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float bfloat16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}


/* a vector of the build's width (vecf) of pool elements: KV_LOAD16 or KV_LOAD8 */
#ifdef __AVX512F__
#define KV_LOADV(p) KV_LOAD16(p)
#else
#define KV_LOADV(p) KV_LOAD8(p)
#endif

#define KV_CAT_(a, b) a##_##b
#define KV_CAT(a, b) KV_CAT_(a, b)

#define KV_T float
#define KV_VECTOR 1
#define KV_NAME(f) KV_CAT(f, f32)
#define KV_LOAD8(p) _mm256_loadu_ps(p)
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_LOAD1(p) (*(p))
#include "paged_attention_tiles.h"
#include "paged_attention_rows.h"
#undef KV_T
#undef KV_NAME
#undef KV_LOAD8
#undef KV_LOAD16
#undef KV_LOAD1

#undef KV_VECTOR
#define KV_T uint16_t
#ifdef __F16C__
#define KV_VECTOR 1
#else
#define KV_VECTOR 0 /* float16 rows take the scalar path */
#endif
#define KV_NAME(f) KV_CAT(f, f16)
#define KV_LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define KV_LOAD1(p) half_to_float(*(p))
#include "paged_attention_tiles.h"
#include "paged_attention_rows.h"
#undef KV_NAME
#undef KV_LOAD8
#undef KV_LOAD16
#undef KV_LOAD1

#undef KV_VECTOR
#define KV_VECTOR 1
#define KV_NAME(f) KV_CAT(f, bf16)
#define KV_LOAD8(p) _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define KV_LOAD16(p) _mm512_castsi512_ps(_mm512_slli_epi32( \
    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define KV_LOAD1(p) bfloat16_to_float(*(p))
#include "paged_attention_tiles.h"
#include "paged_attention_rows.h"
