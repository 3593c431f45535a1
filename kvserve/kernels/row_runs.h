/* Runs of rows, the layout the few-row kernels read (int8_runs.c, bf16_runs.c): a
 * weight's rows taken run_rows at a time (the last run repeats the last row); within a
 * run, for each group of group_bytes bytes of a row, the run's rows' groups one after the
 * other, so one vector load holds the same columns of every row of the run. */
#ifndef KVSERVE_ROW_RUNS_H
#define KVSERVE_ROW_RUNS_H
#include <stdint.h>
#include <string.h>

static void pack_row_runs(const uint8_t *w, int64_t n, int64_t row_bytes, int run_rows,
                          int group_bytes, uint8_t *runs) {
    const int64_t num_runs = (n + run_rows - 1) / run_rows;
#pragma omp parallel for schedule(static)
    for (int64_t run = 0; run < num_runs; run++) {
        uint8_t *dst = runs + run * run_rows * row_bytes;
        for (int i = 0; i < run_rows; i++) {
            const int64_t row = run * run_rows + i < n ? run * run_rows + i : n - 1;
            const uint8_t *src = w + row * row_bytes;
            for (int64_t c = 0; c < row_bytes; c += group_bytes)
                memcpy(dst + c * run_rows + group_bytes * i, src + c, group_bytes);
        }
    }
}
#endif
