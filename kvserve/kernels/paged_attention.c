/* Decode attention straight from the paged KV pool (float32, CPU).
 *
 * One query token per sequence. For each (sequence, kv head) the scores of the
 * query heads sharing that kv head (GQA) are computed against every cached key by
 * following the block table, softmaxed, and used to sum the values: each K and V
 * row is read once, with no gathered copy of the context.
 *
 * Layouts: q/out [S, H, D]; k/v pool [blocks, block_size, KVH, D];
 * tables [S, table_stride] (block ids); seq_lens [S] (keys to attend to).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void paged_decode_attention(const float *q, const float *k_pool, const float *v_pool,
                            const int64_t *tables, int64_t table_stride,
                            const int64_t *seq_lens, float *out, int64_t num_seqs,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t window) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats between tokens of one block */
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t kh = 0; kh < num_kv_heads; kh++) {
            const int64_t len = seq_lens[s];
            const int64_t first = (window > 0 && len > window) ? len - window : 0;
            const int64_t n = len - first;
            float *scores = malloc(sizeof(float) * (size_t)(group * n));
            const int64_t *table = tables + s * table_stride;
            for (int64_t t = first; t < len; t++) {
                const float *k = k_pool + (table[t / block_size] * block_size + t % block_size)
                                 * row + kh * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float *qh = q + (s * num_heads + kh * group + g) * head_dim;
                    float dot = 0.f;
                    for (int64_t i = 0; i < head_dim; i++) dot += qh[i] * k[i];
                    scores[g * n + (t - first)] = dot * scale;
                }
            }
            for (int64_t g = 0; g < group; g++) {
                float *sc = scores + g * n;
                float mx = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
                for (int64_t t = 0; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < n; t++) sc[t] *= inv;
                float *o = out + (s * num_heads + kh * group + g) * head_dim;
                for (int64_t i = 0; i < head_dim; i++) o[i] = 0.f;
            }
            for (int64_t t = first; t < len; t++) {
                const float *v = v_pool + (table[t / block_size] * block_size + t % block_size)
                                 * row + kh * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * n + (t - first)];
                    float *o = out + (s * num_heads + kh * group + g) * head_dim;
                    for (int64_t i = 0; i < head_dim; i++) o[i] += p * v[i];
                }
            }
            free(scores);
        }
    }
}
