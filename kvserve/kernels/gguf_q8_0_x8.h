/* Q8_0 rows eight at a time (format Q8_0_X8): kvserve's own layout of a GGUF Q8_0 tensor,
 * made once at load (gguf_repack_runs), so that four int8 activations, broadcast, meet
 * eight weight rows in one instruction and each weight row's sum stays in a lane of its
 * own: no horizontal sums, and one float multiply-add a block for eight rows. Included by
 * gguf_linear.c.
 *
 * A run of eight rows is k / 32 groups (X8_GROUP_BYTES), one a block of 32 values of each
 * of the rows r = 0..7:
 *   0   d[8]   the rows' float16 scales
 *   16  qs     for quad c = 0..7, values 4c..4c+3 of rows 0, 1, ..., 7: one 32-byte load
 * The same 272 bytes as the eight rows' blocks in the file; unpacking gives them back.
 *
 * Against x rounded per 32 values (llama.cpp's Q8_0 for activations), as row_q8_0_q8:
 * the signs moved onto x so that |w| is the unsigned operand of maddubs or VNNI's dpbusd
 * (pairs at most 2 x 128 x 127), each block's 32 products summed in integers, then one float multiply
 * by the row's and x's scales. */
#define X8_GROUP_BYTES 272

/* Eight rows of standard Q8_0 blocks, row_bytes apart, k values each, into the layout. */
static void q8_0_x8_pack(const uint8_t *rows, int64_t row_bytes, int64_t k, uint8_t *out) {
    for (int64_t b = 0; b < k / 32; b++, out += X8_GROUP_BYTES)
        for (int r = 0; r < 8; r++) {
            const uint8_t *block = rows + r * row_bytes + 34 * b;
            memcpy(out + 2 * r, block, 2);
            for (int c = 0; c < 8; c++) memcpy(out + 16 + 32 * c + 4 * r, block + 2 + 4 * c, 4);
        }
}

/* Rows first..first + count - 1 of a run back into standard rows, row_bytes apart. */
static void q8_0_x8_unpack(const uint8_t *g, int64_t k, int first, int count, uint8_t *rows,
                           int64_t row_bytes) {
    for (int64_t b = 0; b < k / 32; b++, g += X8_GROUP_BYTES)
        for (int r = first; r < first + count; r++) {
            uint8_t *block = rows + (r - first) * row_bytes + 34 * b;
            memcpy(block, g + 2 * r, 2);
            for (int c = 0; c < 8; c++) memcpy(block + 2 + 4 * c, g + 16 + 32 * c + 4 * r, 4);
        }
}

#ifdef __AVX2__
/* The eight rows of a run against `rows` x rows (1-4; k int8 values each at xq + r * k,
 * scales at xd + r * (k / 32)): out[r * out_stride + 0..7]. Each x row's sums are those
 * it gets alone. */
static inline __attribute__((always_inline)) void q8_0_x8_q8(
    int rows, const int8_t *xq, const float *xd, int64_t k, const uint8_t *g, float *out,
    int64_t out_stride) {
    const int64_t nb = k / 32;
    __m256 acc[4];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, g += X8_GROUP_BYTES) {
        for (int line = 0; line < X8_GROUP_BYTES; line += 64)
            _mm_prefetch((const char *)(g + PREFETCH_BYTES + line), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        __m256i isum[4];
        for (int r = 0; r < rows; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * c));
            const __m256i w_abs = _mm256_sign_epi8(w, w);
            for (int r = 0; r < rows; r++) {
                int32_t quad;
                memcpy(&quad, xq + r * k + 32 * b + 4 * c, 4);
                const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(quad), w);
                isum[r] = dot_u8s8_add(isum[r], w_abs, x);
            }
        }
        for (int r = 0; r < rows; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]),
                                     _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b])), acc[r]);
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(out + r * out_stride, acc[r]);
}
#endif
