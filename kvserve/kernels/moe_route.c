/* A mixture-of-experts router: each row's logits over the experts, their softmax, and
 * the top k. The eager SparseMoE and the captured step both route through these loops,
 * so the two choose the same experts with the same weights, bit for bit.
 *
 * logits[r, e] = x[r, :] . w[e, :] (float32, the router's [experts, hidden] weight), in
 * one fixed order of sums; then per row, as torch's softmax-topk-renormalise: the
 * probabilities exp(l - max) / sum (float32), the top_k largest (the lower expert first
 * on a tie), and with norm each divided by the sum of the k chosen (summed in the order
 * chosen). chosen [rows, top_k] int64 and weights [rows, top_k] float32, the largest
 * first. */
#include <math.h>
#include <stdint.h>
#include "step_parts.h"
#include "vec_math.h"

static float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.f;
#ifdef VEC_LANES
    vecf acc = vec_zero();
    for (; i + VEC_LANES <= n; i += VEC_LANES)
        acc = vec_fmadd(vec_load(a + i), vec_load(b + i), acc);
    s = vec_reduce_add(acc);
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void moe_logits_part(const float *x, int64_t rows, int64_t hidden, const float *w,
                     int64_t experts, float *logits) {
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < rows * experts; t++)
        logits[t] = dot(x + t / experts * hidden, w + t % experts * hidden, hidden);
}

void moe_pick_part(float *logits, int64_t rows, int64_t experts, int64_t top_k,
                   int64_t norm, int64_t *chosen, float *weights) {
#pragma omp for schedule(static) nowait
    for (int64_t r = 0; r < rows; r++) {
        float *p = logits + r * experts; /* the probabilities, in place */
        float top = p[0], sum = 0.f;
        for (int64_t e = 1; e < experts; e++) top = p[e] > top ? p[e] : top;
        for (int64_t e = 0; e < experts; e++) {
            p[e] = expf(p[e] - top);
            sum += p[e];
        }
        for (int64_t e = 0; e < experts; e++) p[e] = p[e] / sum;
        int64_t *c = chosen + r * top_k;
        float *wt = weights + r * top_k, picked = 0.f;
        for (int64_t j = 0; j < top_k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < experts; e++) {
                int taken = 0;
                for (int64_t i = 0; i < j; i++) taken |= c[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            c[j] = best;
            wt[j] = p[best];
            picked += p[best];
        }
        if (norm)
            for (int64_t j = 0; j < top_k; j++) wt[j] = wt[j] / picked;
    }
}

int64_t moe_route(const float *x, int64_t rows, int64_t hidden, const float *w,
                  int64_t experts, int64_t top_k, int64_t norm, float *logits,
                  int64_t *chosen, float *weights) {
    if (rows < 1 || top_k < 1 || top_k > experts) return -1;
#pragma omp parallel
    {
        moe_logits_part(x, rows, hidden, w, experts, logits);
#pragma omp barrier
        moe_pick_part(logits, rows, experts, top_k, norm, chosen, weights);
    }
    return 0;
}
