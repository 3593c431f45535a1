/* The runs of rows (Q4_K_X4, Q5_K_X4, Q6_K_X4: gguf_k_x4.h, gguf_q6_k_x4.h; Q8_0_X8:
 * gguf_q8_0_x8.h; BF16_X16: bf16_runs.c's layout, row_runs.h) as a layer's weight: the
 * file's rows into runs and back, and the products of a step's rows against them.
 * Included by gguf_linear.c (after one_row and rows_from). */
#include "row_runs.h"

/* The file's format of a runs-of-rows format */
static inline int64_t runs_plain(int64_t fmt) {
    return fmt == Q4_K_X4 ? Q4_K : fmt == Q5_K_X4 ? Q5_K : fmt == Q6_K_X4 ? Q6_K
         : fmt == BF16_X16 ? BF16 : Q8_0;
}

/* The runs format of a file's format (Q4_K, Q5_K, Q6_K, Q8_0 or BF16) */
static inline int64_t runs_of(int64_t plain) {
    return plain == Q4_K ? Q4_K_X4 : plain == Q5_K ? Q5_K_X4 : plain == Q6_K ? Q6_K_X4
         : plain == BF16 ? BF16_X16 : Q8_0_X8;
}

/* Rows first..first + 3 of a BF16_X16 run (row_runs.h: sixteen rows, each pair of
 * columns a group) back into BF16 rows, row_bytes apart */
static void bf16_x16_unpack(const uint8_t *run, int64_t k, int first, uint8_t *rows,
                            int64_t row_bytes) {
    for (int i = 0; i < 4; i++)
        for (int64_t c = 0; c < 2 * k; c += 4)
            memcpy(rows + i * row_bytes + c, run + 16 * c + 4 * (first + i), 4);
}

/* The bytes of one run of fmt, rows of k values */
static inline int64_t runs_bytes(int64_t fmt, int64_t k) {
    return run_rows(fmt) * (k / BLOCK_VALUES[fmt]) * BLOCK_BYTES[fmt];
}

/* Room for four rows unpacked (runs_unpack), the longest rows of the widest format
 * (BF16's, two bytes a value) */
#define UNPACKED_BYTES (4 * X4_MAX_K * 2)

/* A run's rows of the file's format plain (Q4_K, Q5_K, Q6_K, Q8_0 or BF16), row_bytes
 * apart, into one run of its layout; and rows first..first + 3 of a run back (first 0 but
 * for Q8_0's eight and BF16's sixteen). */
static void runs_pack(int64_t plain, const uint8_t *rows, int64_t row_bytes, int64_t k,
                      uint8_t *out) {
    if (plain == Q8_0)
        q8_0_x8_pack(rows, row_bytes, k, out);
    else if (plain == BF16)
        pack_row_run(rows, 16, row_bytes, 16, 4, out);
    else if (plain == Q6_K)
        q6_k_x4_pack(rows, row_bytes, k, out);
    else
        k_x4_pack(plain == Q5_K, rows, row_bytes, k, out);
}

static void runs_unpack(int64_t plain, const uint8_t *run, int64_t k, int first,
                        uint8_t *rows, int64_t row_bytes) {
    if (plain == Q8_0)
        q8_0_x8_unpack(run, k, first, 4, rows, row_bytes);
    else if (plain == BF16)
        bf16_x16_unpack(run, k, first, rows, row_bytes);
    else if (plain == Q6_K)
        q6_k_x4_unpack(run, k, rows, row_bytes);
    else
        k_x4_unpack(plain == Q5_K, run, k, rows, row_bytes);
}

/* n rows of blocks of the file's format fmt (Q4_K, Q5_K, Q6_K, Q8_0 or BF16; k values
 * each) into its runs of rows (dst: 148 / 144 as many bytes as src, Q5_K 180 / 176, the
 * others as many); back again with unpack. Returns 0; 1 where this build has no kernel
 * for the layout (no AVX2; BF16: no AVX512-BF16: keep the file's); -1 for another format,
 * n not whole runs, k not whole blocks or over X4_MAX_K. */
int64_t gguf_repack_runs(const uint8_t *src, int64_t n, int64_t k, int64_t fmt, uint8_t *dst,
                         int64_t unpack) {
    if (fmt != Q4_K && fmt != Q5_K && fmt != Q6_K && fmt != Q8_0 && fmt != BF16) return -1;
    const int64_t runs = runs_of(fmt);
    const int64_t per_run = run_rows(runs);
    if (n % per_run || k % BLOCK_VALUES[fmt] || n < 0 || k > X4_MAX_K) return -1;
#ifndef __AVX2__
    if (!unpack) return 1;
#endif
#ifndef BF16_RUNS_KERNEL
    if (!unpack && fmt == BF16) return 1;
#endif
    const int64_t row_bytes = k / BLOCK_VALUES[fmt] * BLOCK_BYTES[fmt];
    const int64_t run_bytes = runs_bytes(runs, k);
#pragma omp parallel for schedule(static)
    for (int64_t run = 0; run < n / per_run; run++) {
        if (unpack)
            for (int first = 0; first < per_run; first += 4)
                runs_unpack(fmt, src + run * run_bytes, k, first,
                            dst + (run * per_run + first) * row_bytes, row_bytes);
        else
            runs_pack(fmt, src + run * per_run * row_bytes, row_bytes, k, dst + run * run_bytes);
    }
    return 0;
}

#ifdef __AVX2__
/* `rows` Q8_K rows (1-4; Q6_K_X4 from the run's bytes: 1-2) against one run, from its
 * bytes or its codes decoded (codes: k_x4_decode's, q6_k_x4_decode's): each count its own
 * copy of the loop, so the rows' sums stay in registers */
static void x4_q8k_rows(int64_t fmt, int rows, const gguf_activations *a, int64_t k,
                        const uint8_t *g, const uint8_t *codes, float *out,
                        int64_t out_stride) {
    const int8_t *xq = a->xq;
    const float *xd = a->xd;
    const int16_t *bs = a->bsums, *s32 = a->sums32;
#define K_X4(five, r) (codes ? k_x4_q8k(five, r, xq, xd, s32, k, g, codes, out, out_stride) \
                             : k_x4_q8k(five, r, xq, xd, s32, k, g, NULL, out, out_stride))
#define Q6_X4(r) q6_k_x4_q8k_decoded(r, xq, xd, bs, k, g, codes, out, out_stride)
    if (fmt == Q6_K_X4 && !codes) {
        if (rows == 2) q6_k_x4_q8k(2, xq, xd, bs, k, g, out, out_stride);
        else q6_k_x4_q8k(1, xq, xd, bs, k, g, out, out_stride);
    } else if (fmt == Q6_K_X4) {
        switch (rows) {
        case 4: Q6_X4(4); break;
        case 3: Q6_X4(3); break;
        case 2: Q6_X4(2); break;
        default: Q6_X4(1);
        }
    } else if (fmt == Q5_K_X4) {
        switch (rows) {
        case 4: K_X4(1, 4); break;
        case 3: K_X4(1, 3); break;
        case 2: K_X4(1, 2); break;
        default: K_X4(1, 1);
        }
    } else {
        switch (rows) {
        case 4: K_X4(0, 4); break;
        case 3: K_X4(0, 3); break;
        case 2: K_X4(0, 2); break;
        default: K_X4(0, 1);
        }
    }
#undef K_X4
#undef Q6_X4
}
#endif

/* The runs of rows (fmt Q4_K_X4 on): int8 rows in registers (AVX2), a few x rows at a
 * time against each run, ROW_BLOCK rows of x for each time a run is read from memory.
 * Q8_0_X8: four rows at a time. The K formats: up to X4_CODES_ROWS rows decoding the
 * run's codes as they go, more (a prompt chunk, a larger decode step) from the codes
 * decoded once into a buffer on the stack. BF16_X16: bfloat16 rows, eight at a time
 * against two runs (bf16_runs.c). Float x through each run unpacked on the stack. */
static void runs_rows_part(int64_t fmt, const float *x, int64_t kind,
                           const gguf_activations *a, int64_t m, int64_t k, const uint8_t *w,
                           int64_t n, float *y, int64_t y_stride) {
    const int64_t plain = runs_plain(fmt), per_run = run_rows(fmt);
    const int64_t run_bytes = runs_bytes(fmt, k);
#ifdef BF16_RUNS_KERNEL
    if (kind == GGUF_ACT_BF16 && fmt == BF16_X16) { /* a row's sums in column order */
        bf16_runs_rows_part((const uint16_t *)a->xr, 2 * k, m, k, (const uint16_t *)w, n, y,
                            y_stride);
        return;
    }
#endif
#ifdef __AVX2__
    if (kind == GGUF_ACT_Q8_0 && fmt == Q8_0_X8) {
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int64_t end = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
#pragma omp for schedule(static) nowait
            for (int64_t run = 0; run < n / 8; run++)
                for (int64_t r = r0; r < end; r += 4) {
                    const gguf_activations rows = rows_from(kind, a, r, k);
                    const int count = (int)(end - r < 4 ? end - r : 4);
                    const uint8_t *g = w + run * run_bytes;
                    float *out = y + r * y_stride + 8 * run;
                    switch (count) { /* each count its own loop: the sums stay in registers */
                    case 4: q8_0_x8_q8(4, rows.xq, rows.xd, k, g, out, y_stride); break;
                    case 3: q8_0_x8_q8(3, rows.xq, rows.xd, k, g, out, y_stride); break;
                    case 2: q8_0_x8_q8(2, rows.xq, rows.xd, k, g, out, y_stride); break;
                    default: q8_0_x8_q8(1, rows.xq, rows.xd, k, g, out, y_stride);
                    }
                }
        }
        return;
    }
    if (kind == GGUF_ACT_Q8_K) {
        const int decoded = m > X4_CODES_ROWS;
        const int64_t step = fmt == Q6_K_X4 && !decoded ? 2 : 4;
        uint8_t codes[X4_MAX_K / 256 * X4_CODES_BYTES];
        for (int64_t r0 = 0; r0 < m; r0 += ROW_BLOCK) {
            const int64_t end = r0 + ROW_BLOCK < m ? r0 + ROW_BLOCK : m;
#pragma omp for schedule(static) nowait
            for (int64_t run = 0; run < n / 4; run++) {
                const uint8_t *g = w + run * run_bytes;
                if (decoded && fmt == Q6_K_X4)
                    q6_k_x4_decode(g, k, codes);
                else if (decoded)
                    k_x4_decode(fmt == Q5_K_X4, g, k, codes);
                for (int64_t r = r0; r < end; r += step) {
                    const gguf_activations rows = rows_from(kind, a, r, k);
                    x4_q8k_rows(fmt, (int)(end - r < step ? end - r : step), &rows, k, g,
                                decoded ? codes : NULL, y + r * y_stride + 4 * run, y_stride);
                }
            }
        }
        return;
    }
#endif
    const int64_t row_bytes = k / BLOCK_VALUES[fmt] * BLOCK_BYTES[plain];
    uint8_t rows[UNPACKED_BYTES];
#pragma omp for schedule(static) nowait
    for (int64_t run = 0; run < n / per_run; run++)
        for (int first = 0; first < per_run; first += 4) {
            runs_unpack(plain, w + run * run_bytes, k, first, rows, row_bytes);
            for (int r = 0; r < 4; r++) {
                float sums[MAX_ROWS];
                one_row(x, kind, a, m, k, rows + r * row_bytes, plain, sums);
                for (int64_t i = 0; i < m; i++)
                    y[i * y_stride + per_run * run + first + r] = sums[i];
            }
        }
}
