/* Every decoder layer of a float32 decode step in one call: the same kernels, in the same order and
 * with the same thread counts, as the Python forward calls one by one (llmd.runtime.models.llama),
 * so the hidden states are bit-identical; what goes is the Python between them (about 0.4 ms a
 * step for four layers here, as much as the arithmetic of one small-model token).
 *
 * Per layer, for T packed rows (x the residual stream, h the normed input of the next product):
 *     h = rmsnorm(x)            (layer 0; later layers: x += mlp_out, h = rmsnorm(x))
 *     qkv = h Wqkv + b;  q, k = rope(qkv);  v = qkv's last KVH*D columns
 *     k_pool[slot], v_pool[slot] = k, v;   a = attention(q, pools)
 *     x += a Wo + b;  h = rmsnorm(x)
 *     mlp_out = silu_mul(h Wgu + b) Wdown + b
 * and after the last layer x += mlp_out, out = rmsnorm(x) with the final norm. */
#include "kernels.h"

int llmd_f32(const float *x, int M, int K, const float *w, const float *bias, float *y, int N, int nt);
int llmd_f32_w16(const float *x, int M, int K, const uint16_t *w, const float *bias, float *y, int N, int nt);
int llmd_rmsnorm(const float *x, int M, int K, const float *w, float eps, float *out);
int llmd_add_rmsnorm(const float *x, const float *h, int M, int K, const float *w, float eps, float *sum, float *out);
int llmd_silu_mul(const float *gu, int M, int I, float *out);
int llmd_rope_qk(const float *qkv, int T, int H, int KVH, int D, const float *cos_t, const float *sin_t, int P,
                 const int64_t *pos, float *q, float *k);
int llmd_attend(const float *q, const float *kpool, const float *vpool, const int32_t *row, const int32_t *span,
                const int32_t *len, int R, const int32_t *table, int table_width, int bs, int H, int KVH, int D,
                float *out, int nt);
int llmd_attend_bf16(const float *q, const uint16_t *kpool, const uint16_t *vpool, const int32_t *row,
                     const int32_t *span, const int32_t *len, int R, const int32_t *table, int table_width, int bs,
                     int H, int KVH, int D, float *out, int nt);

/* float32 -> bfloat16 as torch rounds it: to nearest, ties to even; NaN -> 0x7FC0. */
static void to_bf16(const float *x, uint16_t *out, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        out[i] = x[i] != x[i] ? 0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
}

/* A step's keys and values into slot slots[t] of one layer's pools: float32 (es 4) or bfloat16 (es 2). */
static void write_kv(void *kp, void *vp, const int64_t *slots, int T, const float *k, const float *v, int v_stride,
                     int width, int es) {
    for (int t = 0; t < T; t++) {
        const size_t at = (size_t)slots[t] * width;
        if (es == 4) {
            memcpy((float *)kp + at, k + (size_t)t * width, sizeof(float) * width);
            memcpy((float *)vp + at, v + (size_t)t * v_stride, sizeof(float) * width);
        } else {
            to_bf16(k + (size_t)t * width, (uint16_t *)kp + at, width);
            to_bf16(v + (size_t)t * v_stride, (uint16_t *)vp + at, width);
        }
    }
}

/* The threads of one product, as llmd.runtime.kernels.ops._threads picks them. */
static int product_threads(int m, int n, int k, int nt) { return (long)m * n * k < (1L << 18) ? 1 : nt; }

/* w: float32 blocks, or bfloat16 blocks where narrow (f32.c). */
static int product(const float *x, int M, int K, const void *w, int narrow, const float *bias, float *y, int N,
                   int nt) {
    const int threads = product_threads(M, N, K, nt);
    return narrow ? llmd_f32_w16(x, M, K, w, bias, y, N, threads) : llmd_f32(x, M, K, w, bias, y, N, threads);
}

/* Pointers per layer, in this order (a bias may be NULL); narrow[4 l + i] says whether layer l's
 * i-th product (qkv, o, gate_up, down) has bfloat16 blocks. */
enum { W_IN_NORM, W_QKV, B_QKV, W_O, B_O, W_POST_NORM, W_GU, B_GU, W_DOWN, B_DOWN, W_PER_LAYER };

/* dims: L, T, hidden, heads, kv heads, head size, intermediate, rope table rows P, pool slots per
 * layer S, attention table width, block size, bytes per pool value (4 float32, 2 bfloat16). x [T, hidden] is the embedded input and is
 * overwritten (the residual stream); out [T, hidden] receives the final normed hidden states.
 * work holds T * (2 (H + KVH) D + (H + 2 KVH) D + 3 I + hidden) floats. Returns 0, -1 (a kernel
 * refused the shape), or -2 (attention could not allocate). */
TARGET int llmd_decode(const int *dims, float *x, float *out, const void *const *w, const uint8_t *narrow,
                           const float *final_norm,
                           float eps, const float *cos_t, const float *sin_t, const int64_t *pos, void *k_pool,
                           void *v_pool, const int64_t *slots, const int32_t *rows, const int32_t *spans,
                           const int32_t *lengths, const int32_t *table, float *work, int nt) {
    const int L = dims[0], T = dims[1], E = dims[2], H = dims[3], KVH = dims[4], D = dims[5], I = dims[6];
    const int P = dims[7], table_width = dims[9], bs = dims[10];
    const long S = dims[8];
    const int es = dims[11];
    if (!llmd_cpu_ok() || T < 1 || T > 16 || (es != 4 && es != 2)) return -1;
    const int F = (H + 2 * KVH) * D;                       /* qkv width */
    float *qkv = work, *q = qkv + (size_t)T * F, *k = q + (size_t)T * H * D, *att = k + (size_t)T * KVH * D;
    float *gu = att + (size_t)T * H * D, *act = gu + (size_t)T * 2 * I, *h = act + (size_t)T * I;
    float *mlp = out;                                      /* the last layer's MLP output, then the result */
    int rc = 0;
    for (int l = 0; l < L && !rc; l++) {
        const void *const *lw = w + (size_t)l * W_PER_LAYER;
        const uint8_t *nw = narrow + 4 * l;
        rc = l == 0 ? llmd_rmsnorm(x, T, E, (const float *)lw[W_IN_NORM], eps, h)
                    : llmd_add_rmsnorm(x, mlp, T, E, (const float *)lw[W_IN_NORM], eps, x, h);
        if (!rc) rc = product(h, T, E, lw[W_QKV], nw[0], lw[B_QKV], qkv, F, nt);
        if (!rc) rc = llmd_rope_qk(qkv, T, H, KVH, D, cos_t, sin_t, P, pos, q, k);
        if (rc) break;
        const size_t layer_bytes = (size_t)S * KVH * D * es;
        char *kp = (char *)k_pool + l * layer_bytes, *vp = (char *)v_pool + l * layer_bytes;
        write_kv(kp, vp, slots, T, k, qkv + (H + KVH) * D, F, KVH * D, es);
        rc = es == 4 ? llmd_attend(q, (float *)kp, (float *)vp, rows, spans, lengths, T, table, table_width, bs, H,
                                   KVH, D, att, nt)
                     : llmd_attend_bf16(q, (uint16_t *)kp, (uint16_t *)vp, rows, spans, lengths, T, table,
                                        table_width, bs, H, KVH, D, att, nt);
        if (!rc) rc = product(att, T, H * D, lw[W_O], nw[1], lw[B_O], h, E, nt);
        if (!rc) rc = llmd_add_rmsnorm(x, h, T, E, (const float *)lw[W_POST_NORM], eps, x, h);
        if (!rc) rc = product(h, T, E, lw[W_GU], nw[2], lw[B_GU], gu, 2 * I, nt);
        if (!rc) rc = llmd_silu_mul(gu, T, I, act);
        if (!rc) rc = product(act, T, I, lw[W_DOWN], nw[3], lw[B_DOWN], mlp, E, nt);
    }
    if (!rc) rc = llmd_add_rmsnorm(x, mlp, T, E, final_norm, eps, x, out);
    return rc;
}
