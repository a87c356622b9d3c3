/* Shared by llmd's CPU kernels (quant.c, f32.c, attention.c, rows.c): built together into one
 * library by llmd.runtime.kernels, x86-64 with AVX-512 (VNNI), or with LLMD_AVX2 defined a second
 * library of the same code for CPUs with AVX2, FMA and F16C (avx2.h). Each file's entry points return 0,
 * or -1 when the CPU or the shape is not one they take (the caller then uses torch's kernels). */
#ifndef LLMD_KERNELS_H
#define LLMD_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef LLMD_AVX2
#include "avx2.h"           /* the same kernels on AVX2, FMA and F16C: each 512-bit operation as two halves */
#else
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#endif

/* llmd API begin: the entry points, declared here alone. llmd.runtime.kernels reads this block with
 * cffi's C parser and binds each function of a library by it, so it holds plain declarations only (no
 * macros, no preprocessor lines). Pointers are the tensors' data; nt is the threads a call may use. */

/* The shape of a fused step (decode.c). */
typedef struct {
    int layers, rows, hidden, heads, kv_heads, head_dim, intermediate;
    int rope_rows;      /* rows P of the rotary tables */
    int pool_slots;     /* slots S of one layer's K (or V) pool */
    int table_width;    /* block ids per request in the attention table */
    int block_size;
    int pool_bytes;     /* bytes per pool value: 4 float32, 2 bfloat16 */
    int vocab;          /* V (llmd_draft only) */
} llmd_dims;

/* One weight as a fused step reads it (decode.c): its kind (LLMD_KIND_* below) says what the
 * pointers hold. A bias (or NULL) is added after the product, as the layer-by-layer forward adds it. */
typedef struct {
    const void *w;          /* gg: llmd_gg_part [group]; f32, bf16: blocks [N/64, K, 64] (f32.c); q8, q8g, q4, q4h: packed blocks
                               (quant.c); int8, int8g rows (token tables only): int8 [N, K]; rows: float32 [N, K] */
    const float *scales;    /* int8 rows: [N]; int8g rows: [N, K/group] */
    const float *bias;
    int kind;
    int group;              /* q8g, q4, q4h, int8g rows: the columns per scale */
} llmd_product;

/* One part of a weight in GGUF's blocks (blocks.c): `rows` outputs of `type` (ggml's type number), each
 * a row of the tensor at data, row order[i] for output i where order is not NULL (a row permutation
 * without a copy). A weight of several parts (q, k and v; gate and up) lays their outputs end to end. */
typedef struct {
    const void *data;
    const int32_t *order;
    int type;
    int rows;
} llmd_gg_part;

/* quant.c: AVX-512 F/BW/VL/DQ and VNNI present (the AVX2 library: AVX2, FMA and F16C) */
int llmd_cpu_ok(void);
/* quant.c: let the products use AMX's tile unit (on 1, the default) or never (0), as the amx setting says;
 * returns 1 where they now may (the CPU has it and the process was granted its tiles), else 0 */
int llmd_set_amx(int on);
/* quant.c: int8 w [N, K] with a scale per row (G = 0, s [N]) or per group of G columns (int8g, s [N, K/G]),
 * or int4 nibbles q [N, K] (one per byte) with scales and offsets z - 8 s [N, K/G] (float32), or with
 * scales and zeros z as float16 bits (q4h), packed once into blocks of 16 outputs (out:
 * llmd.runtime.kernels.ops.packed_bytes's bytes; see quant.c); x [M, K] times a packed weight; w8a8: x
 * quantized per row to int8, times int8 w [N, K] as stored */
int llmd_q8_pack(const int8_t *w, const float *s, int N, int K, int G, uint8_t *out);
int llmd_q4_pack(const uint8_t *q, const float *s, const float *off, int N, int K, int G, uint8_t *out);
int llmd_q4h_pack(const uint8_t *q, const uint16_t *s, const uint16_t *z, int N, int K, int G, uint8_t *out);
int llmd_q8_x(const float *x, int M, int K, int G, const uint8_t *w, float *y, int N, int nt);
int llmd_amx_min_rows(int rows);
int llmd_q4_x(const float *x, int M, int K, int G, const uint8_t *w, float *y, int N, int nt);
int llmd_q4h_x(const float *x, int M, int K, int G, const uint8_t *w, float *y, int N, int nt);
int llmd_w8a8_x(const float *x, int M, int K, const int8_t *w, const float *s, const float *bias, float *y, int N,
                int nt);
/* quant.c: the values llmd_q8_x gives outputs idx [C] of an int8 / int8g weight, from w [N, K] as stored:
 * y [M, C] */
int llmd_q8_pick(const float *x, int M, int K, int G, const int8_t *w, const float *s, const int64_t *idx, int C,
                 float *y, int nt);
/* quant.c: the head screen's candidates: outputs whose score s [M, V] plus its bound (norms [4, V] times
 * factors of xp, x's rows with the int4 columns first) reaches a row's floor; their count, or -3 for a
 * score not finite */
int llmd_screen_select(const float *xp, int M, int K, int KM, float margin, const float *s, int V,
                       const float *norms, int64_t *out);
/* f32.c: x [M, K] times a weight in blocks [N/64, K, 64] of float32 or (w16) bfloat16 values */
int llmd_f32(const float *x, int M, int K, const float *w, const float *bias, float *y, int N, int nt);
int llmd_f32_w16(const float *x, int M, int K, const uint16_t *w, const float *bias, float *y, int N, int nt);
/* f32.c: the most rows llmd_f32_w16 takes on this machine */
int llmd_f32_w16_rows(void);
/* f32.c: the most rows llmd_f32 takes (the vector loop, each row's sums in one order at every count) */
int llmd_f32_rows(void);
/* f32.c: the rows of bfloat16 blocks past which AMX's tile unit takes a product (0: it never does) */
int llmd_f32_w16_amx_rows(void);
/* f32.c: the values llmd_f32 / llmd_f32_w16 (wide 0) give outputs idx [C] of a blocked weight of N outputs,
 * without a bias: y [M, C] */
int llmd_f32_pick(const float *x, int M, int K, const void *w, int wide, int N, const int64_t *idx, int C,
                  float *y, int nt);
/* attention.c: query rows over a float32 or bfloat16 paged KV pool */
int llmd_attend(const float *q, const float *kpool, const float *vpool, const int32_t *row, const int32_t *span,
                const int32_t *len, int R, const int32_t *table, int table_width, int bs, int H, int KVH, int D,
                float *out, int nt);
int llmd_attend_bf16(const float *q, const uint16_t *kpool, const uint16_t *vpool, const int32_t *row,
                     const int32_t *span, const int32_t *len, int R, const int32_t *table, int table_width, int bs,
                     int H, int KVH, int D, float *out, int nt);
/* rows.c: row-wise float32 ops */
int llmd_rmsnorm(const float *x, int M, int K, const float *w, float eps, float *out);
int llmd_add_rmsnorm(const float *x, const float *h, int M, int K, const float *w, float eps, float *sum, float *out);
int llmd_silu_mul(const float *gu, int M, int I, float *out);
int llmd_rope_qk(const float *qkv, int T, int H, int KVH, int D, const float *cos_t, const float *sin_t, int P,
                 const int64_t *pos, float *q, float *k);
int llmd_argmax(const float *x, int M, int V, int64_t *out, int nt);
/* decode.c: every layer of a step in one call, and a draft model's greedy proposals: norms [2 L] (each
 * layer's input and post-attention norm weights), products [4 L] (qkv, o, gate_up, down per layer);
 * llmd_draft's embed holds the token rows (kind rows, int8, int8g, or a tied head's f32/bf16 blocks). */
int llmd_decode(const llmd_dims *dims, float *x, float *out, const float *const *norms,
                 const llmd_product *products, const float *final_norm, float eps, const float *cos_t,
                 const float *sin_t, const int64_t *pos, void *k_pool, void *v_pool, const int64_t *slots,
                 const int32_t *rows, const int32_t *spans, const int32_t *lengths, const int32_t *table,
                 float *work, int nt);
/* The most rows llmd_decode takes (LLMD_FUSED_ROWS); llmd_draft takes LLMD_DRAFT_ROWS. */
int llmd_fused_rows(void);
int llmd_draft_rows(void);
int llmd_draft(const llmd_dims *dims, const float *const *norms, const llmd_product *products,
               const float *final_norm, float eps, const float *cos_t, const float *sin_t, void *k_pool,
               void *v_pool, const int32_t *table, const llmd_product *head, const llmd_product *embed,
               const int64_t *ids, const int32_t *count, const int64_t *pos0, int steps, int64_t *out, float *x,
               float *hidden, float *logits, float *work, int nt);
/* blocks.c: rows ids [C] of a [?, K] tensor of a GGUF type as float32 [C, K]; x [M, K] times a weight
 * of P parts (N outputs in all): y [M, N] */
int llmd_gg_rows(const void *data, int type, int K, const int64_t *ids, int C, float *out);
int llmd_gg_x(const float *x, int M, int K, const llmd_gg_part *parts, int P, float *y, int N, int nt);
/* blocks.c: rows [rows, K] of a type (row order[i] as row i where order is not NULL) into the 8-row
 * interleaved layout of the same size (type 100 + type in a part); -1 where the type has none */
int llmd_gg_pack8(int type, const void *src, const int32_t *order, int rows, int K, void *dst);
/* llmd API end */

/* Rows of one fused step (decode.c): a whole step of the engine's default token budget (max_batch_tokens,
 * prompt chunks and decodes together), so that no step of it takes the Python forward and its fresh
 * buffers; its caller's scratch grows with the rows it passes. */
#define LLMD_FUSED_ROWS 512
/* Rows of one forward of llmd_draft: every request's catch-up, then one a request (16 streams with up
 * to three tokens each to catch up on, say). */
#define LLMD_DRAFT_ROWS 64

/* llmd_product.kind (llmd.runtime.kernels.ops names them alike) */
/* (INT8, INT8G: rows a token table is read from) */
enum { LLMD_KIND_F32, LLMD_KIND_BF16, LLMD_KIND_INT8, LLMD_KIND_INT8G, LLMD_KIND_ROWS,
       LLMD_KIND_Q8, LLMD_KIND_Q8G, LLMD_KIND_Q4, LLMD_KIND_Q4H, LLMD_KIND_GG };
/* LLMD_KIND_GG: w points to `group` llmd_gg_part (blocks.c), GGUF's blocks where they lie */

/* quant.c: this thread's scratch buffer `which` (0 or 1), at least `bytes` long and 64-byte aligned, kept
 * from call to call (NULL, the old one kept, where it cannot grow). */
void *scratch_for(int which, size_t bytes);

/* AMX (quant.c's int8 and int4 prompt rows, f32.c's bfloat16 ones). The compiler must know AMX's
 * operations (GCC 11, Clang 12 and newer); older ones build the library without these paths. */
#if !defined(LLMD_AVX2) && !defined(LLMD_NO_AMX) && defined(__has_include)
#if __has_include(<amxtileintrin.h>) || __has_include(<amxintrin.h>)
#define LLMD_AMX 1
#endif
#endif

#ifdef LLMD_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")))

/* 1 where the CPU has AMX's tiles and int8 products, this process may use them, and llmd_set_amx left
 * them on */
int amx_usable(void);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Tiles 0-3 (the sums of amx_q8 and bf16_amx) into c, 16 rows of 64 bytes each. */
static inline AMX_TARGET void amx_sums_out(void *c) {
    _tile_stored(0, (char *)c, 64);
    _tile_stored(1, (char *)c + 1024, 64);
    _tile_stored(2, (char *)c + 2048, 64);
    _tile_stored(3, (char *)c + 3072, 64);
}

/* This thread's tile unit set up with all eight tiles of 16 rows by 64 bytes (amx_q8, bf16_amx). */
static inline AMX_TARGET void amx_tiles_16x64(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

/* Output n of a weight in blocks [N/64, K, 64] (f32.c): its K values, float32 or (bf16) bfloat16 widened
 * exactly, into out[0], out[stride], ... (a tied head's token row, or one lane of the head's picked outputs). */
static inline void block_column(const void *w, int bf16, int K, int64_t n, float *out, size_t stride) {
    const size_t at = (size_t)(n / 64) * K * 64 + (size_t)(n % 64);
    for (int k = 0; k < K; k++) {
        if (bf16) {
            const uint32_t u = (uint32_t)((const uint16_t *)w)[at + (size_t)k * 64] << 16;
            memcpy(out + (size_t)k * stride, &u, 4);
        } else {
            out[(size_t)k * stride] = ((const float *)w)[at + (size_t)k * 64];
        }
    }
}

/* max|r| / qmax over a row of K floats (never 0, so that dividing by it is safe). */
static inline TARGET float row_scale(const float *r, int K, float qmax) {
    __m512 mx = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(r + k)));
    float scale = _mm512_reduce_max_ps(mx) / qmax;
    return scale < 1e-30f ? 1e-30f : scale;
}

/* The index of the first largest of r's V values into *at and that value into *top (and, where lowest
 * is not NULL, the smallest value into *lowest); returns 1, and sets neither, when r holds a NaN. */
static inline TARGET int row_first_max(const float *r, int V, int64_t *at, float *top, float *lowest) {
    __m512 mx = _mm512_set1_ps(-INFINITY), mn = _mm512_set1_ps(INFINITY);
    __mmask16 unordered = 0;
    int v = 0;
    for (; v + 16 <= V; v += 16) {
        const __m512 a = _mm512_loadu_ps(r + v);
        unordered |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, a);
        if (lowest) mn = _mm512_min_ps(mn, a);
    }
    float best = _mm512_reduce_max_ps(mx), least = _mm512_reduce_min_ps(mn);
    for (int t = v; t < V; t++) {
        if (r[t] != r[t]) unordered = 1;
        else {
            best = r[t] > best ? r[t] : best;
            least = r[t] < least ? r[t] : least;
        }
    }
    if (unordered) return 1;
    const __m512 b = _mm512_set1_ps(best);
    int64_t i = -1;
    for (v = 0; v + 16 <= V && i < 0; v += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + v), b, _CMP_EQ_OQ);
        if (hit) i = v + __builtin_ctz(hit);
    }
    for (int t = v; t < V && i < 0; t++)
        if (r[t] == best) i = t;
    *at = i;
    *top = best;
    if (lowest) *lowest = least;
    return 0;
}

/* exp(x) for x in [-87, 88] (clamped there): 2^(x log2 e) as 2^n 2^f, f in [-1/2, 1/2], 2^f by a
 * degree-6 polynomial (relative error below 2e-7), 2^n exactly by scalef. */
static inline TARGET __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* Sixteen vectors -> one: lane j holds the sum of v[j]'s lanes. */
static inline TARGET __m512 sum16x16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

#endif
