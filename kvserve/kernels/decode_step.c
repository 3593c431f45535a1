/* A whole Llama-family step for a few rows in one native call: the captured step.
 *
 * Eager, a step of one to four rows runs each layer as a dozen Python calls into torch,
 * oneDNN and the kernels here, and at those row counts their dispatch is a fifth of the
 * step. This runs the same kernels in the same order from C: embedding rows, then per
 * layer RMSNorm (the residual add fused), qkv GEMV, rotary in place, the K/V written to
 * the paged pool, paged attention, o_proj, add + RMSNorm, gate_up, SiLU-and-multiply,
 * down; the final norm and the LM head. The GEMVs are gemv_panels (kernels/gemm.c) when
 * the plan's weights are panels (P_PANELS), else gemv_rows (kernels/gemv.c), so a
 * captured step's logits are bitwise those of an eager one whose layers run on it.
 *
 * The model is described once by a plan, an int64 array (worker/captured_step.py
 * builds it): PLAN_HEADER values, then LAYER_FIELDS pointers per layer. A pointer of 0
 * is an absent bias. Float32 weights and a float32 KV pool; or (P_GGUF) each weight a
 * GGUF layer's blocks (kernels/gguf_linear.c), described by an int64 array: its part
 * count, whether activations are rounded to int8, then each part's blocks, format and
 * rows; the embedding then in the format P_EMBED_FMT (-1: float32), P_EMBED_ROW bytes a
 * row. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void gemv_rows(const float *x, int64_t m, int64_t k, const float *w, int64_t n,
               const float *bias, float *y);
void gemv_panels(const float *x, int64_t m, int64_t k, const float *panels, int64_t n,
                 const float *bias, float *y);
int64_t gguf_rows(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                  int64_t fmt, float *y, int64_t y_stride);
int64_t gguf_rows_int8(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                       int64_t fmt, float *y, int64_t y_stride);
int64_t gguf_dequantize(const uint8_t *w, int64_t n, int64_t k, int64_t fmt, float *out);
void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
              float eps);
void add_rms_norm(const float *x, float *residual, const float *weight, float *out,
                  int64_t rows, int64_t dim, float eps);
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter);
void rotary(float *qkv, int64_t row_stride, int64_t rows, const int64_t *positions,
            const float *cos_table, const float *sin_table, int64_t num_q, int64_t num_k,
            int64_t head_dim);
void write_kv_f32(const float *k, const float *v, int64_t k_stride, int64_t v_stride,
                  const int64_t *slots, int64_t n, float *k_pool, float *v_pool,
                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size);
void paged_attention_rows_f32(const float *q, int64_t q_stride, const float *k_pool,
                              const float *v_pool, const int64_t *tables,
                              int64_t table_stride, const int64_t *seq_lens, float *out,
                              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, int64_t block_size, float scale,
                              int64_t window);

/* header: the sizes, then the model-wide tensors */
enum { P_LAYERS, P_HIDDEN, P_HEADS, P_KV_HEADS, P_HEAD_DIM, P_INTER, P_VOCAB, P_BLOCK,
       P_WINDOW, P_PANELS, P_EMBED, P_FINAL_NORM, P_LM_HEAD, P_LM_BIAS, P_COS, P_SIN, P_GGUF,
       P_EMBED_FMT, P_EMBED_ROW, PLAN_HEADER };
/* per layer */
enum { L_IN_NORM, L_QKV_W, L_QKV_B, L_O_W, L_O_B, L_POST_NORM, L_GATE_UP_W, L_GATE_UP_B,
       L_DOWN_W, L_DOWN_B, L_K_POOL, L_V_POOL, LAYER_FIELDS };

#define PTR(v) ((float *)(intptr_t)(v))

/* y [m, n] = x [m, k] . w + b for a GGUF layer (desc: see the plan above), each part
 * writing its columns, as GGUFLinearMethod.apply does */
static void gguf_linear(const int64_t *desc, const float *x, int64_t m, int64_t k,
                        int64_t n, const float *bias, float *y) {
    int64_t start = 0;
    for (int64_t p = 0; p < desc[0]; p++) {
        const uint8_t *w = (const uint8_t *)(intptr_t)desc[2 + 3 * p];
        const int64_t fmt = desc[3 + 3 * p], rows = desc[4 + 3 * p];
        if (!desc[1] || gguf_rows_int8(x, m, k, w, rows, fmt, y + start, n) != 0)
            gguf_rows(x, m, k, w, rows, fmt, y + start, n);
        start += rows;
    }
    if (bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t j = 0; j < n; j++) y[r * n + j] += bias[j];
}

/* y [m, n] = x [m, k] . w + b, w the plan's weight: panels, dense [n, k] or GGUF blocks */
static inline void linear(const int64_t *plan, const float *x, int64_t m, int64_t k,
                          int64_t w, int64_t n, int64_t b, float *y) {
    if (plan[P_GGUF]) gguf_linear((const int64_t *)(intptr_t)w, x, m, k, n, PTR(b), y);
    else if (plan[P_PANELS]) gemv_panels(x, m, k, PTR(w), n, PTR(b), y);
    else gemv_rows(x, m, k, PTR(w), n, PTR(b), y);
}

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* with timings set, the seconds spent in the GEMVs and in attention (rotary, K/V writes,
 * the attention kernel) add to timings[0] and timings[1], for the step profiler */
#define TIMED(slot, ...)                           \
    do {                                           \
        const double t0_ = timings ? now() : 0.0;  \
        __VA_ARGS__;                               \
        if (timings) timings[slot] += now() - t0_; \
    } while (0)

/* logits [rows, vocab] of tokens [rows] at positions [rows]; each row's K/V go to
 * slots[row] and it attends through its own block table row (table_stride apart) to
 * seq_lens[row] keys; timings: NULL, or two sums (see TIMED). Returns 0, or -1 when
 * the scratch memory could not be had. The plan has at least one layer. */
int64_t captured_step(const int64_t *plan, const int64_t *tokens, const int64_t *positions,
                      const int64_t *slots, const int64_t *tables, int64_t table_stride,
                      const int64_t *seq_lens, int64_t rows, float eps, float scale,
                      float *logits, double *timings) {
    const int64_t hidden = plan[P_HIDDEN], heads = plan[P_HEADS], kvh = plan[P_KV_HEADS];
    const int64_t d = plan[P_HEAD_DIM], inter = plan[P_INTER], bs = plan[P_BLOCK];
    const int64_t q_size = heads * d, kv_size = kvh * d, qkv_n = q_size + 2 * kv_size;
    /* each buffer starts on a cache line: a vector load of a GEMV's input rows that
     * straddles two lines costs two, at every weight vector */
    const int64_t sizes[] = {hidden, hidden, hidden, qkv_n, q_size, 2 * inter, inter};
    float *buf[7];
    int64_t total = 0;
    for (int b = 0; b < 7; b++) total += (rows * sizes[b] + 15) / 16 * 16;
    float *scratch = aligned_alloc(64, (size_t)total * sizeof(float));
    if (!scratch) return -1;
    int64_t at = 0;
    for (int b = 0; b < 7; at += (rows * sizes[b] + 15) / 16 * 16, b++)
        buf[b] = scratch + at;
    float *x = buf[0], *residual = buf[1], *h = buf[2], *qkv = buf[3], *attn = buf[4];
    float *gate_up = buf[5], *act = buf[6];

    if (plan[P_EMBED_FMT] < 0) {
        const float *embed = PTR(plan[P_EMBED]);
        for (int64_t r = 0; r < rows; r++)
            memcpy(residual + r * hidden, embed + tokens[r] * hidden, hidden * sizeof(float));
    } else {
        const uint8_t *embed = (const uint8_t *)(intptr_t)plan[P_EMBED];
        for (int64_t r = 0; r < rows; r++)
            gguf_dequantize(embed + tokens[r] * plan[P_EMBED_ROW], 1, hidden,
                            plan[P_EMBED_FMT], residual + r * hidden);
    }
    for (int64_t i = 0; i < plan[P_LAYERS]; i++) {
        const int64_t *L = plan + PLAN_HEADER + i * LAYER_FIELDS;
        if (i == 0) /* the embeddings are the first residual */
            rms_norm(residual, PTR(L[L_IN_NORM]), h, rows, hidden, eps);
        else
            add_rms_norm(x, residual, PTR(L[L_IN_NORM]), h, rows, hidden, eps);
        TIMED(0, linear(plan, h, rows, hidden, L[L_QKV_W], qkv_n, L[L_QKV_B], qkv));
        TIMED(1, {
            rotary(qkv, qkv_n, rows, positions, PTR(plan[P_COS]), PTR(plan[P_SIN]), heads,
                   kvh, d);
            write_kv_f32(qkv + q_size, qkv + q_size + kv_size, qkv_n, qkv_n, slots, rows,
                         PTR(L[L_K_POOL]), PTR(L[L_V_POOL]), kvh, d, bs);
            paged_attention_rows_f32(qkv, qkv_n, PTR(L[L_K_POOL]), PTR(L[L_V_POOL]), tables,
                                     table_stride, seq_lens, attn, rows, heads, kvh, d, bs,
                                     scale, plan[P_WINDOW]);
        });
        TIMED(0, linear(plan, attn, rows, q_size, L[L_O_W], hidden, L[L_O_B], x));
        add_rms_norm(x, residual, PTR(L[L_POST_NORM]), h, rows, hidden, eps);
        TIMED(0, linear(plan, h, rows, hidden, L[L_GATE_UP_W], 2 * inter, L[L_GATE_UP_B],
                        gate_up));
        silu_mul(gate_up, act, rows, inter);
        TIMED(0, linear(plan, act, rows, inter, L[L_DOWN_W], hidden, L[L_DOWN_B], x));
    }
    add_rms_norm(x, residual, PTR(plan[P_FINAL_NORM]), h, rows, hidden, eps);
    TIMED(0, linear(plan, h, rows, hidden, plan[P_LM_HEAD], plan[P_VOCAB], plan[P_LM_BIAS],
                    logits));
    free(scratch);
    return 0;
}
