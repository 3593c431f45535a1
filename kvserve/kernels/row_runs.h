/* Runs of rows, the layout the few-row kernels read (int8_runs.c, bf16_runs.c): a
 * weight's rows taken run_rows at a time (the last run repeats the last row); within a
 * run, for each group of group_bytes bytes of a row, the run's rows' groups one after the
 * other, so one vector load holds the same columns of every row of the run. */
#ifndef KVSERVE_ROW_RUNS_H
#define KVSERVE_ROW_RUNS_H
#include <stdint.h>
#include <string.h>

/* bfloat16 runs have a kernel in this build (bf16_runs.c) */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define BF16_RUNS_KERNEL 1
#endif

/* One run from its first `rows` rows at w (row_bytes apart; fewer than run_rows: the
 * last repeated) into dst */
static void pack_row_run(const uint8_t *w, int64_t rows, int64_t row_bytes, int run_rows,
                         int group_bytes, uint8_t *dst) {
    for (int i = 0; i < run_rows; i++) {
        const uint8_t *src = w + (i < rows ? i : rows - 1) * row_bytes;
        for (int64_t c = 0; c < row_bytes; c += group_bytes)
            memcpy(dst + c * run_rows + group_bytes * i, src + c, group_bytes);
    }
}

static void pack_row_runs(const uint8_t *w, int64_t n, int64_t row_bytes, int run_rows,
                          int group_bytes, uint8_t *runs) {
    const int64_t num_runs = (n + run_rows - 1) / run_rows;
#pragma omp parallel for schedule(static)
    for (int64_t run = 0; run < num_runs; run++) {
        const int64_t first = run * run_rows;
        pack_row_run(w + first * row_bytes, n - first, row_bytes, run_rows, group_bytes,
                     runs + first * row_bytes);
    }
}
#endif
