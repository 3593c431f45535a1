/* A whole Llama-family step for a few rows in one native call: the captured step.
 *
 * Eager, a step of one to four rows runs each layer as a dozen Python calls into torch,
 * oneDNN and the kernels here, and at those row counts their dispatch is a fifth of the
 * step. This runs the same kernels in the same order from C: embedding rows, then per
 * layer RMSNorm (the residual add fused), qkv GEMV, (Qwen3: each q and k head's RMSNorm
 * in place), rotary in place, the K/V written to
 * the paged pool, paged attention, o_proj, add + RMSNorm, gate_up, SiLU-and-multiply,
 * down (or a mixture of experts: the router, then each chosen expert's gated MLP over
 * its rows); the final norm and the LM head. The GEMVs are gemv_panels (kernels/gemm.c) when
 * the plan's weights are panels (P_PANELS), else gemv_rows (kernels/gemv.c), so a
 * captured step's logits are bitwise those of an eager one whose layers run on it.
 *
 * The step is one parallel region: every thread runs the layers, takes its share of each
 * kernel (their `_part` functions, step_parts.h) and meets the others at a spinning
 * barrier (team.h) before anything reads what the share wrote.
 *
 * The model is described once by a plan, an int64 array (worker/captured_step.py
 * builds it): PLAN_HEADER values, then LAYER_FIELDS pointers per layer. A pointer of 0
 * is an absent bias. Float32 weights and a float32 KV pool; or (P_GGUF) each weight a
 * GGUF layer's blocks (kernels/gguf_linear.c), described by an int64 array: its part
 * count, whether activations are rounded to int8, then each part's blocks, format and
 * rows; the embedding then in the format P_EMBED_FMT (-1: float32). */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "step_parts.h"
#include "team.h"

/* header: the sizes, then the model-wide tensors */
enum { P_LAYERS, P_HIDDEN, P_HEADS, P_KV_HEADS, P_HEAD_DIM, P_INTER, P_VOCAB, P_BLOCK,
       P_WINDOW, P_PANELS, P_EMBED, P_FINAL_NORM, P_LM_HEAD, P_LM_BIAS, P_COS, P_SIN, P_GGUF,
       P_EMBED_FMT, P_HEAD_NORMS, P_MOE_EXPERTS, P_MOE_TOP_K, P_MOE_NORM, P_MOE_INTER,
       P_MOE_COUNTS, PLAN_HEADER };
/* per layer (L_Q_NORM, L_K_NORM: with P_HEAD_NORMS, Qwen3's per-head q and k norms;
 * L_ROUTER, L_EXPERTS: a mixture-of-experts MLP, in place of gate_up and down, the
 * router's float32 [experts, hidden] weight and an int64 array of each expert's gate_up
 * and down weights, two a expert; 0: the layer's MLP is dense) */
enum { L_IN_NORM, L_QKV_W, L_QKV_B, L_O_W, L_O_B, L_POST_NORM, L_GATE_UP_W, L_GATE_UP_B,
       L_DOWN_W, L_DOWN_B, L_K_POOL, L_V_POOL, L_Q_NORM, L_K_NORM, L_ROUTER, L_EXPERTS,
       LAYER_FIELDS };
#define MOE_MAX_ROWS 8 /* the rows a step with experts takes */

#define PTR(v) ((float *)(intptr_t)(v))

/* what every thread of a step shares */
typedef struct {
    const int64_t *plan, *tokens, *positions, *slots, *tables, *seq_lens;
    int64_t table_stride, rows;
    float eps, scale;
    float *logits;
    double *timings;
    float *x, *residual, *h, *qkv, *attn, *gate_up, *act; /* activations [rows, ...] */
    float *router_logits, *route_weights, *expert_x, *expert_y; /* experts' rows */
    int64_t *route_chosen;
    gguf_activations prepared;                          /* a GGUF layer's x, rounded */
    team_barrier barrier;
} step;

static inline void sync_threads(step *s) { team_wait(&s->barrier); }

/* y [m, n] = x [m, k] . w + b for a GGUF layer (desc: see the plan above), each part
 * writing its columns, as GGUFLinearMethod.apply does; x is prepared once for each
 * kind of activations the parts take in turn. */
static void gguf_linear_part(step *s, const int64_t *desc, const float *x, int64_t m,
                             int64_t k, int64_t n, const float *bias, float *y) {
    int64_t start = 0, prepared = -1;
    for (int64_t p = 0; p < desc[0]; p++) {
        const uint8_t *w = (const uint8_t *)(intptr_t)desc[2 + 3 * p];
        const int64_t fmt = desc[3 + 3 * p], rows = desc[4 + 3 * p];
        const int64_t kind = gguf_activation_kind(fmt, desc[1], k);
        if (kind != GGUF_ACT_FLOAT && kind != prepared) {
            if (prepared >= 0) sync_threads(s); /* every thread is done with the last */
            gguf_prepare_part(x, m, k, kind, &s->prepared);
            sync_threads(s);
            prepared = kind;
        }
        gguf_rows_part(x, kind, &s->prepared, m, k, w, rows, fmt, y + start, n);
        start += rows;
    }
    if (bias) {
        sync_threads(s);
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < n; j++)
            for (int64_t r = 0; r < m; r++) y[r * n + j] += bias[j];
    }
}

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* with timings set, the seconds spent in the GEMVs and in attention (rotary, K/V writes,
 * the attention kernel) add to timings[0] and timings[1], for the step profiler, as
 * the first thread sees them (waits for the others included) */
#define TIMED(slot, ...)                                                     \
    do {                                                                     \
        const int timed_ = s->timings && omp_get_thread_num() == 0;          \
        const double t0_ = timed_ ? now() : 0.0;                             \
        __VA_ARGS__;                                                         \
        if (timed_) s->timings[slot] += now() - t0_;                         \
    } while (0)

/* y [m, n] = x [m, k] . w + b, w the plan's weight: panels, dense [n, k] or GGUF blocks;
 * the threads meet after it */
static void linear_rows(step *s, int64_t m, const float *x, int64_t k, int64_t w, int64_t n,
                        int64_t b, float *y) {
    if (s->plan[P_GGUF])
        gguf_linear_part(s, (const int64_t *)(intptr_t)w, x, m, k, n, PTR(b), y);
    else if (s->plan[P_PANELS])
        gemv_panels_part(x, m, k, PTR(w), n, PTR(b), y);
    else
        gemv_rows_part(x, m, k, PTR(w), n, PTR(b), y);
    sync_threads(s);
}

/* the step's rows through a layer */
static void linear(step *s, const float *x, int64_t k, int64_t w, int64_t n, int64_t b,
                   float *y) {
    linear_rows(s, s->rows, x, k, w, n, b, y);
}

/* out[r] (+)= y[i] * weight[i] for the rows r = rows[i] an expert ran, as the eager
 * SparseMoE adds them: the product rounded, then the sum (no fused multiply-add); a
 * row's first expert writes its product */
__attribute__((optimize("fp-contract=off")))
static void add_expert_part(const float *y, const int64_t *rows, const float *weight,
                            const int *first, int64_t count, int64_t hidden, float *out) {
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < hidden; c++)
        for (int64_t i = 0; i < count; i++) {
            const float p = y[i * hidden + c] * weight[i];
            float *o = out + rows[i] * hidden + c;
            *o = first[i] ? p : *o + p;
        }
}

/* A mixture-of-experts MLP of the step's rows h into x, as the eager SparseMoE computes
 * it: the rows routed (moe_route.c), then each expert any row chose, in expert order,
 * as one gated MLP over the rows that chose it, its outputs times their weights added
 * to those rows. Every thread walks the same routing, so all agree on the experts. */
static void moe_mlp(step *s, int64_t layer, const int64_t *L, int64_t hidden) {
    const int64_t *plan = s->plan, rows = s->rows, experts = plan[P_MOE_EXPERTS];
    const int64_t top_k = plan[P_MOE_TOP_K], inter = plan[P_MOE_INTER];
    const int64_t *weights = (const int64_t *)(intptr_t)L[L_EXPERTS];
    moe_logits_part(s->h, rows, hidden, PTR(L[L_ROUTER]), experts, s->router_logits);
    sync_threads(s);
    moe_pick_part(s->router_logits, rows, experts, top_k, plan[P_MOE_NORM], s->route_chosen,
                  s->route_weights);
    sync_threads(s);
    int seen[MOE_MAX_ROWS] = {0};
    int64_t *counts = (int64_t *)(intptr_t)plan[P_MOE_COUNTS]; /* [layers, 2]: experts
                                                                 run, tokens routed */
    if (counts && omp_get_thread_num() == 0) counts[2 * layer + 1] += rows;
    for (int64_t e = 0; e < experts; e++) {
        int64_t picked[MOE_MAX_ROWS], count = 0;
        float weight[MOE_MAX_ROWS];
        int first[MOE_MAX_ROWS];
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < top_k; j++)
                if (s->route_chosen[r * top_k + j] == e) {
                    picked[count] = r;
                    weight[count] = s->route_weights[r * top_k + j];
                    first[count++] = !seen[r];
                    seen[r] = 1;
                }
        if (!count) continue;
        if (counts && omp_get_thread_num() == 0) counts[2 * layer] += 1;
#pragma omp for schedule(static) nowait
        for (int64_t i = 0; i < count; i++)
            memcpy(s->expert_x + i * hidden, s->h + picked[i] * hidden, hidden * sizeof(float));
        sync_threads(s);
        TIMED(0, linear_rows(s, count, s->expert_x, hidden, weights[2 * e], 2 * inter, 0,
                             s->gate_up));
        silu_mul_part(s->gate_up, s->act, count, inter);
        sync_threads(s);
        TIMED(0, linear_rows(s, count, s->act, inter, weights[2 * e + 1], hidden, 0,
                             s->expert_y));
        add_expert_part(s->expert_y, picked, weight, first, count, hidden, s->x);
        sync_threads(s);
    }
}


/* the step, as each thread of the region runs it */
static void run_step(step *s) {
    const int64_t *plan = s->plan, rows = s->rows;
    const int64_t hidden = plan[P_HIDDEN], heads = plan[P_HEADS], kvh = plan[P_KV_HEADS];
    const int64_t d = plan[P_HEAD_DIM], inter = plan[P_INTER], bs = plan[P_BLOCK];
    const int64_t q_size = heads * d, kv_size = kvh * d, qkv_n = q_size + 2 * kv_size;
    const float eps = s->eps;

    if (plan[P_EMBED_FMT] < 0) {
        const float *embed = PTR(plan[P_EMBED]);
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < rows; r++)
            memcpy(s->residual + r * hidden, embed + s->tokens[r] * hidden,
                   hidden * sizeof(float));
    } else {
        const uint8_t *embed = (const uint8_t *)(intptr_t)plan[P_EMBED];
        for (int64_t r = 0; r < rows; r++)
            gguf_dequantize_row(embed, s->tokens[r], hidden, plan[P_EMBED_FMT],
                                s->residual + r * hidden);
    }
    sync_threads(s);
    for (int64_t i = 0; i < plan[P_LAYERS]; i++) {
        const int64_t *L = plan + PLAN_HEADER + i * LAYER_FIELDS;
        if (i == 0) /* the embeddings are the first residual */
            rms_norm_part(s->residual, PTR(L[L_IN_NORM]), s->h, rows, hidden, eps);
        else
            add_rms_norm_part(s->x, s->residual, PTR(L[L_IN_NORM]), s->h, rows, hidden, eps);
        sync_threads(s);
        TIMED(0, linear(s, s->h, hidden, L[L_QKV_W], qkv_n, L[L_QKV_B], s->qkv));
        TIMED(1, {
            /* each thread norms, rotates and writes the K/V of the same rows: static
             * schedules over the same rows give a thread the same rows */
            if (plan[P_HEAD_NORMS])
                head_rms_norm_part(s->qkv, qkv_n, rows, PTR(L[L_Q_NORM]), PTR(L[L_K_NORM]),
                                   heads, kvh, d, eps);
            rotary_part(s->qkv, qkv_n, rows, s->positions, PTR(plan[P_COS]),
                        PTR(plan[P_SIN]), heads, kvh, d);
            write_kv_part_f32(s->qkv + q_size, s->qkv + q_size + kv_size, qkv_n, qkv_n,
                              s->slots, rows, PTR(L[L_K_POOL]), PTR(L[L_V_POOL]), kvh, d, bs);
            sync_threads(s);
            paged_attention_rows_part_f32(s->qkv, qkv_n, PTR(L[L_K_POOL]), PTR(L[L_V_POOL]),
                                          s->tables, s->table_stride, s->seq_lens, s->attn,
                                          rows, heads, kvh, d, bs, s->scale, plan[P_WINDOW]);
            sync_threads(s);
        });
        TIMED(0, linear(s, s->attn, q_size, L[L_O_W], hidden, L[L_O_B], s->x));
        add_rms_norm_part(s->x, s->residual, PTR(L[L_POST_NORM]), s->h, rows, hidden, eps);
        sync_threads(s);
        if (L[L_EXPERTS]) {
            moe_mlp(s, i, L, hidden);
            continue;
        }
        TIMED(0, linear(s, s->h, hidden, L[L_GATE_UP_W], 2 * inter, L[L_GATE_UP_B],
                        s->gate_up));
        silu_mul_part(s->gate_up, s->act, rows, inter);
        sync_threads(s);
        TIMED(0, linear(s, s->act, inter, L[L_DOWN_W], hidden, L[L_DOWN_B], s->x));
    }
    add_rms_norm_part(s->x, s->residual, PTR(plan[P_FINAL_NORM]), s->h, rows, hidden, eps);
    sync_threads(s);
    TIMED(0, linear(s, s->h, hidden, plan[P_LM_HEAD], plan[P_VOCAB], plan[P_LM_BIAS],
                    s->logits));
}

/* floats of scratch for n values of size bytes, from a cache line's start */
static inline int64_t room(int64_t n, int64_t size) { return (n * size + 63) / 64 * 16; }

/* logits [rows, vocab] of tokens [rows] at positions [rows]; each row's K/V go to
 * slots[row] and it attends through its own block table row (table_stride apart) to
 * seq_lens[row] keys; timings: NULL, or two sums (see TIMED). Returns 0, -1 when the
 * scratch memory could not be had, -2 for more than MOE_MAX_ROWS rows through experts.
 * The plan has at least one layer. */
int64_t captured_step(const int64_t *plan, const int64_t *tokens, const int64_t *positions,
                      const int64_t *slots, const int64_t *tables, int64_t table_stride,
                      const int64_t *seq_lens, int64_t rows, float eps, float scale,
                      float *logits, double *timings) {
    const int64_t hidden = plan[P_HIDDEN], experts = plan[P_MOE_EXPERTS];
    const int64_t inter = plan[P_INTER] > plan[P_MOE_INTER] ? plan[P_INTER] : plan[P_MOE_INTER];
    const int64_t top_k = plan[P_MOE_TOP_K], q_size = plan[P_HEADS] * plan[P_HEAD_DIM];
    if (experts && rows > MOE_MAX_ROWS) return -2;
    const int64_t qkv_n = q_size + 2 * plan[P_KV_HEADS] * plan[P_HEAD_DIM];
    const int64_t widest = hidden > inter ? (hidden > q_size ? hidden : q_size)
                                          : (inter > q_size ? inter : q_size);
    /* each buffer starts on a cache line: a vector load of a GEMV's input rows that
     * straddles two lines costs two, at every weight vector */
    const int64_t sizes[] = {room(rows * hidden, 4), room(rows * hidden, 4),
                             room(rows * hidden, 4), room(rows * qkv_n, 4),
                             room(rows * q_size, 4), room(rows * 2 * inter, 4),
                             room(rows * inter, 4), room(rows * widest, 1),
                             room(rows * widest / 32, 4), room(rows * widest / 16, 2),
                             room(rows * widest / 32, 4), room(rows * widest, 4),
                             room(rows * experts, 4), room(rows * top_k, 4),
                             room(rows * top_k, 8), room(rows * hidden, 4),
                             room(rows * hidden, 4), room(rows * widest / 32, 2)};
    const int nbuf = (int)(sizeof(sizes) / sizeof(sizes[0]));
    int64_t total = 0;
    for (int b = 0; b < nbuf; b++) total += sizes[b];
    float *scratch = aligned_alloc(64, (size_t)total * sizeof(float));
    if (!scratch) return -1;
    float *buf[sizeof(sizes) / sizeof(sizes[0])];
    for (int64_t b = 0, at = 0; b < nbuf; at += sizes[b], b++) buf[b] = scratch + at;
    step s = {.plan = plan, .tokens = tokens, .positions = positions, .slots = slots,
              .tables = tables, .seq_lens = seq_lens, .table_stride = table_stride,
              .rows = rows, .eps = eps, .scale = scale, .logits = logits,
              .timings = timings, .x = buf[0], .residual = buf[1], .h = buf[2],
              .qkv = buf[3], .attn = buf[4], .gate_up = buf[5], .act = buf[6],
              .prepared = {(int8_t *)buf[7], buf[8], (int16_t *)buf[9], buf[10], buf[11],
                           (int16_t *)buf[17]},
              .router_logits = buf[12], .route_weights = buf[13],
              .route_chosen = (int64_t *)buf[14], .expert_x = buf[15], .expert_y = buf[16]};
    atomic_init(&s.barrier.arrived, 0);
    atomic_init(&s.barrier.round, 0);
#pragma omp parallel
    run_step(&s);
    free(scratch);
    return 0;
}
