#include "kernels.h"

/* ---- attention of query rows over the paged KV pool ---------------------------------------- */
/* Query row r (row[r] of q [T, H, D]) attends to the first len[r] positions of its request,
 * whose keys/values live at slot table[span[r]][l / bs] * bs + l % bs of the pools [S, KVH, D]
 * (float32, or bfloat16: the same arithmetic over half the bytes, for a step that reads many streams'
 * keys and values from memory). Row r's blocks are read from table + span[r] * table_width on, as many
 * as its length needs: a table of width 1 with bs 1 is a flat list of slots, span[r] the first of row
 * r's, which is how a sliding layer's rows see their window only.
 * Softmax(q k / sqrt(D)) v per head in float32, heads sharing a key/value head read it once.
 * Threads take whole rows when there are enough, else (row, kv head) pairs. Decode and verification
 * rows, and prompt chunks' rows alike, so a row's numbers do not depend on how its request was cut. */

/* Sixteen pool values from element i of a float32 (es == 4) or bfloat16 (es == 2) pool, as float32:
 * a bfloat16 is the top half of a float32's bits. */
static inline TARGET __attribute__((always_inline)) __m512 load16(const void *pool, size_t i, const int es) {
    if (es == 4) return _mm512_loadu_ps((const float *)pool + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)pool + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The value sums of NG query heads that share kv head kvh, over positions l0..l1: acc[g] += p[g][l] v[l]
 * (p at stride Lp, acc at stride D). Each value vector is loaded once for all NG heads, and the NG * 4
 * sums are independent chains where one head's four would wait on each other; each head's sum still
 * runs over the positions in order, so its numbers are those of one head at a time. */
#define VALUE_HEADS 4
static inline TARGET __attribute__((always_inline))
void value_heads(const void *vpool, const size_t *slot, int KVH, int kvh, int D, int l0, int l1, const float *p, int Lp,
                 float *acc, const int NG, const int es) {
    for (int d0 = 0; d0 < D / 16; d0 += 4) {                /* four vectors of the head at a time */
        const int nd = D / 16 - d0 < 4 ? D / 16 - d0 : 4;
        __m512 a[VALUE_HEADS][4];
        for (int g = 0; g < NG; g++)
            for (int d = 0; d < nd; d++) a[g][d] = _mm512_loadu_ps(acc + (size_t)g * D + 16 * (d0 + d));
        for (int l = l0; l < l1; l++) {
            const size_t v = (slot[l] * KVH + kvh) * D + 16 * (size_t)d0;
            for (int d = 0; d < nd; d++) {
                const __m512 vv = load16(vpool, v + 16 * d, es);
                for (int g = 0; g < NG; g++)
                    a[g][d] = _mm512_fmadd_ps(_mm512_set1_ps(p[(size_t)g * Lp + l]), vv, a[g][d]);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int d = 0; d < nd; d++) _mm512_storeu_ps(acc + (size_t)g * D + 16 * (d0 + d), a[g][d]);
    }
}

/* One work item of ``attend``: query row r's heads of kv heads h0..h1 (0, or -1 out of memory). D and es
 * are constants where it is called (the common head sizes, each pool type): the dot products and
 * value sums then unroll whole, with no test of the size or the type per vector. */
static inline TARGET __attribute__((always_inline))
int attend_item(const float *q, const void *kpool, const void *vpool, const int32_t *row, const int32_t *span,
                const int32_t *len, int r, int h0, int h1, const int32_t *table, int table_width, int bs, int H,
                int KVH, float *out, const int D, const int es) {
    const int G = H / KVH, L = len[r];
    const float scale = 1.f / sqrtf((float)D);
    const int NQ = (h1 - h0) * G;                         /* query heads of this item */
    const int Lp = (L + 15) & ~15;                        /* scores padded to whole vectors */
    const size_t span_bytes = (size_t)(h1 - h0) * D * es; /* one slot's bytes for these heads */
    const int32_t *blocks = table + (size_t)span[r] * table_width;
    /* per query head: Lp scores, D output sums, its running max and sum; then the slots */
    float *p = (float *)malloc(sizeof(float) * (size_t)NQ * (Lp + D + 16) + sizeof(size_t) * (size_t)Lp);
    if (!p) return -1;
    float *acc = p + (size_t)NQ * Lp, *mx = acc + (size_t)NQ * D;
    size_t *slot = (size_t *)(mx + (size_t)NQ * 16);
    for (int l = 0, b = 0, o = 0; l < Lp; l++) {          /* padding repeats the last position */
        slot[l] = (size_t)blocks[b] * bs + o;
        if (l + 1 < L && ++o == bs) { o = 0; b++; }
    }
    for (int i = 0; i < NQ; i++) _mm512_storeu_ps(mx + 16 * i, _mm512_set1_ps(-INFINITY));
    for (int l = 0; l < Lp; l += 16) {                      /* scores, sixteen positions at a time */
        for (int kvh = h0; kvh < h1; kvh++)
        for (int g = 0; g < G; g++) {
            const int i = (kvh - h0) * G + g;
            if (l + 16 < Lp)          /* the next sixteen slots, shared out over the heads */
                for (int j = i * 16 / NQ; j < (i + 1) * 16 / NQ; j++) {
                    const size_t at = (slot[l + 16 + j] * KVH + h0) * D * es;
                    for (size_t c = 0; c < span_bytes; c += 64) {
                        _mm_prefetch((const char *)kpool + at + c, _MM_HINT_T1);
                        _mm_prefetch((const char *)vpool + at + c, _MM_HINT_T1);
                    }
                }
            const float *qh = q + ((size_t)row[r] * H + (size_t)kvh * G + g) * D;
            __m512 qv[16];
            for (int d = 0; d < D / 16; d++) qv[d] = _mm512_mul_ps(_mm512_loadu_ps(qh + 16 * d), _mm512_set1_ps(scale));
            __m512 dots[16];
            for (int j = 0; j < 16; j++) {
                const size_t k = (slot[l + j] * KVH + kvh) * D;
                __m512 a = _mm512_mul_ps(qv[0], load16(kpool, k, es));
                for (int d = 1; d < D / 16; d++) a = _mm512_fmadd_ps(qv[d], load16(kpool, k + 16 * d, es), a);
                dots[j] = a;
            }
            __m512 sc = sum16x16(dots);
            if (l + 16 > L) sc = _mm512_mask_blend_ps((__mmask16)((1u << (L - l)) - 1), _mm512_set1_ps(-INFINITY), sc);
            _mm512_storeu_ps(p + (size_t)i * Lp + l, sc);
            _mm512_storeu_ps(mx + 16 * i, _mm512_max_ps(_mm512_loadu_ps(mx + 16 * i), sc));
        }
    }
    for (int i = 0; i < NQ; i++) {                          /* softmax weights, unnormalised */
        float *pi = p + (size_t)i * Lp;
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(mx + 16 * i)));
        __m512 sum = _mm512_setzero_ps();
        for (int l = 0; l < Lp; l += 16) {
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(pi + l), m));
            if (l + 16 > L) e = _mm512_maskz_mov_ps((__mmask16)((1u << (L - l)) - 1), e);
            _mm512_storeu_ps(pi + l, e);
            sum = _mm512_add_ps(sum, e);
        }
        mx[16 * i] = 1.f / _mm512_reduce_add_ps(sum);     /* the max is no longer needed */
        memset(acc + (size_t)i * D, 0, sizeof(float) * D);
    }
    for (int l0 = 0; l0 < L; l0 += 16) {                    /* values, sixteen positions at a time */
        const int l1 = l0 + 16 < L ? l0 + 16 : L;
        if (l1 < L)
            for (int l = l1; l < l1 + 16 && l < L; l++) {
                const char *nv = (const char *)vpool + (slot[l] * KVH + h0) * D * es;
                for (size_t c = 0; c < span_bytes; c += 64) _mm_prefetch(nv + c, _MM_HINT_T1);
            }
        for (int kvh = h0; kvh < h1; kvh++)
            for (int g = 0; g < G; g += VALUE_HEADS) {
                const int i = (kvh - h0) * G + g;
                const float *pi = p + (size_t)i * Lp;
                float *ai = acc + (size_t)i * D;
                switch (G - g < VALUE_HEADS ? G - g : VALUE_HEADS) {
                case 1: value_heads(vpool, slot, KVH, kvh, D, l0, l1, pi, Lp, ai, 1, es); break;
                case 2: value_heads(vpool, slot, KVH, kvh, D, l0, l1, pi, Lp, ai, 2, es); break;
                case 3: value_heads(vpool, slot, KVH, kvh, D, l0, l1, pi, Lp, ai, 3, es); break;
                default: value_heads(vpool, slot, KVH, kvh, D, l0, l1, pi, Lp, ai, 4, es); break;
                }
            }
    }
    for (int i = 0; i < NQ; i++) {                          /* query head h0 * G + i of the row */
        const __m512 inv = _mm512_set1_ps(mx[16 * i]);
        float *o = out + ((size_t)row[r] * H + (size_t)h0 * G + i) * D;
        for (int d = 0; d < D / 16; d++) _mm512_storeu_ps(o + 16 * d, _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)i * D + 16 * d), inv));
    }
    free(p);
    return 0;
}

/* es: bytes per pool value, 4 (float32) or 2 (bfloat16: half the bytes to read, the same float32
 * arithmetic). attend_item is inlined inside the parallel loop for each, and for head sizes 64 and 128.
 *
 * Memory order: a slot holds every kv head's key (or value) side by side, [KVH, D], and a block's
 * slots follow each other. Both passes walk the positions sixteen at a time and, within those, every
 * head the item owns, so each key and value is fetched from memory once, in address order; taking
 * one head at a time over all positions read each slot in KVH separate strided passes. The arithmetic
 * of each head is the same, in the same order, either way. */
static TARGET int attend(const float *q, const void *kpool, const void *vpool, const int32_t *row,
                         const int32_t *span, const int32_t *len, int R, const int32_t *table, int table_width, int bs,
                         int H, int KVH, int D, float *out, int nt, int es) {
    if (!llmd_cpu_ok() || D % 16 || D > 256 || H % KVH) return -1;
    int failed = 0;
    /* With rows enough to keep every thread busy, a thread takes whole rows; with a few rows (one
     * stream), the kv heads of a row are shared out instead. While the keys of sixteen positions are
     * scored, the keys and the values of the next sixteen are fetched into L2, so memory keeps
     * streaming under the arithmetic and the value pass mostly reads from cache. 16 streams of ~160
     * positions (tiny shape): 16-stream decode 1.15x fetching only the keys, one head at a time, with
     * the non-temporal hint, one stream unchanged, tokens identical (bench/bench_kernels.py). */
    const int whole_rows = R >= 2 * nt;
    const int items = whole_rows ? R : R * KVH;
    #pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int item = 0; item < items; item++) {
        const int r = whole_rows ? item : item / KVH;
        const int h0 = whole_rows ? 0 : item % KVH, h1 = whole_rows ? KVH : h0 + 1;
        int rc;
#define ATTEND_ITEM(DD, ES) \
        attend_item(q, kpool, vpool, row, span, len, r, h0, h1, table, table_width, bs, H, KVH, out, DD, ES)
        if (es == 4)
            rc = D == 64 ? ATTEND_ITEM(64, 4) : D == 128 ? ATTEND_ITEM(128, 4) : ATTEND_ITEM(D, 4);
        else
            rc = D == 64 ? ATTEND_ITEM(64, 2) : D == 128 ? ATTEND_ITEM(128, 2) : ATTEND_ITEM(D, 2);
#undef ATTEND_ITEM
        if (rc) failed = 1;
    }
    return failed ? -2 : 0;
}

TARGET int llmd_attend(const float *q, const float *kpool, const float *vpool, const int32_t *row, const int32_t *span,
                       const int32_t *len, int R, const int32_t *table, int table_width, int bs, int H, int KVH, int D,
                       float *out, int nt) {
    return attend(q, kpool, vpool, row, span, len, R, table, table_width, bs, H, KVH, D, out, nt, 4);
}

TARGET int llmd_attend_bf16(const float *q, const uint16_t *kpool, const uint16_t *vpool, const int32_t *row,
                            const int32_t *span, const int32_t *len, int R, const int32_t *table, int table_width,
                            int bs, int H, int KVH, int D, float *out, int nt) {
    return attend(q, kpool, vpool, row, span, len, R, table, table_width, bs, H, KVH, D, out, nt, 2);
}
