/* Linear layers on GGUF's quantized blocks: y[r, j] = sum_k x[r, k] * w[j, k] for r < m,
 * with w kept as the file's blocks (llama.cpp's ggml-common.h layouts;
 * kvserve/model/gguf/quants.py describes them). Each block is decoded once per call for
 * a decode step's rows (1-8), once per ROW_BLOCK rows of a prompt chunk (int8 rows only):
 * the weight streams from memory at its quantized size, never as float32.
 *
 * Threads split the weight rows. Two ways to sum:
 * - float activations (gguf_rows; the kernels in gguf_float_rows.h): Q8_0, Q4_K and the
 *   16-bit floats decode in registers with AVX2; every format also decodes a block into
 *   a small float buffer in L1 and sums from there. Sums are per block, scaled, then
 *   added: dequantize-then-multiply's products, in another order.
 * - int8 activations (gguf_rows_int8; the kernels in gguf_int8_rows.h), as llama.cpp
 *   sums: x rounded to int8 (per 32 values against Q8_0, per 256 with 16-sums against the
 *   K formats, its Q8_0 and Q8_K) and the products summed in integers with AVX2
 *   (maddubs/madd; AVX-512 VNNI's dpbusd/dpwssd where the build has them, the same
 *   integers), each block's scales applied in integers, one float multiply a block;
 *   one row (a single stream's step) has its own loops, kept in registers. The weight
 *   rows are prefetched ahead. Any number of rows: a prompt chunk's are summed as a
 *   decode step's (in runs of rows, bit for bit as each row alone).
 *
 * fmt: 0 Q8_0, 1 Q4_0, 2 Q4_K, 3 Q5_K, 4 Q6_K, 5 BF16, 6 F16 (the 16-bit floats, kept as
 * stored: two bytes a weight read, widened in registers), 7 Q4_K_X4, 8 Q5_K_X4 and 9
 * Q6_K_X4 (Q4_K, Q5_K and Q6_K four rows interleaved, gguf_k_x4.h and gguf_q6_k_x4.h),
 * 10 Q8_0_X8 (Q8_0 eight rows interleaved, gguf_q8_0_x8.h), 11 BF16_X16 (BF16 in runs of
 * sixteen rows, bf16_runs.c, where the build has AVX512-BF16): runs of rows, int8 (or
 * bfloat16) rows against each run in registers, float rows through each run unpacked
 * on the stack.
 * Output columns j land at y[r * y_stride + j], so the parts of a fused layer write their
 * own columns.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "step_parts.h"
#include "vec_math.h"

#define MAX_ROWS 8
#ifndef X4_CODES_ROWS /* more rows than this: a run's codes decoded once for them */
#define X4_CODES_ROWS 4
#endif
#ifndef ROW_BLOCK /* the rows of x (int8) a weight row is read once for */
#define ROW_BLOCK 128
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 1024
#endif

enum { Q8_0 = 0, Q4_0 = 1, Q4_K = 2, Q5_K = 3, Q6_K = 4, BF16 = 5, F16 = 6, Q4_K_X4 = 7,
       Q5_K_X4 = 8, Q6_K_X4 = 9, Q8_0_X8 = 10, BF16_X16 = 11 };

/* BF16 and F16 rows are taken 32 values at a time, as a block; a format in runs of rows
 * (Q4_K_X4 on) counts a row's bytes a block */
static const int64_t BLOCK_VALUES[] = {32, 32, 256, 256, 256, 32, 32, 256, 256, 256, 32, 32};
static const int64_t BLOCK_BYTES[] = {34, 18, 144, 176, 210, 64, 64, 148, 180, 210, 34, 64};

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__) && defined(__AVX2__) /* immintrin.h comes with AVX2 */
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f,
                   man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* The K formats' 6-bit scale and min of sub-block s from their 12 packed bytes. */
static inline void scale_min_k4(int s, const uint8_t *q, float *sc, float *mn) {
    if (s < 4) {
        *sc = (float)(q[s] & 63);
        *mn = (float)(q[s + 4] & 63);
    } else {
        *sc = (float)((q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4));
        *mn = (float)((q[s + 4] >> 4) | ((q[s] >> 6) << 4));
    }
}

#include "gguf_k_x4.h"
#include "gguf_q6_k_x4.h"
#include "gguf_q8_0_x8.h"

/* The rows of a run of fmt (a format in runs of rows) */
static inline int64_t run_rows(int64_t fmt) {
    return fmt == Q8_0_X8 ? 8 : fmt == BF16_X16 ? 16 : 4;
}

/* fmt is known and k whole blocks of it; for the runs of rows, n whole runs of at most
 * X4_MAX_K values */
static inline int valid_layout(int64_t fmt, int64_t k, int64_t n) {
    return fmt >= 0 && fmt <= BF16_X16 && k % BLOCK_VALUES[fmt] == 0 &&
           (fmt < Q4_K_X4 || (n % run_rows(fmt) == 0 && k <= X4_MAX_K));
}

/* One block of format fmt as floats. */
static void decode_block(int fmt, const uint8_t *b, float *out) {
    switch (fmt) {
    case Q8_0: {
        const float d = half_to_float(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; i++) out[i] = d * (float)q[i];
        break;
    }
    case Q4_0: {
        const float d = half_to_float(b);
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((b[2 + i] & 0xF) - 8);
            out[i + 16] = d * (float)((b[2 + i] >> 4) - 8);
        }
        break;
    }
    case Q4_K:
    case Q5_K: {
        const float d = half_to_float(b), dmin = half_to_float(b + 2);
        const uint8_t *qh = b + 16, *qs = b + (fmt == Q4_K ? 16 : 48);
        for (int c = 0; c < 4; c++) {
            for (int half = 0; half < 2; half++) {
                const int s = 2 * c + half;
                float sc, mn;
                scale_min_k4(s, b + 4, &sc, &mn);
                const float a = d * sc, m = dmin * mn;
                for (int l = 0; l < 32; l++) {
                    int q = half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0xF;
                    if (fmt == Q5_K) q |= ((qh[l] >> s) & 1) << 4;
                    out[32 * s + l] = a * (float)q - m;
                }
            }
        }
        break;
    }
    case BF16:
        for (int i = 0; i < 32; i++) {
            uint16_t h;
            memcpy(&h, b + 2 * i, 2);
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(out + i, &bits, 4);
        }
        break;
    case F16:
        for (int i = 0; i < 32; i++) out[i] = half_to_float(b + 2 * i);
        break;
    case Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_to_float(b + 208);
        for (int h = 0; h < 2; h++) {
            const uint8_t *l0 = ql + 64 * h, *h0 = qh + 32 * h;
            const int8_t *s0 = sc + 8 * h;
            float *o = out + 128 * h;
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int)((l0[l] & 0xF) | ((h0[l] & 3) << 4)) - 32;
                const int q2 = (int)((l0[l + 32] & 0xF) | (((h0[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((l0[l] >> 4) | (((h0[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((l0[l + 32] >> 4) | (((h0[l] >> 6) & 3) << 4)) - 32;
                o[l] = d * (float)s0[is] * (float)q1;
                o[l + 32] = d * (float)s0[is + 2] * (float)q2;
                o[l + 64] = d * (float)s0[is + 4] * (float)q3;
                o[l + 96] = d * (float)s0[is + 6] * (float)q4;
            }
        }
        break;
    }
    }
}

#include "gguf_float_rows.h"
#include "gguf_int8_rows.h"
#include "gguf_bf16_rows.h"

/* What x becomes before the products with fmt's rows (step_parts.h): rounded to int8
 * where asked and this build has the integer kernel, with its 32-value sums for Q4_K in
 * float registers (up to 16384 values a row: the sums of a call live on its stack). */
int64_t gguf_activation_kind(int64_t fmt, int64_t int8_activations, int64_t k) {
#ifdef __AVX2__
    if (int8_activations && (fmt == Q8_0 || fmt == Q8_0_X8)) return GGUF_ACT_Q8_0;
    if (int8_activations && (fmt == Q4_K || fmt == Q5_K || fmt == Q6_K ||
                             (fmt >= Q4_K_X4 && fmt <= Q6_K_X4)))
        return GGUF_ACT_Q8_K;
#endif
    if (int8_activations && (fmt == BF16 || fmt == BF16_X16))
        return GGUF_ACT_BF16; /* on every build */
    return (fmt == Q4_K || fmt == Q4_K_X4) && k / 32 <= 512 ? GGUF_ACT_XSUM : GGUF_ACT_FLOAT;
}

/* The rows of x [m, k] prepared as kind into a, the threads splitting the blocks. */
void gguf_prepare_part(const float *x, int64_t m, int64_t k, int64_t kind,
                       const gguf_activations *a) {
    if (kind == GGUF_ACT_XSUM) {
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < m * (k / 32); g++) {
            float s = 0.f;
            for (int t = 0; t < 32; t++) s += x[32 * g + t];
            a->xsum[g] = s;
        }
    } else if (kind == GGUF_ACT_BF16) {
#pragma omp for schedule(static) nowait
        for (int64_t r = 0; r < m; r++) round_row_bf16(x + r * k, k, a->xr + r * k);
    }
#ifdef __AVX2__
    else if (kind == GGUF_ACT_Q8_0) {
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < m * (k / 32); b++)
            quantize_blocks_q8(x + 32 * b, 1, a->xq + 32 * b, a->xd + b);
    } else if (kind == GGUF_ACT_Q8_K) {
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < m * (k / 256); b++) {
            quantize_blocks_q8_k(x + 256 * b, 1, a->xq + 256 * b, a->xd + b, a->bsums + 16 * b);
            for (int j = 0; j < 8; j++) /* at most 32 x 127: 16 bits */
                a->sums32[8 * b + j] =
                    (int16_t)(a->bsums[16 * b + 2 * j] + a->bsums[16 * b + 2 * j + 1]);
        }
    }
#endif
}

/* sums[r] = x[r, :] . dequantized wr for r < m: one weight row of fmt (not in runs) */
static void one_row(const float *x, int64_t kind, const gguf_activations *a, int64_t m,
                    int64_t k, const uint8_t *wr, int64_t fmt, float *sums) {
#ifndef BF16_TILES /* else gguf_rows_part takes them in tiles */
    if (kind == GGUF_ACT_BF16) {
        row_bf16_rounded(a->xr, m, k, wr, sums);
        return;
    }
#endif
#ifdef __AVX2__
    if (kind == GGUF_ACT_Q8_0 && m == 1)
        sums[0] = row_q8_0_q8_1(a->xq, a->xd, k, wr);
    else if (kind == GGUF_ACT_Q8_0)
        row_q8_0_q8(a->xq, a->xd, m, k, wr, sums);
    else if (kind == GGUF_ACT_Q8_K && m == 1 && fmt == Q6_K) /* Q4_K's go in pairs */
        sums[0] = row_q6_k_q8k_1(a->xq, a->xd, a->bsums, k, wr);
    else if (kind == GGUF_ACT_Q8_K && fmt == Q4_K)
        row_k_q8k(0, a->xq, a->xd, a->bsums, m, k, wr, sums);
    else if (kind == GGUF_ACT_Q8_K && fmt == Q5_K)
        row_k_q8k(1, a->xq, a->xd, a->bsums, m, k, wr, sums);
    else if (kind == GGUF_ACT_Q8_K && fmt == Q6_K)
        row_q6_k_q8k(a->xq, a->xd, a->bsums, m, k, wr, sums);
    else if (fmt == Q8_0)
        row_q8_0(x, m, k, wr, sums);
    else if (fmt == BF16 || fmt == F16)
        row_16bit(fmt == BF16, x, m, k, wr, sums);
    else if (kind == GGUF_ACT_XSUM)
        row_q4_k(x, a->xsum, m, k, wr, sums);
    else
#endif
        row_buffered((int)fmt, x, m, k, wr, sums);
}

/* The prepared rows of x from row r0 on (kind's layout: xq k a row, xd one scale per 32
 * values (Q8_0) or 256 (Q8_K), bsums one per 16, xsum and sums32 one per 32) */
static gguf_activations rows_from(int64_t kind, const gguf_activations *a, int64_t r0,
                                  int64_t k) {
    gguf_activations s = *a;
    if (s.xq) s.xq += r0 * k;
    if (s.xd) s.xd += r0 * (k / (kind == GGUF_ACT_Q8_0 ? 32 : 256));
    if (s.bsums) s.bsums += r0 * (k / 16);
    if (s.xsum) s.xsum += r0 * (k / 32);
    if (s.xr) s.xr += r0 * k;
    if (s.sums32) s.sums32 += r0 * (k / 32);
    return s;
}

#include "gguf_runs.h"

/* y[r * y_stride + j] = x[r, :] . dequantized w[j, :] for r < m, j < n, from x prepared
 * as kind (gguf_prepare_part), the threads splitting the weight rows. More than MAX_ROWS
 * rows (a prompt chunk) only rounded to int8: ROW_BLOCK rows of x at a time, each weight
 * row read once for them and used MAX_ROWS rows at a time from cache. */
void gguf_rows_part(const float *x, int64_t kind, const gguf_activations *a, int64_t m,
                    int64_t k, const uint8_t *w, int64_t n, int64_t fmt, float *y,
                    int64_t y_stride) {
    if (fmt >= Q4_K_X4) {
        runs_rows_part(fmt, x, kind, a, m, k, w, n, y, y_stride);
        return;
    }
    const int64_t row_bytes = k / BLOCK_VALUES[fmt] * BLOCK_BYTES[fmt];
#ifdef BF16_TILES
    if (kind == GGUF_ACT_BF16) {
        bf16_rows_part(a->xr, m, k, w, n, y, y_stride);
        return;
    }
#endif
#ifdef __AVX2__
    if (kind == GGUF_ACT_Q8_K && fmt == Q4_K && m == 1) { /* weight rows two at a time */
#pragma omp for schedule(static) nowait
        for (int64_t pair = 0; pair < (n + 1) / 2; pair++) {
            const int64_t j = 2 * pair;
            const uint8_t *wr = w + j * row_bytes;
            if (j + 1 < n) {
                float two[2];
                row_q4_k_q8k_pair(a->xq, a->xd, a->bsums, k, wr, wr + row_bytes, two);
                y[j] = two[0];
                y[j + 1] = two[1];
            } else {
                y[j] = row_q4_k_q8k_1(a->xq, a->xd, a->bsums, k, wr);
            }
        }
        return;
    }
#endif
    for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
        const int64_t end = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
#pragma omp for schedule(static) nowait
        for (int64_t j = 0; j < n; j++)
            for (int64_t r = r0; r < end; r += MAX_ROWS) {
                const int64_t count = end - r < MAX_ROWS ? end - r : MAX_ROWS;
                const gguf_activations rows = rows_from(kind, a, r, k);
                float sums[MAX_ROWS];
                one_row(x + r * k, kind, &rows, count, k, w + j * row_bytes, fmt, sums);
                for (int64_t i = 0; i < count; i++) y[(r + i) * y_stride + j] = sums[i];
            }
    }
}

/* As gguf_rows, with x rounded as llama.cpp rounds it: to int8 with the products summed
 * in integers, Q8_0 against x in blocks of 32 with one scale each (its Q8_0), Q4_K, Q5_K
 * and Q6_K against x in blocks of 256 (its Q8_K), with AVX2; to bfloat16 against BF16,
 * on every build. Returns 1 where it does not apply (another format, no AVX2 for the
 * integer kernels), and the caller runs gguf_rows instead; -1 without memory for the
 * rounded rows. */
int64_t gguf_rows_int8(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                       int64_t fmt, float *y, int64_t y_stride) {
    if (!valid_layout(fmt, k, n) || m < 1) return 1;
    const int64_t kind = gguf_activation_kind(fmt, 1, k);
    gguf_activations a = {NULL, NULL, NULL, NULL, NULL, NULL};
    int ok;
    if (kind == GGUF_ACT_BF16) {
        a.xr = aligned_alloc(64, sizeof(float) * (size_t)((m * k + 15) / 16 * 16));
        ok = a.xr != NULL;
    } else if (kind == GGUF_ACT_Q8_0 || kind == GGUF_ACT_Q8_K) {
        a.xq = malloc((size_t)(m * k));
        a.xd = malloc(sizeof(float) * (size_t)(m * k / 32));
        a.bsums = malloc(sizeof(int16_t) * (size_t)(m * k / 16));
        a.sums32 = malloc(sizeof(int16_t) * (size_t)(m * k / 32));
        ok = a.xq && a.xd && a.bsums && a.sums32;
    } else {
        return 1;
    }
    if (ok) {
#pragma omp parallel
        {
            gguf_prepare_part(x, m, k, kind, &a);
#pragma omp barrier
            gguf_rows_part(x, kind, &a, m, k, w, n, fmt, y, y_stride);
        }
    }
    free(a.xq);
    free(a.xd);
    free(a.bsums);
    free(a.xr);
    free(a.sums32);
    return ok ? 0 : -1;
}

/* y[r * y_stride + j] = x[r, :] . dequantized w[j, :] for r < m, j < n; w holds n rows
 * of k / BLOCK_VALUES[fmt] blocks each. Returns 0, or -1 for an unknown format, k not
 * whole blocks, or more than MAX_ROWS rows. */
int64_t gguf_rows(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                  int64_t fmt, float *y, int64_t y_stride) {
    if (!valid_layout(fmt, k, n) || m < 1 || m > MAX_ROWS) return -1;
    float xsum[MAX_ROWS * 512];
    const gguf_activations a = {NULL, NULL, NULL, xsum, NULL, NULL};
    const int64_t kind = gguf_activation_kind(fmt, 0, k);
#pragma omp parallel
    {
        gguf_prepare_part(x, m, k, kind, &a);
#pragma omp barrier
        gguf_rows_part(x, kind, &a, m, k, w, n, fmt, y, y_stride);
    }
    return 0;
}

/* The floats of n rows of fmt blocks (k values each) into out [n, k]: the tiles the
 * many-row GEMMs multiply, a few rows of the weight at a time. */
void gguf_dequantize_part(const uint8_t *w, int64_t n, int64_t k, int64_t fmt, float *out) {
    if (fmt >= Q4_K_X4) {
        const int64_t plain = runs_plain(fmt), per_run = run_rows(fmt), bv = BLOCK_VALUES[fmt];
        const int64_t row_bytes = k / bv * BLOCK_BYTES[plain];
        uint8_t rows[UNPACKED_BYTES];
#pragma omp for schedule(static) nowait
        for (int64_t run = 0; run < n / per_run; run++)
            for (int first = 0; first < per_run; first += 4) {
                runs_unpack(plain, w + run * runs_bytes(fmt, k), k, first, rows, row_bytes);
                for (int64_t b = 0; b < 4 * (k / bv); b++)
                    decode_block((int)plain, rows + b * BLOCK_BYTES[plain],
                                 out + (per_run * run + first) * k + b * bv);
            }
        return;
    }
    const int64_t bv = BLOCK_VALUES[fmt], bb = BLOCK_BYTES[fmt], per_row = k / bv;
#pragma omp for schedule(static) nowait
    for (int64_t j = 0; j < n; j++)
        for (int64_t b = 0; b < per_row; b++)
            decode_block((int)fmt, w + (j * per_row + b) * bb, out + j * k + b * bv);
}

/* Row `row` of a weight of fmt blocks (k values a row) at w into out [k]: a token
 * embedding's lookup (of a run of rows, its four rows holding it unpacked on the stack
 * first). */
void gguf_dequantize_row(const uint8_t *w, int64_t row, int64_t k, int64_t fmt, float *out) {
    const int64_t bv = BLOCK_VALUES[fmt], bb = BLOCK_BYTES[fmt];
    if (fmt >= Q4_K_X4) {
        const int64_t plain = runs_plain(fmt), per_run = run_rows(fmt);
        const int64_t row_bytes = k / bv * BLOCK_BYTES[plain], first = row % per_run / 4 * 4;
        uint8_t rows[UNPACKED_BYTES];
        runs_unpack(plain, w + row / per_run * runs_bytes(fmt, k), k, (int)first, rows,
                    row_bytes);
        for (int64_t b = 0; b < k / bv; b++)
            decode_block((int)plain, rows + (row % per_run - first) * row_bytes
                                         + b * BLOCK_BYTES[plain], out + b * bv);
        return;
    }
    for (int64_t b = 0; b < k / bv; b++)
        decode_block((int)fmt, w + (row * (k / bv) + b) * bb, out + b * bv);
}

int64_t gguf_dequantize(const uint8_t *w, int64_t n, int64_t k, int64_t fmt, float *out) {
    if (!valid_layout(fmt, k, n)) return -1;
#pragma omp parallel
    gguf_dequantize_part(w, n, k, fmt, out);
    return 0;
}
