/* The kernels a captured step runs, as parts of one parallel region (team.h).
 *
 * Each `_part` is its kernel's work loop with the calling thread's share: an orphaned
 * `omp for ... nowait` inside a region (every thread calls it; no barrier at its end,
 * the caller meets with team_wait before anything reads the output), or the whole loop
 * when called outside one. The kernel of the same name without `_part` is the region
 * around it, for a call of its own. Same loops, same sums: a captured step's results are
 * bitwise those of the calls. */
#ifndef KVSERVE_STEP_PARTS_H
#define KVSERVE_STEP_PARTS_H

#include <stdint.h>

/* elementwise.c */
void rms_norm_part(const float *x, const float *weight, float *out, int64_t rows,
                   int64_t dim, float eps);
void add_rms_norm_part(const float *x, float *residual, const float *weight, float *out,
                       int64_t rows, int64_t dim, float eps);
void head_rms_norm_part(float *qkv, int64_t row_stride, int64_t rows, const float *q_weight,
                        const float *k_weight, int64_t num_q, int64_t num_k, int64_t head_dim,
                        float eps);
void silu_mul_part(const float *gate_up, float *out, int64_t rows, int64_t inter);
void rotary_part(float *qkv, int64_t row_stride, int64_t rows, const int64_t *positions,
                 const float *cos_table, const float *sin_table, int64_t num_q,
                 int64_t num_k, int64_t head_dim);

/* paged_attention.c (its f32 pool) */
void write_kv_part_f32(const float *k, const float *v, int64_t k_stride, int64_t v_stride,
                       const int64_t *slots, int64_t n, float *k_pool, float *v_pool,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size);
void paged_attention_rows_part_f32(const float *q, int64_t q_stride, const float *k_pool,
                                   const float *v_pool, const int64_t *tables,
                                   int64_t table_stride, const int64_t *seq_lens, float *out,
                                   int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                   int64_t head_dim, int64_t block_size, float scale,
                                   int64_t window);

/* moe_route.c: a router's logits (threads split rows x experts), then each row's top k */
void moe_logits_part(const float *x, int64_t rows, int64_t hidden, const float *w,
                     int64_t experts, float *logits);
void moe_pick_part(float *logits, int64_t rows, int64_t experts, int64_t top_k,
                   int64_t norm, int64_t *chosen, float *weights);

/* gemv.c, gemm.c: dense float32 weights, [N, K] rows or packed panels */
void gemv_rows_part(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
                    const float *bias, float *y);
void gemv_panels_part(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                      const float *bias, float *y);

/* bf16_runs.c: the float32 sums of bfloat16 rows of x (x_stride values apart) with a
 * weight in runs of sixteen rows; 1 where the build has no kernel for the runs */
int64_t bf16_runs_rows_part(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k,
                            const uint16_t *runs, int64_t n, float *y, int64_t y_stride);

/* gguf_linear.c: what x becomes before a format's products, then the products.
 * GGUF_ACT_FLOAT: x as is; GGUF_ACT_XSUM: x and its sums over 32 values (Q4_K in
 * registers); GGUF_ACT_Q8_0 / GGUF_ACT_Q8_K: x rounded to int8 per 32 values / per 256
 * with its 16-sums (gguf_rows_int8); GGUF_ACT_BF16: x rounded to bfloat16 (against BF16
 * weights, gguf_bf16_rows.h). */
enum { GGUF_ACT_FLOAT, GGUF_ACT_XSUM, GGUF_ACT_Q8_0, GGUF_ACT_Q8_K, GGUF_ACT_BF16 };

/* room for the prepared rows of x: m * k int8, m * k / 32 scales and sums, m * k / 16
 * 16-sums, m * k floats for the rows rounded to bfloat16, m * k / 32 32-sums (Q8_K: the
 * sums of each 32 of xq, what the 4- and 5-bit K formats' mins multiply) */
typedef struct {
    int8_t *xq;
    float *xd;
    int16_t *bsums;
    float *xsum;
    float *xr;
    int16_t *sums32;
} gguf_activations;

int64_t gguf_activation_kind(int64_t fmt, int64_t int8_activations, int64_t k);
void gguf_prepare_part(const float *x, int64_t m, int64_t k, int64_t kind,
                       const gguf_activations *a);
void gguf_rows_part(const float *x, int64_t kind, const gguf_activations *a, int64_t m,
                    int64_t k, const uint8_t *w, int64_t n, int64_t fmt, float *y,
                    int64_t y_stride);
void gguf_dequantize_part(const uint8_t *w, int64_t n, int64_t k, int64_t fmt, float *out);
void gguf_dequantize_row(const uint8_t *w, int64_t row, int64_t k, int64_t fmt, float *out);

#endif
