/* The runs of four rows (Q4_K_X4, Q5_K_X4, Q6_K_X4: gguf_k_x4.h, gguf_q6_k_x4.h) as a
 * layer's weight: the file's rows into runs and back, and the products of a step's rows
 * against them. Included by gguf_linear.c (after one_row and rows_from). */

/* The file's format of a runs-of-four-rows format */
static inline int64_t runs_plain(int64_t fmt) {
    return fmt == Q4_K_X4 ? Q4_K : fmt == Q5_K_X4 ? Q5_K : Q6_K;
}

/* Four rows of the file's format plain (Q4_K, Q5_K or Q6_K), row_bytes apart, into one
 * run of its runs-of-four-rows layout; and back. */
static void runs_pack(int64_t plain, const uint8_t *rows, int64_t row_bytes, int64_t k,
                      uint8_t *out) {
    if (plain == Q6_K)
        q6_k_x4_pack(rows, row_bytes, k, out);
    else
        k_x4_pack(plain == Q5_K, rows, row_bytes, k, out);
}

static void runs_unpack(int64_t plain, const uint8_t *run, int64_t k, uint8_t *rows,
                        int64_t row_bytes) {
    if (plain == Q6_K)
        q6_k_x4_unpack(run, k, rows, row_bytes);
    else
        k_x4_unpack(plain == Q5_K, run, k, rows, row_bytes);
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
    const int16_t *bs = a->bsums;
#define K_X4(five, r) (codes ? k_x4_q8k(five, r, xq, xd, bs, k, g, codes, out, out_stride) \
                             : k_x4_q8k(five, r, xq, xd, bs, k, g, NULL, out, out_stride))
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

/* The runs of four rows (fmt Q4_K_X4, Q5_K_X4 or Q6_K_X4): Q8_K rows in registers (AVX2),
 * a few x rows at a time against each run: up to X4_CODES_ROWS rows decoding the run's
 * codes as they go, more (a prompt chunk, a larger decode step) from the codes decoded
 * once per ROW_BLOCK rows into a buffer on the stack (the run read from memory once for
 * them); float x through each run unpacked on the stack. */
static void k_x4_rows_part(int64_t fmt, const float *x, int64_t kind,
                           const gguf_activations *a, int64_t m, int64_t k, const uint8_t *w,
                           int64_t n, float *y, int64_t y_stride) {
    const int64_t plain = runs_plain(fmt);
    const int64_t run_bytes = 4 * (k / 256) * BLOCK_BYTES[fmt];
#ifdef __AVX2__
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
    const int64_t row_bytes = k / 256 * BLOCK_BYTES[plain];
    uint8_t rows[4 * X4_MAX_K / 256 * 210];
#pragma omp for schedule(static) nowait
    for (int64_t run = 0; run < n / 4; run++) {
        runs_unpack(plain, w + run * run_bytes, k, rows, row_bytes);
        for (int r = 0; r < 4; r++) {
            float sums[MAX_ROWS];
            one_row(x, kind, a, m, k, rows + r * row_bytes, plain, sums);
            for (int64_t i = 0; i < m; i++) y[i * y_stride + 4 * run + r] = sums[i];
        }
    }
}
