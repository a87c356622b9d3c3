/* Float32 products of up to 16 rows over weights stored in blocks of 64 output columns. */
#include "kernels.h"

/* ---- float32 weights in blocks of 64 output columns ------------------------------------- */
/* The weight is stored as [N/64, K, 64]: block b holds W[k, 64b:64b+64] for every k, one after
 * another, so each thread streams whole blocks front to back. y[m, block] = sum_k x[m,k] W[k, block]:
 * x broadcast, one FMA per 16 weights, no reductions. N a multiple of 64. */

static inline TARGET __attribute__((always_inline))
void f32_block(const float *x, const int MM, int K, const float *w, const float *bias, float *y, int N,
               const float *next, int part, int parts) {
    __m512 acc[MAXM][4];
    for (int m = 0; m < MAXM; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *wr = w + (size_t)k * 64;
        /* the next block's row k, fetched into L2 by one of this block's row groups, so memory
         * keeps streaming while the later groups compute from cache */
        if (next && k % parts == part)
            for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(next + (size_t)k * 64 + 16 * j), _MM_HINT_T1);
        __m512 wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm512_loadu_ps(wr + 16 * j);
        for (int m = 0; m < MM; m++) {
            __m512 xb = _mm512_set1_ps(x[(size_t)m * K + k]);
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(xb, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < MM; m++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(y + (size_t)m * N + 16 * j, acc[m][j]);
}

#define F32_CASE(MM) f32_block(x + (size_t)m0 * K, MM, K, w + (size_t)b * K * 64, bias ? bias + 64 * b : 0, \
                            y + (size_t)m0 * N + 64 * b, N, next, m0 / 4, groups);

/* Up to F32_MAXM rows: groups of four rows per block, so a block is read from memory once and
 * from cache for the later groups (verification of a few proposals, small batches). */
#define F32_MAXM 16

TARGET int llmd_f32(const float *x, int M, int K, const float *w, const float *bias, float *y, int N, int nt) {
    if (!llmd_cpu_ok() || M < 1 || M > F32_MAXM || N % 64) return -1;
    const int groups = (M + 3) / 4, nb = N / 64;
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int b = 0; b < nb; b++) {
        /* with several row groups a block is computed more than once from cache: the groups fetch
         * the thread's next block meanwhile (static schedule: a thread's blocks are consecutive) */
        const float *next = groups > 1 && b + 1 < nb ? w + (size_t)(b + 1) * K * 64 : 0;
        for (int m0 = 0; m0 < M; m0 += 4) {
            switch (M - m0) {
            case 1: F32_CASE(1) break;
            case 2: F32_CASE(2) break;
            case 3: F32_CASE(3) break;
            default: F32_CASE(4) break;
            }
        }
    }
    return 0;
}
