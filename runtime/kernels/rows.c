#include "kernels.h"

/* ---- small row-wise operations of the decode step ------------------------------------------ */
/* Each costs one call instead of the four to six torch operations it replaces; rows are short
 * (a few thousand floats), so they run on the calling thread. */

static inline TARGET void rmsnorm_row(const float *r, int K, const float *w, float eps, float *o) {
    __m512 ss = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) { __m512 v = _mm512_loadu_ps(r + k); ss = _mm512_fmadd_ps(v, v, ss); }
    const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / K + eps));
    for (int k = 0; k < K; k += 16)
        _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(r + k), inv), _mm512_loadu_ps(w + k)));
}

/* out[m] = x[m] / sqrt(mean(x[m]^2) + eps) * w, for M rows of K floats (K a multiple of 16). */
TARGET int llmd_rmsnorm(const float *x, int M, int K, const float *w, float eps, float *out) {
    if (!llmd_cpu_ok() || K % 16) return -1;
    for (int m = 0; m < M; m++) rmsnorm_row(x + (size_t)m * K, K, w, eps, out + (size_t)m * K);
    return 0;
}

/* The residual step of a decoder layer: sum[m] = x[m] + h[m], out[m] = rmsnorm(sum[m]) (as above):
 * one call instead of an add and a norm. */
TARGET int llmd_add_rmsnorm(const float *x, const float *h, int M, int K, const float *w, float eps, float *sum,
                            float *out) {
    if (!llmd_cpu_ok() || K % 16) return -1;
    for (int m = 0; m < M; m++) {
        const size_t at = (size_t)m * K;
        for (int k = 0; k < K; k += 16)
            _mm512_storeu_ps(sum + at + k, _mm512_add_ps(_mm512_loadu_ps(x + at + k), _mm512_loadu_ps(h + at + k)));
        rmsnorm_row(sum + at, K, w, eps, out + at);
    }
    return 0;
}

/* out[m, i] = silu(gu[m, i]) * gu[m, I + i]: the gated MLP's activation, for M rows of 2I floats. */
TARGET int llmd_silu_mul(const float *gu, int M, int I, float *out) {
    if (!llmd_cpu_ok()) return -1;
    const __m512 one = _mm512_set1_ps(1.f);
    for (int m = 0; m < M; m++) {
        const float *g = gu + (size_t)m * 2 * I, *u = g + I;
        float *o = out + (size_t)m * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) {
            __m512 gv = _mm512_loadu_ps(g + i);
            __m512 sg = _mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(sg, _mm512_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    return 0;
}

/* Rotary embedding on adjacent pairs (2i, 2i+1) of each q and k head, from packed qkv rows
 * [T, (H + 2 KVH) D], into contiguous q [T, H, D] and k [T, KVH, D]; cos/sin tables [P, D/2]. */
TARGET int llmd_rope_qk(const float *qkv, int T, int H, int KVH, int D, const float *cos_t, const float *sin_t,
                        int P, const int64_t *pos, float *q, float *k) {
    if (!llmd_cpu_ok() || D % 2) return -1;
    for (int t = 0; t < T; t++)             /* a position past the P-row tables: the caller's lookup raises */
        if (pos[t] < 0 || pos[t] >= P) return -1;
    const int width = (H + 2 * KVH) * D;
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (size_t)pos[t] * (D / 2), *s = sin_t + (size_t)pos[t] * (D / 2);
        for (int h = 0; h < H + KVH; h++) {
            const float *x = qkv + (size_t)t * width + (size_t)h * D;
            float *o = h < H ? q + ((size_t)t * H + h) * D : k + ((size_t)t * KVH + h - H) * D;
            for (int i = 0; i < D / 2; i++) {
                const float a = x[2 * i], b = x[2 * i + 1];
                o[2 * i] = a * c[i] - b * s[i];
                o[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
    }
    return 0;
}

/* out[m] = the index of the first largest value of row m of x [M, V]: greedy decoding's choice.
 * torch's argmax walked the row one element at a time (about 8 ns per float here: 0.1 ms for 16
 * rows of 8k, 1.7 ms for 16 rows of 152k). Returns 1 when a row holds NaN (torch's argmax picks the
 * NaN; the caller leaves that to torch). Rows are split across nt threads. */
TARGET int llmd_argmax(const float *x, int M, int V, int64_t *out, int nt) {
    if (!llmd_cpu_ok()) return -1;
    int nan = 0;
    #pragma omp parallel for num_threads(nt) schedule(static) reduction(|:nan)
    for (int m = 0; m < M; m++) {
        float best;
        if (row_first_max(x + (size_t)m * V, V, out + m, &best, NULL)) nan = 1;
    }
    return nan;
}
