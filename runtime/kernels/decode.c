/* Every decoder layer of a decode step in one call, over float32, bfloat16-block, or packed int8, int4
 * (float32 or float16 scales) or int8g weights (llmd_product's kinds): the same kernels, in the same order and
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

/* float32 -> bfloat16 as torch (2.13, the pinned version) converts it: to nearest, ties to even; every
 * NaN -> 0xFFFF. */
static void to_bf16(const float *x, uint16_t *out, int n) {
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        out[i] = x[i] != x[i] ? 0xFFFF : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
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

/* y [M, N] = x [M, K] times one weight, by its kind; a quantized product's bias is added after it, as
 * the layer-by-layer forward adds it (llmd.runtime.formats.quantized), and a block product's inside
 * (f32.c), as llmd.runtime.kernels.ops passes it. 0, -1 (a kind or shape refused), -2 (no memory). */
static int product(const float *x, int M, int K, const llmd_product *p, float *y, int N, int nt) {
    const int threads = product_threads(M, N, K, nt);
    int rc;
    switch (p->kind) {
    case LLMD_KIND_F32: return llmd_f32(x, M, K, p->w, p->bias, y, N, threads);
    case LLMD_KIND_BF16: return llmd_f32_w16(x, M, K, p->w, p->bias, y, N, threads);
    case LLMD_KIND_Q8: rc = llmd_q8_x(x, M, K, 0, p->w, y, N, threads); break;
    case LLMD_KIND_Q8G: rc = llmd_q8_x(x, M, K, p->group, p->w, y, N, threads); break;
    case LLMD_KIND_Q4: rc = llmd_q4_x(x, M, K, p->group, p->w, y, N, product_threads(M, N, K / 2, nt)); break;
    case LLMD_KIND_Q4H: rc = llmd_q4h_x(x, M, K, p->group, p->w, y, N, product_threads(M, N, K / 2, nt)); break;
    case LLMD_KIND_GG: rc = llmd_gg_x(x, M, K, p->w, p->group, y, N, product_threads(M, N, K / 2, nt)); break;
    default: return -1;
    }
    if (!rc && p->bias)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) y[(size_t)m * N + n] += p->bias[n];
    return rc;
}

/* Each layer's products, in this order (llmd_decode's products[4 l + i]). */
enum { P_QKV, P_O, P_GU, P_DOWN, P_PER_LAYER };

/* The model's part of a step: its weights and tables. */
typedef struct {
    const llmd_dims *dims;
    const float *const *norms;          /* [2 L]: input, post-attention */
    const llmd_product *products;       /* [4 L] */
    const float *final_norm, *cos_t, *sin_t;
    float eps;
    void *k_pool, *v_pool;
    float *work;          /* T ((H + 2 KVH) D + 2 H D + KVH D + 3 I + hidden) floats */
    int nt;
} Model;

/* Every layer and the final norm over T rows: x [T, hidden] in (overwritten: the residual stream),
 * out [T, hidden] the final normed hidden states. */
static int layers(const Model *m, int T, float *x, float *out, const int64_t *pos, const int64_t *slots,
                  const int32_t *rows, const int32_t *spans, const int32_t *lengths, const int32_t *table) {
    const llmd_dims *dims = m->dims;
    const int L = dims->layers, E = dims->hidden, H = dims->heads, KVH = dims->kv_heads, D = dims->head_dim;
    const int I = dims->intermediate, P = dims->rope_rows, table_width = dims->table_width;
    const int bs = dims->block_size, es = dims->pool_bytes, nt = m->nt;
    const float eps = m->eps;
    if (!llmd_cpu_ok() || T < 1 || T > LLMD_FUSED_ROWS || (es != 4 && es != 2)) return -1;
    const int F = (H + 2 * KVH) * D;                       /* qkv width */
    float *qkv = m->work, *q = qkv + (size_t)T * F, *k = q + (size_t)T * H * D, *att = k + (size_t)T * KVH * D;
    float *gu = att + (size_t)T * H * D, *act = gu + (size_t)T * 2 * I, *h = act + (size_t)T * I;
    float *mlp = out;                                      /* the last layer's MLP output, then the result */
    const size_t layer_bytes = (size_t)dims->pool_slots * KVH * D * es;
    for (int t = 0; t < T; t++)              /* every slot in the pool before anything is written */
        if (slots[t] < 0 || slots[t] >= dims->pool_slots) return -1;
    int rc = 0;
    for (int l = 0; l < L && !rc; l++) {
        const llmd_product *lp = m->products + (size_t)l * P_PER_LAYER;
        const float *in_norm = m->norms[2 * l], *post_norm = m->norms[2 * l + 1];
        rc = l == 0 ? llmd_rmsnorm(x, T, E, in_norm, eps, h) : llmd_add_rmsnorm(x, mlp, T, E, in_norm, eps, x, h);
        if (!rc) rc = product(h, T, E, lp + P_QKV, qkv, F, nt);
        if (!rc) rc = llmd_rope_qk(qkv, T, H, KVH, D, m->cos_t, m->sin_t, P, pos, q, k);
        if (rc) break;
        char *kp = (char *)m->k_pool + l * layer_bytes, *vp = (char *)m->v_pool + l * layer_bytes;
        write_kv(kp, vp, slots, T, k, qkv + (H + KVH) * D, F, KVH * D, es);
        rc = es == 4 ? llmd_attend(q, (float *)kp, (float *)vp, rows, spans, lengths, T, table, table_width, bs, H,
                                   KVH, D, att, nt)
                     : llmd_attend_bf16(q, (uint16_t *)kp, (uint16_t *)vp, rows, spans, lengths, T, table,
                                        table_width, bs, H, KVH, D, att, nt);
        if (!rc) rc = product(att, T, H * D, lp + P_O, h, E, nt);
        if (!rc) rc = llmd_add_rmsnorm(x, h, T, E, post_norm, eps, x, h);
        if (!rc) rc = product(h, T, E, lp + P_GU, gu, 2 * I, nt);
        if (!rc) rc = llmd_silu_mul(gu, T, I, act);
        if (!rc) rc = product(act, T, I, lp + P_DOWN, mlp, E, nt);
    }
    if (!rc) rc = llmd_add_rmsnorm(x, mlp, T, E, m->final_norm, eps, x, out);
    return rc;
}

int llmd_fused_rows(void) { return LLMD_FUSED_ROWS; }
int llmd_draft_rows(void) { return LLMD_DRAFT_ROWS; }

/* One step of T packed rows (dims->rows) whose attention metadata the caller built. Returns 0, -1 (a
 * kernel refused the shape: a position past the rotary tables, a slot outside the pool), or -2
 * (attention could not allocate). */
TARGET int llmd_decode(const llmd_dims *dims, float *x, float *out, const float *const *norms,
                       const llmd_product *products, const float *final_norm, float eps, const float *cos_t,
                       const float *sin_t, const int64_t *pos, void *k_pool, void *v_pool, const int64_t *slots,
                       const int32_t *rows, const int32_t *spans, const int32_t *lengths, const int32_t *table,
                       float *work, int nt) {
    const Model m = {dims, norms, products, final_norm, cos_t, sin_t, eps, k_pool, v_pool, work, nt};
    return layers(&m, dims->rows, x, out, pos, slots, rows, spans, lengths, table);
}

/* Row id of a token table (E columns) as float32, as the layer-by-layer forward looks it up: float32
 * rows; a tied head's blocks (block id / 64, column id % 64; bfloat16 widened exactly); int8 rows
 * times their scale, or their group's (one product, as torch's dequantization rounds it). */
static void embed_row(const llmd_product *t, int64_t id, int E, float *xr) {
    const size_t row = (size_t)id * E;
    switch (t->kind) {
    case LLMD_KIND_ROWS: memcpy(xr, (const float *)t->w + row, sizeof(float) * E); break;
    case LLMD_KIND_F32:
    case LLMD_KIND_BF16: block_column(t->w, t->kind == LLMD_KIND_BF16, E, id, xr, 1); break;
    case LLMD_KIND_INT8:
        for (int e = 0; e < E; e++) xr[e] = (float)((const int8_t *)t->w)[row + e] * t->scales[id];
        break;
    case LLMD_KIND_INT8G:
        for (int e = 0; e < E; e++)
            xr[e] = (float)((const int8_t *)t->w)[row + e] * t->scales[(size_t)id * (E / t->group) + e / t->group];
        break;
    case LLMD_KIND_GG: {
        const llmd_gg_part *part = t->w;
        llmd_gg_rows(part->data, part->type, E, &id, 1, xr);
        break;
    }
    }
}

/* Greedy proposals of a draft model, `steps` forwards in one call: each of the T requests first feeds
 * count[t] >= 1 tokens (the ones the draft has not seen: its catch-up) at positions pos0[t].., and
 * takes the first largest logit of the last as its next token; later forwards feed that token at
 * the next position. This is the Python loop of llmd.runtime.spec.draft, one forward at a time
 * there: the same kernels, so the same tokens and KV.
 *   ids [sum count]: the tokens fed first, request after request; table [T, dims->table_width]: each
 *   request's block ids, covering its last position; out [T, steps]: the tokens taken.
 *   head: the output head (no bias); embed: the token table (embed_row's kinds).
 *   x, hidden [LLMD_DRAFT_ROWS, hidden] and logits [T, V]: scratch. dims->rows is T.
 * Returns the steps completed: all, or fewer where a position falls outside the block table or the
 * rotary tables, a token is outside the vocabulary, or a row's logits hold NaN (the caller's own
 * loop goes on from there); or -1 (more than LLMD_DRAFT_ROWS rows, a table kind it does not read) or -2 (no
 * memory). */
TARGET int llmd_draft(const llmd_dims *dims, const float *const *norms, const llmd_product *products,
                      const float *final_norm, float eps, const float *cos_t, const float *sin_t, void *k_pool,
                      void *v_pool, const int32_t *table, const llmd_product *head, const llmd_product *embed,
                      const int64_t *ids, const int32_t *count, const int64_t *pos0, int steps, int64_t *out,
                      float *x, float *hidden, float *logits, float *work, int nt) {
    const int T = dims->rows, E = dims->hidden, V = dims->vocab, tw = dims->table_width, bs = dims->block_size;
    const int k = embed->kind;
    if (!llmd_cpu_ok() || T < 1 || T > LLMD_DRAFT_ROWS || E % 16 || head->bias || head->kind == LLMD_KIND_ROWS)
        return -1;
    if ((head->kind == LLMD_KIND_F32 || head->kind == LLMD_KIND_BF16) && V % 64) return -1;
    if (k != LLMD_KIND_ROWS && k != LLMD_KIND_F32 && k != LLMD_KIND_BF16 && k != LLMD_KIND_INT8
        && !(k == LLMD_KIND_INT8G && embed->group > 0 && E % embed->group == 0)
        && !(k == LLMD_KIND_GG && embed->group == 1 && !((const llmd_gg_part *)embed->w)->order))
        return -1;
    const Model m = {dims, norms, products, final_norm, cos_t, sin_t, eps, k_pool, v_pool, work, nt};
    int64_t tok[LLMD_DRAFT_ROWS], pos[LLMD_DRAFT_ROWS], slots[LLMD_DRAFT_ROWS], next[LLMD_DRAFT_ROWS];
    int64_t start[LLMD_DRAFT_ROWS];
    int32_t rows[LLMD_DRAFT_ROWS], spans[LLMD_DRAFT_ROWS], lengths[LLMD_DRAFT_ROWS], last[LLMD_DRAFT_ROWS];
    int R = 0;
    for (int t = 0; t < T; t++) {
        if (count[t] < 1 || R + count[t] > LLMD_DRAFT_ROWS) return -1;
        R += count[t];
    }
    for (int s = 0; s < steps; s++) {
        int r = 0;                                  /* the rows of this forward: count[t] each, then one */
        for (int t = 0; t < T; t++) {
            const int n = s == 0 ? count[t] : 1;
            start[t] = s == 0 ? pos0[t] : pos0[t] + count[t] + s - 1;
            for (int j = 0; j < n; j++, r++) {
                const int64_t p = start[t] + j, id = s == 0 ? ids[r] : tok[t];
                if (p < 0 || p / bs >= tw || p >= dims->rope_rows || id < 0 || id >= V) return s;
                pos[r] = p;
                slots[r] = (int64_t)table[(size_t)t * tw + p / bs] * bs + p % bs;
                rows[r] = r;
                spans[r] = t;
                lengths[r] = (int32_t)(p + 1);
                embed_row(embed, id, E, x + (size_t)r * E);
            }
            last[t] = r - 1;
        }
        int rc = layers(&m, r, x, hidden, pos, slots, rows, spans, lengths, table);
        if (rc == -2) return -2;
        if (rc) return s;
        for (int t = 0; t < T; t++)                 /* each request's last row, in request order */
            if (last[t] != t) memcpy(hidden + (size_t)t * E, hidden + (size_t)last[t] * E, sizeof(float) * E);
        rc = product(hidden, T, E, head, logits, V, nt);
        if (rc == -2) return -2;
        if (rc) return s;
        if (llmd_argmax(logits, T, V, next, (long)T * V >= (1L << 18) ? nt : 1)) return s;    /* NaN */
        for (int t = 0; t < T; t++) out[(size_t)t * steps + s] = tok[t] = next[t];
    }
    return steps;
}
