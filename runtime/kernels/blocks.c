/* GGUF's block types read where they lie (a model file mapped into memory): products x [M, K] times
 * a weight of such blocks, token rows, and the types' dequantization.
 *
 * Types (ggml's numbering, llmd.runtime.formats.gguf_native.TYPES): F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0, IQ4_NL (blocks of 32) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS (super-blocks of 256).
 *
 * A product quantizes each row of x alone to 8-bit integers: per 32 columns (a float scale, and the
 * scaled sum for types with a minimum) for the 32-blocks, per 256 columns (one scale, and sums per 16
 * columns for the minimums and offsets) for the super-blocks; F32, F16 and BF16 take x as float32. The
 * integer sums of a (sub-)block are exact; each block adds one float product to the row's sum, in
 * column order, whatever M is, so a row's result does not depend on the other rows of its call.
 *
 * Written with AVX2, FMA and F16C operations, which both libraries (AVX-512 and AVX2) build; the AVX-512
 * library also has VNNI forms of the 8-row interleaved products (Q4_K, Q5_K, Q8_0), whose exact integer
 * sums and float steps are the same, so both libraries give the same numbers. */
#include "kernels.h"

#define GT __attribute__((target("avx2,fma,f16c")))
#define GI static inline __attribute__((target("avx2,fma,f16c"), always_inline))

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10,
       T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30 };

/* Eight rows of a type interleaved (llmd_gg_pack8): the same bytes, laid out so that each 32-bit lane
 * of a vector holds one row's (see q4k8_rows). */
#define PACKED8 100
enum { T_Q4_K_X8 = PACKED8 + T_Q4_K, T_Q5_K_X8 = PACKED8 + T_Q5_K, T_Q8_0_X8 = PACKED8 + T_Q8_0 };

/* Bytes ahead of a weight stream that its kernel asks the caches for: rows (and 8-row groups) lie end
 * to end and a thread takes consecutive ones, so the stream runs on past a row's end. */
#define PREFETCH 4608

/* x's form a type reads */
enum { A_F32, A_32, A_256 };

static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Values per block and bytes per block of a type; 0 for a type this file does not read. */
static int type_block(int type, int *bytes) {
    switch (type) {
    case T_F32: *bytes = 4; return 1;
    case T_F16: case T_BF16: *bytes = 2; return 1;
    case T_Q4_0: *bytes = 18; return 32;
    case T_Q4_1: *bytes = 20; return 32;
    case T_Q5_0: *bytes = 22; return 32;
    case T_Q5_1: *bytes = 24; return 32;
    case T_Q8_0: case T_Q8_0_X8: *bytes = 34; return 32;
    case T_IQ4_NL: *bytes = 18; return 32;
    case T_Q2_K: *bytes = 84; return 256;
    case T_Q3_K: *bytes = 110; return 256;
    case T_Q4_K: case T_Q4_K_X8: *bytes = 144; return 256;
    case T_Q5_K: case T_Q5_K_X8: *bytes = 176; return 256;
    case T_Q6_K: *bytes = 210; return 256;
    case T_IQ4_XS: *bytes = 136; return 256;
    default: *bytes = 0; return 0;
    }
}

static int type_act(int type) {
    switch (type) {
    case T_F32: case T_F16: case T_BF16: return A_F32;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: case T_Q4_K_X8:
    case T_Q5_K_X8: return A_256;
    default: return A_32;
    }
}

static float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t u;
    if (e == 0x1F) u = sign | 0x7F800000 | (m << 13);
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) u = sign;
    else {                                  /* subnormal: m 2^-24, exact in float32 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

GI float halfv(const uint8_t *p) {      /* the same value as half(), by F16C */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static float bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The 6-bit scale and minimum j (0-7) of a Q4_K / Q5_K super-block's 12 scale bytes. */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q3_K's sixteen 6-bit scales (as stored, 0-63) from its 12 bytes. */
static void scales_q3k(const uint8_t *s, int8_t *out) {
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? (s[j] & 0xF) : (s[j - 8] >> 4);
        const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        out[j] = (int8_t)(low | high << 4);
    }
}

/* ---- dequantization: each value as the gguf package's numpy code computes it in float32 ------- */

static void dequant_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case T_F32: memcpy(y, b, 4); return;
    case T_F16: y[0] = half(b); return;
    case T_BF16: y[0] = bf16(b); return;
    case T_Q8_0: {
        const float d = half(b);
        for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
        return;
    }
    case T_Q4_0: case T_IQ4_NL: {
        const float d = half(b);
        for (int j = 0; j < 16; j++) {
            const int lo = b[2 + j] & 0xF, hi = b[2 + j] >> 4;
            y[j] = d * (float)(type == T_Q4_0 ? lo - 8 : IQ4_VALUES[lo]);
            y[j + 16] = d * (float)(type == T_Q4_0 ? hi - 8 : IQ4_VALUES[hi]);
        }
        return;
    }
    case T_Q4_1: {
        const float d = half(b), m = half(b + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (float)(b[4 + j] & 0xF) + m;
            y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        return;
    }
    case T_Q5_0: case T_Q5_1: {
        const int one = type == T_Q5_1;
        const float d = half(b), m = one ? half(b + 2) : 0.f;
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * one, 4);
        const uint8_t *qs = b + 6 + 2 * one;
        for (int j = 0; j < 16; j++) {
            const int lo = (qs[j] & 0xF) | ((qh >> j) & 1) << 4, hi = (qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
            if (one) {
                y[j] = d * (float)lo + m;
                y[j + 16] = d * (float)hi + m;
            } else {
                y[j] = d * (float)(lo - 16);
                y[j + 16] = d * (float)(hi - 16);
            }
        }
        return;
    }
    case T_Q2_K: {
        const uint8_t *sc = b, *q = b + 16;
        const float d = half(b + 80), dmin = half(b + 82);
        for (int c = 0; c < 2; c++)
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < 2; h++) {
                    const int s = sc[8 * c + 2 * j + h];
                    const float dl = d * (float)(s & 0xF), ml = dmin * (float)(s >> 4);
                    for (int l = 0; l < 16; l++)
                        y[128 * c + 32 * j + 16 * h + l] = dl * (float)((q[32 * c + 16 * h + l] >> (2 * j)) & 3) - ml;
                }
        return;
    }
    case T_Q3_K: {
        const uint8_t *hm = b, *q = b + 32;
        int8_t sc[16];
        scales_q3k(b + 96, sc);
        const float d = half(b + 108);
        for (int c = 0; c < 2; c++)
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < 2; h++) {
                    const float dl = d * (float)(sc[8 * c + 2 * j + h] - 32);
                    for (int l = 16 * h; l < 16 * h + 16; l++) {
                        const int v = ((q[32 * c + l] >> (2 * j)) & 3) - ((hm[l] >> (4 * c + j)) & 1 ? 0 : 4);
                        y[128 * c + 32 * j + l] = dl * (float)v;
                    }
                }
        return;
    }
    case T_Q4_K: case T_Q5_K: {
        const int five = type == T_Q5_K;
        const float d = half(b), dmin = half(b + 2);
        const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 16 + 32 * five;
        for (int j = 0; j < 4; j++) {
            uint8_t s0, m0, s1, m1;
            scale_min_k4(2 * j, sc, &s0, &m0);
            scale_min_k4(2 * j + 1, sc, &s1, &m1);
            const float d0 = d * (float)s0, n0 = dmin * (float)m0, d1 = d * (float)s1, n1 = dmin * (float)m1;
            for (int l = 0; l < 32; l++) {
                int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
                if (five) {
                    lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                }
                y[64 * j + l] = d0 * (float)lo - n0;
                y[64 * j + 32 + l] = d1 * (float)hi - n1;
            }
        }
        return;
    }
    case T_Q6_K: {
        const float d = half(b + 208);
        for (int c = 0; c < 2; c++) {
            const uint8_t *ql = b + 64 * c, *qh = b + 128 + 32 * c;
            const int8_t *sc = (const int8_t *)(b + 192 + 8 * c);
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
                const int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                const int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                y[128 * c + l] = d * (float)sc[is] * (float)q1;
                y[128 * c + l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[128 * c + l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[128 * c + l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
        return;
    }
    case T_IQ4_XS: {
        const float d = half(b);
        const uint16_t sh = (uint16_t)(b[2] | b[3] << 8);
        const uint8_t *sl = b + 4, *qs = b + 8;
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0xF) | ((sh >> (2 * ib)) & 3) << 4;
            const float dl = d * (float)(ls - 32);
            for (int j = 0; j < 16; j++) {
                y[32 * ib + j] = dl * (float)IQ4_VALUES[qs[16 * ib + j] & 0xF];
                y[32 * ib + j + 16] = dl * (float)IQ4_VALUES[qs[16 * ib + j] >> 4];
            }
        }
        return;
    }
    }
}

/* ---- x quantized per row ---------------------------------------------------------------------- */

typedef struct {
    const float *f;         /* A_F32: x's row */
    const int8_t *q;        /* A_32, A_256: K integers */
    const float *d;         /* scales: K/32 or K/256 */
    const float *ds;        /* A_32: d times the block's sum of q */
    const int16_t *bs;      /* A_256: sums of q per 16 columns */
    const int16_t *b32;     /* A_256, A_32: sums of q per 32 columns */
} xrow;

static GT float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* Each of 4 vectors' 8 int32 lanes summed exactly (callers keep the sums within int32): lane r of
 * the result is v[r]'s total; a vector past ``R`` counts as 0. */
GI __m128i totals4(const __m256i *v, const int R) {
    if (R == 1) {
        __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v[0]), _mm256_extracti128_si256(v[0], 1));
        a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
        return _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    }
    const __m256i z = _mm256_setzero_si256();
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], R > 1 ? v[1] : z),
                                        _mm256_hadd_epi32(R > 2 ? v[2] : z, R > 3 ? v[3] : z));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* n floats (a multiple of 32) -> integers q = round(x / d), d = max|x| / 127 (0 where x is all 0). */
static GT float quantize_span(const float *x, int n, int8_t *q) {
    __m256 mx = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int k = 0; k < n; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + k), abs_mask));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float amax = _mm_cvtss_f32(m);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 vi = _mm256_set1_ps(inv);
    for (int k = 0; k < n; k += 32) {
        __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vi));
        __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vi));
        __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 16), vi));
        __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 24), vi));
        __m256i ab = _mm256_packs_epi32(a, b), ce = _mm256_packs_epi32(c, e);
        __m256i p = _mm256_packs_epi16(ab, ce);               /* lanes in order 0 4 1 5 2 6 3 7 (of 4 each) */
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + k), p);
    }
    return amax / 127.f;
}

static int row_sum(const int8_t *q, int n) {
    int s = 0;
    for (int i = 0; i < n; i++) s += q[i];
    return s;
}

/* ---- dot products of one weight row with R <= 4 rows of x ------------------------------------- */

#define MAXR 4

GI __m256i dot_us(__m256i w, __m256i x) {          /* unsigned w (< 128) times signed x, by 4 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
GI __m256i dot_ss(__m256i w, __m256i x) {          /* signed w times signed x (|x| <= 127), by 4 */
    return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}
GI __m256i nibbles16(const uint8_t *p) {          /* 16 bytes -> 32: the low nibbles, then the high */
    const __m128i t = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0xF));
}
GI __m256i bits_to_bytes(uint32_t bits) {         /* byte i all ones where bit i is set */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}
GI __m256i loadq(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
GI __m256i scales2(int lo, int hi) { return _mm256_set_m128i(_mm_set1_epi16((short)hi), _mm_set1_epi16((short)lo)); }

/* 32-blocks: the block's weights as signed (or, with a minimum, unsigned) bytes, times each row. */
GI void dot_32(int type, int K, const uint8_t *w, const xrow *x, int R, float *out) {
    __m256 acc[MAXR];
    float accm[MAXR];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = 0.f;
    }
    const __m256i iq4 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
    int bytes;
    type_block(type, &bytes);
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *blk = w + (size_t)b * bytes;
        if (!(b & 1)) _mm_prefetch((const char *)blk + PREFETCH, _MM_HINT_T0);
        const float dw = halfv(blk);
        float m = 0.f;
        int has_min = 0;
        __m256i q;
        switch (type) {
        case T_Q8_0: q = _mm256_loadu_si256((const __m256i *)(blk + 2)); break;
        case T_Q4_0: q = _mm256_sub_epi8(nibbles16(blk + 2), _mm256_set1_epi8(8)); break;
        case T_IQ4_NL: q = _mm256_shuffle_epi8(iq4, nibbles16(blk + 2)); break;
        case T_Q4_1: q = nibbles16(blk + 4); m = halfv(blk + 2); has_min = 1; break;
        case T_Q5_0: {
            uint32_t qh;
            memcpy(&qh, blk + 2, 4);
            q = _mm256_or_si256(nibbles16(blk + 6), _mm256_andnot_si256(bits_to_bytes(qh), _mm256_set1_epi8((char)0xF0)));
            break;
        }
        default: {      /* Q5_1 */
            uint32_t qh;
            memcpy(&qh, blk + 4, 4);
            q = _mm256_or_si256(nibbles16(blk + 8), _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
            m = halfv(blk + 2);
            has_min = 1;
        }
        }
        for (int r = 0; r < R; r++) {
            const __m256i xq = loadq(x[r].q + 32 * b);
            const __m256i p = has_min ? dot_us(q, xq) : dot_ss(q, xq);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[r].d[b]), _mm256_cvtepi32_ps(p), acc[r]);
            if (has_min) accm[r] += m * x[r].ds[b];
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + accm[r];
}

/* Q4_K and Q5_K: eight sub-blocks of 32 with 6-bit scales and minimums. The scales are widened to
 * 16 bits once per super-block and each sub-block's taken by a byte shuffle; the minimums meet x's
 * sums per 32 columns in one vpmaddwd. R (1, 2 or 4, a constant where it is inlined) rows share each
 * weight load. */
static const uint8_t SHUF_PAIR[8][32] = {
#define P(k) {2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, \
               2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, \
               2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1, 2 * k, 2 * k + 1}
    P(0), P(1), P(2), P(3), P(4), P(5), P(6), P(7)
#undef P
};

/* The 12 scale bytes of a Q4_K / Q5_K super-block -> scales (low 8 bytes) and minimums (high 8). */
GI __m128i scales_mins_k4(const uint8_t *q) {
    uint32_t u[4];
    memcpy(u, q, 12);
    const uint32_t m4 = 0x3f3f3f3f, m2 = 0xc0c0c0c0, m0 = 0x0f0f0f0f;
    u[3] = ((u[2] >> 4) & m0) | ((u[1] & m2) >> 2);      /* minimums 4-7 */
    const uint32_t s47 = (u[2] & m0) | ((u[0] & m2) >> 2);   /* scales 4-7 */
    u[2] = u[1] & m4;                                    /* minimums 0-3 */
    u[1] = s47;
    u[0] &= m4;                                          /* scales 0-3 */
    return _mm_loadu_si128((const __m128i *)u);
}

GI void q45k_rows(const int five, int K, const uint8_t *w, const xrow *x, float *out, const int R) {
    __m256 acc[MAXR];
    __m128 accm[MAXR];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = _mm_setzero_ps();
    }
    const int bytes = five ? 176 : 144;
    const __m256i low = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * bytes;
        for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
        const float d = halfv(blk), dmin = halfv(blk + 2);
        const __m128i sm = scales_mins_k4(blk + 4);
        const __m256i sc = _mm256_cvtepu8_epi16(sm);                     /* 8 scales, 8 minimums as int16 */
        const __m256i sc2 = _mm256_permute2x128_si256(sc, sc, 0x00);     /* the scales in both halves */
        const __m128i mins = _mm256_extracti128_si256(sc, 1);
        const uint8_t *qs = blk + 16 + 32 * five;
        const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m256i sum[MAXR];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256i t = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(t, low), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * j + 1), one), 4));
            }
            const __m256i s_lo = _mm256_shuffle_epi8(sc2, _mm256_loadu_si256((const __m256i *)SHUF_PAIR[2 * j]));
            const __m256i s_hi = _mm256_shuffle_epi8(sc2, _mm256_loadu_si256((const __m256i *)SHUF_PAIR[2 * j + 1]));
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].q + 256 * b + 64 * j;
                const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, loadq(xq)), s_lo);
                const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, loadq(xq + 32)), s_hi);
                sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(p0, p1));
            }
        }
        for (int r = 0; r < R; r++) {
            const float xd = x[r].d[b];
            const __m128i bs = _mm_loadu_si128((const __m128i *)(x[r].b32 + 8 * b));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(sum[r]), acc[r]);
            accm[r] = _mm_fmadd_ps(_mm_set1_ps(dmin * xd), _mm_cvtepi32_ps(_mm_madd_epi16(mins, bs)), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m128 m = _mm_add_ps(accm[r], _mm_movehl_ps(accm[r], accm[r]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        out[r] = hsum8(acc[r]) - _mm_cvtss_f32(m);
    }
}

/* Q6_K: 16 signed 8-bit scales per super-block, each of 16 columns; values 0-63 less 32, the 32 taken
 * off as 32 times the scaled sums of x's 16 columns (one vpmaddwd). A super-block's integer sum is
 * totalled exactly and adds one float product to the row's sum, as the 8-row form below does, so the
 * two forms give the same bits. */
/* Byte shuffles of 8 int16 scales (both 128-bit halves alike) that put scale 2k in the 8 low lanes and
 * scale 2k + 1 in the 8 high lanes. */
static const uint8_t SHUF_Q6[4][32] = {
#define P(k) {4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k, 4 * k + 1, \
               4 * k, 4 * k + 1, 4 * k, 4 * k + 1, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, \
               4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3, 4 * k + 2, 4 * k + 3}
    P(0), P(1), P(2), P(3)
#undef P
};

/* A Q6_K super-block b's integer sums (sum[r], 8 lanes each, for R <= 4 rows of x) into acc (lane r:
 * row r's float sum): less 32 times x's sums by the scales sc16 (the values' offset), times d x_d. */
GI __m128 q6k_add(const xrow *x, int b, const int R, __m256i sc16, float d, __m256i *sum, __m128 acc) {
    for (int r = 0; r < R; r++) {
        const __m256i bs = _mm256_loadu_si256((const __m256i *)(x[r].bs + 16 * b));
        sum[r] = _mm256_sub_epi32(sum[r], _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
    }
    const __m128 xd = R == 1 ? _mm_set_ss(x[0].d[b])
                             : _mm_setr_ps(x[0].d[b], x[1].d[b], R > 2 ? x[2].d[b] : 0.f, R > 3 ? x[3].d[b] : 0.f);
    return _mm_fmadd_ps(_mm_mul_ps(_mm_set1_ps(d), xd), _mm_cvtepi32_ps(totals4(sum, R)), acc);
}

GI void q6k_rows(int K, const uint8_t *w, const xrow *x, float *out, const int R) {
    __m128 acc = _mm_setzero_ps();        /* lane r: row r's sum, one product per super-block */
    const __m256i low = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 210;
        for (int l = 0; l < 210; l += 64) _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
        const float d = halfv(blk + 208);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        __m256i sum[MAXR];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        for (int c = 0; c < 2; c++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * c));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4));
            const __m256i sch = c ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            for (int k = 0; k < 4; k++) {
                const __m256i s = _mm256_shuffle_epi8(sch, _mm256_loadu_si256((const __m256i *)SHUF_Q6[k]));
                for (int r = 0; r < R; r++) {
                    const __m256i p = _mm256_maddubs_epi16(q[k], loadq(x[r].q + 256 * b + 128 * c + 32 * k));
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(p, s));
                }
            }
        }
        acc = q6k_add(x, b, R, sc16, d, sum, acc);
    }
    float o[4];
    _mm_storeu_ps(o, acc);
    for (int r = 0; r < R; r++) out[r] = o[r];
}

/* A kernel taking R rows as copies for 4, 2 and 1 rows, so that each copy's row loops unroll with
 * their accumulators in registers; ``width`` outputs a row (1, or 8 for the 8-row layouts). */
#define BY_ROWS(name, call, width) BY_ROWS_AT(GT, name, call, width)
#define BY_ROWS_AT(attr, name, call, width)                                               \
    static attr void name(int K, const uint8_t *w, const xrow *x, int R, float *out) {    \
        if (R == 4) call(K, w, x, out, 4);                                                \
        else if (R == 2) call(K, w, x, out, 2);                                           \
        else for (int r = 0; r < R; r++) call(K, w, x + r, out + (width) * r, 1);         \
    }
#define Q4K(K, w, x, out, R) q45k_rows(0, K, w, x, out, R)
#define Q5K(K, w, x, out, R) q45k_rows(1, K, w, x, out, R)
BY_ROWS(dot_q4k, Q4K, 1)
BY_ROWS(dot_q5k, Q5K, 1)
#ifdef LLMD_AVX2
BY_ROWS(dot_q6k, q6k_rows, 1)         /* the AVX-512 library takes q6k_vnni */
#endif

/* Unsigned values q (8 x 32 columns) times x's integers xq, each 16 columns times its scale s: 8 sums. */
GI __m256i scaled_sums(const __m256i *q, const __m256i *s, const int8_t *xq) {
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++)
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q[j], loadq(xq + 32 * j)), s[j]));
    return sum;
}

static GT void dot_q3k(int K, const uint8_t *w, const xrow *x, int R, float *out) {
    __m256 acc[MAXR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 110;
        int8_t sc[16];
        scales_q3k(blk + 96, sc);
        for (int g = 0; g < 16; g++) sc[g] = (int8_t)(sc[g] - 32);
        const float d = halfv(blk + 108);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk);
        __m256i q[8], s[8];
        for (int c = 0; c < 2; c++) {
            const __m256i t = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * c));
            for (int j = 0; j < 4; j++) {
                const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(t, 2 * j), three);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * c + j), one);
                q[4 * c + j] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 2));
                s[4 * c + j] = scales2(sc[8 * c + 2 * j], sc[8 * c + 2 * j + 1]);
            }
        }
        for (int r = 0; r < R; r++) {         /* values less 4: 4 times each 16 columns' scaled x sums */
            __m256i sum = scaled_sums(q, s, x[r].q + 256 * b);
            const int16_t *bs = x[r].bs + 16 * b;
            int off = 0;
            for (int g = 0; g < 16; g++) off += sc[g] * bs[g];
            sum = _mm256_sub_epi32(sum, _mm256_setr_epi32(4 * off, 0, 0, 0, 0, 0, 0, 0));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), _mm256_cvtepi32_ps(sum), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

static GT void dot_q2k(int K, const uint8_t *w, const xrow *x, int R, float *out) {
    __m256 acc[MAXR];
    float accm[MAXR];
    for (int r = 0; r < R; r++) {
        acc[r] = _mm256_setzero_ps();
        accm[r] = 0.f;
    }
    const __m256i three = _mm256_set1_epi8(3);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 84;
        const float d = halfv(blk + 80), dmin = halfv(blk + 82);
        __m256i q[8], s[8];
        for (int c = 0; c < 2; c++) {
            const __m256i t = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
            for (int j = 0; j < 4; j++) {
                q[4 * c + j] = _mm256_and_si256(_mm256_srli_epi16(t, 2 * j), three);
                s[4 * c + j] = scales2(blk[8 * c + 2 * j] & 0xF, blk[8 * c + 2 * j + 1] & 0xF);
            }
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xq = x[r].q + 256 * b;
            __m256i sum = scaled_sums(q, s, xq);
            const int16_t *bs = x[r].bs + 16 * b;
            int mins = 0;
            for (int g = 0; g < 16; g++) mins += (blk[g] >> 4) * bs[g];
            const float xd = x[r].d[b];
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd), _mm256_cvtepi32_ps(sum), acc[r]);
            accm[r] += dmin * xd * (float)mins;
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) - accm[r];
}

static GT void dot_iq4xs(int K, const uint8_t *w, const xrow *x, int R, float *out) {
    __m256 acc[MAXR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i iq4 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 136;
        const float d = halfv(blk);
        const uint16_t sh = (uint16_t)(blk[2] | blk[3] << 8);
        __m256i q[8], s[8];
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | ((sh >> (2 * ib)) & 3) << 4;
            q[ib] = _mm256_shuffle_epi8(iq4, nibbles16(blk + 8 + 16 * ib));
            s[ib] = _mm256_set1_epi16((short)(ls - 32));
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xq = x[r].q + 256 * b;
            __m256i sum = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const __m256i xv = loadq(xq + 32 * j);
                const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q[j], q[j]), _mm256_sign_epi8(xv, q[j]));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, s[j]));
            }
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[r].d[b]), _mm256_cvtepi32_ps(sum), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]);
}

/* F32, F16 and BF16 weights times float32 x: two sums of 8 lanes per row, added at the end. */
GI __m256 wide8(int bf, const uint8_t *w, int k) {       /* 8 weights from column k as float32 */
    if (bf == 2) return _mm256_loadu_ps((const float *)w + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)(w + 2 * k));
    if (bf) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

GI float one_weight(int bf, const uint8_t *w, int t) {
    if (bf == 2) return ((const float *)w)[t];
    return bf ? bf16(w + 2 * t) : halfv(w + 2 * t);
}

GI void dot_wide(int bf, int K, const uint8_t *w, const xrow *x, int R, float *out) {
    __m256 a0[MAXR], a1[MAXR];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = wide8(bf, w, k), w1 = wide8(bf, w, k + 8);
        for (int r = 0; r < R; r++) {
            a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r].f + k), a0[r]);
            a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r].f + k + 8), a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float s = hsum8(_mm256_add_ps(a0[r], a1[r]));
        for (int t = k; t < K; t++) s += one_weight(bf, w, t) * x[r].f[t];
        out[r] = s;
    }
}

static GT void dot_f16(int K, const uint8_t *w, const xrow *x, int R, float *out) { dot_wide(0, K, w, x, R, out); }
static GT void dot_bf16(int K, const uint8_t *w, const xrow *x, int R, float *out) { dot_wide(1, K, w, x, R, out); }
static GT void dot_f32(int K, const uint8_t *w, const xrow *x, int R, float *out) { dot_wide(2, K, w, x, R, out); }

#define DOT32(name, type) \
    static GT void name(int K, const uint8_t *w, const xrow *x, int R, float *out) { dot_32(type, K, w, x, R, out); }
DOT32(dot_q8_0, T_Q8_0)
DOT32(dot_q4_0, T_Q4_0)
DOT32(dot_q4_1, T_Q4_1)
DOT32(dot_q5_0, T_Q5_0)
DOT32(dot_q5_1, T_Q5_1)
DOT32(dot_iq4nl, T_IQ4_NL)

#ifndef LLMD_AVX2
static void dot_q6k_vnni(int K, const uint8_t *w, const xrow *x, int R, float *out);     /* below */
#endif

static void dot_row(int type, int K, const uint8_t *w, const xrow *x, int R, float *out) {
    switch (type) {
    case T_F32: dot_f32(K, w, x, R, out); return;
    case T_F16: dot_f16(K, w, x, R, out); return;
    case T_BF16: dot_bf16(K, w, x, R, out); return;
    case T_Q4_K: dot_q4k(K, w, x, R, out); return;
    case T_Q5_K: dot_q5k(K, w, x, R, out); return;
#ifndef LLMD_AVX2
    case T_Q6_K: dot_q6k_vnni(K, w, x, R, out); return;
#else
    case T_Q6_K: dot_q6k(K, w, x, R, out); return;
#endif
    case T_Q3_K: dot_q3k(K, w, x, R, out); return;
    case T_Q2_K: dot_q2k(K, w, x, R, out); return;
    case T_IQ4_XS: dot_iq4xs(K, w, x, R, out); return;
    case T_Q8_0: dot_q8_0(K, w, x, R, out); return;
    case T_Q4_0: dot_q4_0(K, w, x, R, out); return;
    case T_Q4_1: dot_q4_1(K, w, x, R, out); return;
    case T_Q5_0: dot_q5_0(K, w, x, R, out); return;
    case T_Q5_1: dot_q5_1(K, w, x, R, out); return;
    case T_IQ4_NL: dot_iq4nl(K, w, x, R, out); return;
    }
}


/* Calls of E8_MIN rows of x or more widen the 8-row groups they read to a byte a value (see q6k_widen8);
 * E8_Q6K and E8_K45 are the bytes of a widened group's super-block. */
#define E8_MIN 32
#define E8_Q6K 2848
#define E8_K45 2176

/* A thread's buffer *buf of *have bytes, grown to hold ``bytes`` (NULL when out of memory). */
static void *grown(void **buf, size_t *have, size_t bytes) {
    if (bytes > *have) {
        free(*buf);
        *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        *have = *buf ? bytes : 0;
    }
    return *buf;
}

/* This thread's buffer for x's quantized rows. */
static void *act_buffer(size_t bytes) {
    static __thread void *buf;
    static __thread size_t have;
    return grown(&buf, &have, bytes);
}

/* This thread's buffer for widened rows (q6k_widen8). */
static void *wide_buffer(size_t bytes) {
    static __thread void *buf;
    static __thread size_t have;
    return grown(&buf, &have, bytes);
}

/* ---- eight rows interleaved ------------------------------------------------------------------
 * Q4_K x8: for each group of 8 rows and super-block, 1152 bytes (8 x 144): the 8 rows' d (float16),
 * their dmin, their 12 scale bytes transposed (byte c of row i at 32 + 8 c + i), then for each j (0-3)
 * and t (0-7) 32 bytes: row i's quant bytes 32 j + 4 t .. + 3 at lane i. A vector's low nibbles are
 * columns 64 j + 4 t .. + 3 of the 8 rows, its high nibbles columns 64 j + 32 + 4 t .. + 3: each lane
 * is one row, x's four columns are broadcast, and 8 rows' sums come out in one vector, with no
 * horizontal sum and no per-row scale shuffle. Eight products of a sub-block add exactly in 16 bits
 * (8 x 2 x 15 x 127 < 32768) before one vpmaddwd by the rows' scales. Q5_K x8 (1408 bytes): the same,
 * with the rows' 32 high-bit bytes (t 0-7: row i's bytes 4 t .. + 3 at lane i) between the scales and
 * the nibbles. */

/* One row's block b into its lane i of a group's block o (the layouts above). */
static void pack_block(int type, const uint8_t *blk, int i, uint8_t *o) {
    if (type == T_Q8_0) {
        memcpy(o + 2 * i, blk, 2);
        for (int t = 0; t < 8; t++) memcpy(o + 16 + 32 * t + 4 * i, blk + 2 + 4 * t, 4);
        return;
    }
    const int five = type == T_Q5_K, qs = 16 + 32 * five, at = 128 + 256 * five;
    memcpy(o + 2 * i, blk, 2);
    memcpy(o + 16 + 2 * i, blk + 2, 2);
    for (int c = 0; c < 12; c++) o[32 + 8 * c + i] = blk[4 + c];
    if (five)
        for (int t = 0; t < 8; t++) memcpy(o + 128 + 32 * t + 4 * i, blk + 16 + 4 * t, 4);
    for (int j = 0; j < 4; j++)
        for (int t = 0; t < 8; t++) memcpy(o + at + (8 * j + t) * 32 + 4 * i, blk + qs + 32 * j + 4 * t, 4);
}

int llmd_gg_pack8(int type, const void *src, const int32_t *order, int rows, int K, void *dst) {
    int bytes, per = type_block(type, &bytes);
    if ((type != T_Q4_K && type != T_Q5_K && type != T_Q8_0) || rows % 8 || K % per) return -1;
    const int nb = K / per;
    const uint8_t *in = src;
    uint8_t *out = dst;
    #pragma omp parallel for schedule(static)
    for (int g = 0; g < rows / 8; g++)
        for (int b = 0; b < nb; b++)
            for (int i = 0; i < 8; i++) {
                const int row = order ? order[8 * g + i] : 8 * g + i;
                pack_block(type, in + ((size_t)row * nb + b) * bytes, i, out + ((size_t)g * nb + b) * 8 * bytes);
            }
    return 0;
}

/* Byte-wise (x >> 6) << 4 of 16 bytes: a scale's two high bits. */
GI __m128i high2(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 2), _mm_set1_epi8(0x30)); }
/* 8 bytes (one per row) -> 8 lanes of two int16 copies */
GI __m256i pairs_of(__m128i bytes8) { return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(bytes8, bytes8)); }
/* 8 bytes each of sub-blocks a and b (one per row) -> 8 lanes of (a, b) as int16 */
GI __m256i pairs_ab(__m128i a8, __m128i b8) { return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a8, b8)); }

/* A Q4_K / Q5_K x8 super-block's scales: bytes 0-7 (8-15) of sc[k] the 8 rows' scales of sub-block 2k
 * (2k + 1); for each of R rows of x (block b), sum[r] zeroed and mins[r] its minimums' exact sums. */
GI void k8_scales(const uint8_t *blk, const xrow *x, int b, const int R, __m128i sc[4], __m256i *sum, __m256i *mins) {
    const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(0xF);
    const __m128i A = _mm_loadu_si128((const __m128i *)(blk + 32)), B = _mm_loadu_si128((const __m128i *)(blk + 48));
    const __m128i C = _mm_loadu_si128((const __m128i *)(blk + 64)), D = _mm_loadu_si128((const __m128i *)(blk + 80));
    const __m128i E = _mm_loadu_si128((const __m128i *)(blk + 96)), F = _mm_loadu_si128((const __m128i *)(blk + 112));
    __m128i mn[4];
    sc[0] = _mm_and_si128(A, m63);
    sc[1] = _mm_and_si128(B, m63);
    sc[2] = _mm_or_si128(_mm_and_si128(E, m15), high2(A));
    sc[3] = _mm_or_si128(_mm_and_si128(F, m15), high2(B));
    mn[0] = _mm_and_si128(C, m63);
    mn[1] = _mm_and_si128(D, m63);
    mn[2] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(E, 4), m15), high2(C));
    mn[3] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(F, 4), m15), high2(D));
    __m256i mp[4];
    for (int k = 0; k < 4; k++) mp[k] = pairs_ab(mn[k], _mm_srli_si128(mn[k], 8));
    for (int r = 0; r < R; r++) {
        sum[r] = mins[r] = _mm256_setzero_si256();
        const int16_t *b32 = x[r].b32 + 8 * b;
        for (int k = 0; k < 4; k++) {
            const int pair = (int)((uint32_t)(uint16_t)b32[2 * k] | (uint32_t)(uint16_t)b32[2 * k + 1] << 16);
            mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(mp[k], _mm256_set1_epi32(pair)));
        }
    }
}

/* A Q4_K / Q5_K x8 super-block's sums into the rows' float sums: acc[r] += d x_d sum[r], accm[r] +=
 * dmin x_d mins[r], per row of the group (d and dmin its float16 scales). */
GI void k8_add(const uint8_t *blk, const xrow *x, int b, const int R, const __m256i *sum, const __m256i *mins,
               __m256 *acc, __m256 *accm) {
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
    for (int r = 0; r < R; r++) {
        const __m256 xd = _mm256_set1_ps(x[r].d[b]);
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d8, xd), _mm256_cvtepi32_ps(sum[r]), acc[r]);
        accm[r] = _mm256_fmadd_ps(_mm256_mul_ps(m8, xd), _mm256_cvtepi32_ps(mins[r]), accm[r]);
    }
}

/* out [R][8]: rows 0-7 of a group times R rows of x. */
GI void q45k8_rows(const int five, const int wide, int K, const uint8_t *w, const xrow *x, float *out, const int R) {
    __m256 acc[MAXR], accm[MAXR];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0xF);
    const int bytes = wide ? E8_K45 : five ? 1408 : 1152, at = five ? 384 : 128;
    const __m256i one = _mm256_set1_epi8(1);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * bytes;
        for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
        __m128i sc[4];
        __m256i sum[MAXR], mins[MAXR];
        k8_scales(blk, x, b, R, sc, sum, mins);
        for (int j = 0; j < 4; j++) {
            const __m256i sp_lo = pairs_of(sc[j]), sp_hi = pairs_of(_mm_srli_si128(sc[j], 8));
            __m256i s16lo[MAXR], s16hi[MAXR];
            for (int r = 0; r < R; r++) s16lo[r] = s16hi[r] = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) {
                __m256i lo, hi;
                if (wide) {
                    lo = _mm256_loadu_si256((const __m256i *)(blk + 128 + (8 * j + t) * 64));
                    hi = _mm256_loadu_si256((const __m256i *)(blk + 160 + (8 * j + t) * 64));
                } else {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + at + (8 * j + t) * 32));
                    lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
                if (five) {
                    if (t == 4)          /* 31 x 127 x 2 x 4 < 32768: four products at most in 16 bits */
                        for (int r = 0; r < R; r++) {
                            sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(s16lo[r], sp_lo),
                                                                               _mm256_madd_epi16(s16hi[r], sp_hi)));
                            s16lo[r] = s16hi[r] = _mm256_setzero_si256();
                        }
                    if (!wide) {
                        const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * t));
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j + 1), one), 4));
                    }
                }
                for (int r = 0; r < R; r++) {
                    const int8_t *xq = x[r].q + 256 * b + 64 * j + 4 * t;
                    int32_t x0, x1;
                    memcpy(&x0, xq, 4);
                    memcpy(&x1, xq + 32, 4);
                    s16lo[r] = _mm256_add_epi16(s16lo[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
                    s16hi[r] = _mm256_add_epi16(s16hi[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
                }
            }
            for (int r = 0; r < R; r++)
                sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(s16lo[r], sp_lo),
                                                                   _mm256_madd_epi16(s16hi[r], sp_hi)));
        }
        k8_add(blk, x, b, R, sum, mins, acc, accm);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, _mm256_sub_ps(acc[r], accm[r]));
}

/* Q8_0 x8: per group of 8 rows and block, 272 bytes: the rows' d, then for t (0-7) 32 bytes: row i's
 * values 4 t .. + 3 at lane i. */
GI void q808_rows(int K, const uint8_t *w, const xrow *x, float *out, const int R) {
    __m256 acc[MAXR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *blk = w + (size_t)b * 272;
        for (int l = 0; l < 272; l += 64) _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
        const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i sum[MAXR];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * t));
            const __m256i a = _mm256_sign_epi8(v, v);
            for (int r = 0; r < R; r++) {
                int32_t x4;
                memcpy(&x4, x[r].q + 32 * b + 4 * t, 4);
                const __m256i p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_set1_epi32(x4), v));
                sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(p, ones));
            }
        }
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(x[r].d[b])), _mm256_cvtepi32_ps(sum[r]), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

#define Q4K8(K, w, x, out, R) q45k8_rows(0, 0, K, w, x, out, R)
#define Q5K8(K, w, x, out, R) q45k8_rows(1, 0, K, w, x, out, R)
#define Q5KW(K, w, x, out, R) q45k8_rows(1, 1, K, w, x, out, R)
BY_ROWS(dot8_q4k, Q4K8, 8)
BY_ROWS(dot8_q5k, Q5K8, 8)
BY_ROWS(dotw_q5k, Q5KW, 8)
BY_ROWS(dot8_q80, q808_rows, 8)

#ifndef LLMD_AVX2
/* ---- the group forms with AVX-512 VNNI (the AVX-512 library only) ----------------------------
 * One 512-bit vector holds two steps t and t + 1 of a group (lanes 0-7: the 8 rows at t, lanes 8-15:
 * at t + 1, as the layout lies); vpdpbusd sums each lane's four byte products into 32 bits, and x's
 * four bytes of each step reach their lanes by one permute of one load. The integer sums of a
 * sub-block are the same exact numbers the 16-bit forms above reach, and the float operations on them
 * are the same, so both libraries still give the same bits. */
#define VT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define VI static inline __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"), \
                                                always_inline))

VI __m256i halves(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

/* Q4_K / Q5_K, G (1 or 2, a constant where inlined) neighbouring 8-row groups, the second ``gbytes``
 * after the first: x's permuted bytes of a step serve every group, so two groups halve the permutes a
 * product takes, and each sub-block's scales multiply the 512-bit sums, halved to the 8 rows once a
 * super-block. A lane of slo / shi holds 16 columns' products. */
VI void q45k_vnni(const int five, const int G, int K, const uint8_t *w, size_t gbytes, const xrow *x, float *out,
                  const int R) {
    __m256 acc[2][MAXR], accm[2][MAXR];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) acc[g][r] = accm[g][r] = _mm256_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1);
    const __m512i at_t = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i at_t32 = _mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9);
    const int bytes = five ? 1408 : 1152, at = five ? 384 : 128;
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk[2] = {w + (size_t)b * bytes, w + gbytes + (size_t)b * bytes};
        for (int g = 0; g < G; g++)
            for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char *)blk[g] + PREFETCH + l, _MM_HINT_T0);
        __m128i sc[2][4];
        __m256i sum[2][MAXR], mins[2][MAXR];
        __m512i tot[2][MAXR];
        for (int g = 0; g < G; g++) {
            k8_scales(blk[g], x, b, R, sc[g], sum[g], mins[g]);
            for (int r = 0; r < R; r++) tot[g][r] = _mm512_setzero_si512();
        }
        for (int j = 0; j < 4; j++) {
            __m512i slo[2][MAXR], shi[2][MAXR];
            for (int g = 0; g < G; g++)
                for (int r = 0; r < R; r++) slo[g][r] = shi[g][r] = _mm512_setzero_si512();
            for (int t = 0; t < 8; t += 2) {
                __m512i lo[2], hi[2];
                for (int g = 0; g < G; g++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(blk[g] + at + (8 * j + t) * 32));
                    lo[g] = _mm512_and_si512(v, low), hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    if (five) {
                        const __m512i h = _mm512_loadu_si512((const void *)(blk[g] + 128 + 32 * t));
                        lo[g] = _mm512_or_si512(lo[g], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * j), one), 4));
                        hi[g] = _mm512_or_si512(hi[g], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * j + 1), one), 4));
                    }
                }
                for (int r = 0; r < R; r++) {
                    const __m512i xv = _mm512_loadu_si512((const void *)(x[r].q + 256 * b + 64 * j + 4 * t));
                    const __m512i xl = _mm512_permutexvar_epi32(at_t, xv), xh = _mm512_permutexvar_epi32(at_t32, xv);
                    for (int g = 0; g < G; g++) {
                        slo[g][r] = _mm512_dpbusd_epi32(slo[g][r], lo[g], xl);
                        shi[g][r] = _mm512_dpbusd_epi32(shi[g][r], hi[g], xh);
                    }
                }
            }
            for (int g = 0; g < G; g++) {
                const __m512i s_lo = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(sc[g][j], sc[g][j]));
                const __m512i s_hi = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(sc[g][j], sc[g][j]));
                for (int r = 0; r < R; r++)
                    tot[g][r] = _mm512_add_epi32(tot[g][r], _mm512_add_epi32(_mm512_mullo_epi32(slo[g][r], s_lo),
                                                                             _mm512_mullo_epi32(shi[g][r], s_hi)));
            }
        }
        for (int g = 0; g < G; g++) {
            for (int r = 0; r < R; r++) sum[g][r] = halves(tot[g][r]);
            k8_add(blk[g], x, b, R, sum[g], mins[g], acc[g], accm[g]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) _mm256_storeu_ps(out + 8 * G * r + 8 * g, _mm256_sub_ps(acc[g][r], accm[g][r]));
}

/* Q8_0, G (1 or 2) neighbouring 8-row groups (the second ``gbytes`` after the first): the weights offset
 * to unsigned (w + 128, one xor a vector) so that vpdpbusd takes them and x's permuted bytes serve every
 * group as they are, and 128 times x's block sum taken off each block's sums: the same exact integers
 * as q808_rows', the same float operations, the same bits. */
VI void q80_vnni(const int G, int K, const uint8_t *w, size_t gbytes, const xrow *x, float *out, const int R) {
    __m256 acc[2][MAXR];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) acc[g][r] = _mm256_setzero_ps();
    const __m512i at_t = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *blk[2] = {w + (size_t)b * 272, w + gbytes + (size_t)b * 272};
        for (int g = 0; g < G; g++)
            for (int l = 0; l < 272; l += 64) _mm_prefetch((const char *)blk[g] + PREFETCH + l, _MM_HINT_T0);
        __m512i sum[2][MAXR];
        for (int g = 0; g < G; g++)
            for (int r = 0; r < R; r++) sum[g][r] = _mm512_setzero_si512();
        for (int t = 0; t < 8; t += 2) {
            __m512i u[2];
            for (int g = 0; g < G; g++)
                u[g] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(blk[g] + 16 + 32 * t)), flip);
            for (int r = 0; r < R; r++) {
                const __m512i xv = _mm512_permutexvar_epi32(at_t, _mm512_castsi128_si512(
                    _mm_loadl_epi64((const __m128i *)(x[r].q + 32 * b + 4 * t))));
                for (int g = 0; g < G; g++) sum[g][r] = _mm512_dpbusd_epi32(sum[g][r], u[g], xv);
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256i off = _mm256_set1_epi32(128 * (int)x[r].b32[b]);
            const __m256 xd = _mm256_set1_ps(x[r].d[b]);
            for (int g = 0; g < G; g++) {
                const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk[g]));
                acc[g][r] = _mm256_fmadd_ps(_mm256_mul_ps(d8, xd), _mm256_cvtepi32_ps(_mm256_sub_epi32(halves(sum[g][r]), off)),
                                            acc[g][r]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) _mm256_storeu_ps(out + 8 * G * r + 8 * g, acc[g][r]);
}

/* Q6_K, one weight row: q6k_rows with two of its 32-column steps a 512-bit vector (the 2-bit high parts
 * of both shifted at once by srlv), and each 16-bit pair of products multiplied by its scale and added
 * by vpdpwssd: the same exact sums. */
VI void q6k_vnni(int K, const uint8_t *w, const xrow *x, float *out, const int R) {
    __m128 acc = _mm_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0xF), three = _mm512_set1_epi8(3);
    const __m512i shift01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i shift23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * 210;
        for (int l = 0; l < 210; l += 64) _mm_prefetch((const char *)blk + PREFETCH + l, _MM_HINT_T0);
        const float d = halfv(blk + 208);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        __m512i sum[MAXR];
        for (int r = 0; r < R; r++) sum[r] = _mm512_setzero_si512();
        for (int c = 0; c < 2; c++) {
            const __m512i l01 = _mm512_loadu_si512((const void *)(blk + 64 * c));
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c)));
            const __m512i q01 = _mm512_or_si512(_mm512_and_si512(l01, low),
                                                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift01), three), 4));
            const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l01, 4), low),
                                                _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift23), three), 4));
            const __m256i sch = c ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            __m512i s[2];
            for (int k = 0; k < 2; k++)
                s[k] = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_shuffle_epi8(sch, _mm256_loadu_si256((const __m256i *)SHUF_Q6[2 * k]))),
                    _mm256_shuffle_epi8(sch, _mm256_loadu_si256((const __m256i *)SHUF_Q6[2 * k + 1])), 1);
            for (int r = 0; r < R; r++) {
                const int8_t *xq = x[r].q + 256 * b + 128 * c;
                sum[r] = _mm512_dpwssd_epi32(sum[r], _mm512_maddubs_epi16(q01, _mm512_loadu_si512((const void *)xq)), s[0]);
                sum[r] = _mm512_dpwssd_epi32(sum[r], _mm512_maddubs_epi16(q23, _mm512_loadu_si512((const void *)(xq + 64))),
                                             s[1]);
            }
        }
        __m256i total[MAXR];
        for (int r = 0; r < R; r++) total[r] = halves(sum[r]);
        acc = q6k_add(x, b, R, sc16, d, total, acc);
    }
    float o[4];
    _mm_storeu_ps(o, acc);
    for (int r = 0; r < R; r++) out[r] = o[r];
}

BY_ROWS_AT(VT, dot_q6k_vnni, q6k_vnni, 1)
/* BY_ROWS for the group forms: ``call(G, K, w, gbytes, x, out, R)``, G groups, 8 G outputs a row */
#define BY_GROUPS(name, call, G)                                                                       \
    static VT void name(int K, const uint8_t *w, size_t gbytes, const xrow *x, int R, float *out) {    \
        if (R == 4) call(G, K, w, gbytes, x, out, 4);                                                 \
        else if (R == 2) call(G, K, w, gbytes, x, out, 2);                                            \
        else for (int r = 0; r < R; r++) call(G, K, w, gbytes, x + r, out + 8 * (G) * r, 1);          \
    }
#define Q4KV(G, K, w, gbytes, x, out, R) q45k_vnni(0, G, K, w, gbytes, x, out, R)
#define Q5KV(G, K, w, gbytes, x, out, R) q45k_vnni(1, G, K, w, gbytes, x, out, R)
BY_GROUPS(dot8_q4k_vnni, Q4KV, 1)
BY_GROUPS(dot8_q5k_vnni, Q5KV, 1)
BY_GROUPS(dot8_q80_vnni, q80_vnni, 1)
BY_GROUPS(dot16_q4k_vnni, Q4KV, 2)
BY_GROUPS(dot16_q5k_vnni, Q5KV, 2)
BY_GROUPS(dot16_q80_vnni, q80_vnni, 2)
#endif

/* ---- Q6_K widened to bytes, eight rows interleaved (products of many rows) --------------------
 * Made per call from the file's rows, for calls of E8_MIN rows or more, into a thread's scratch: the
 * widening is paid once per 8 rows and tile of x, and each value then costs one vpmaddubsw a row of x.
 * Per group of 8 rows and super-block, E8_Q6K bytes:
 *     0  the rows' d as float32                                   [8]
 *    32  for each 16 columns g: the rows' scale, twice per lane   [16][8][2] int16
 *   544  for each pair of groups k: the rows' (scale 2k, 2k+1)   [8][8][2] int16
 *   800  for each 4 columns t: row i's 4 values (0-63) at lane i [64][8][4] uint8
 * A row's integer total per super-block is the row form's, exactly. */

static GT void q6k_widen8(const uint8_t *const rows[8], int nb, uint8_t *dst) {
    const __m256i low = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3);
    uint8_t vals[8][256] __attribute__((aligned(32)));
    for (int b = 0; b < nb; b++) {
        uint8_t *o = dst + (size_t)b * E8_Q6K;
        int16_t *sp = (int16_t *)(o + 32), *bp = (int16_t *)(o + 544);
        for (int i = 0; i < 8; i++) {
            const uint8_t *blk = rows[i] + (size_t)b * 210;
            const float d = halfv(blk + 208);
            memcpy(o + 4 * i, &d, 4);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int g = 0; g < 16; g++) sp[16 * g + 2 * i] = sp[16 * g + 2 * i + 1] = sc[g];
            for (int k = 0; k < 8; k++) bp[16 * k + 2 * i] = sc[2 * k], bp[16 * k + 2 * i + 1] = sc[2 * k + 1];
            for (int c = 0; c < 2; c++) {
                const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * c));
                const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * c));
                uint8_t *v = vals[i] + 128 * c;
                _mm256_store_si256((__m256i *)v, _mm256_or_si256(_mm256_and_si256(l0, low),
                                   _mm256_slli_epi16(_mm256_and_si256(h, three), 4)));
                _mm256_store_si256((__m256i *)(v + 32), _mm256_or_si256(_mm256_and_si256(l1, low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4)));
                _mm256_store_si256((__m256i *)(v + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4)));
                _mm256_store_si256((__m256i *)(v + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4)));
            }
        }
        /* 8 rows x 8 dwords -> 8 dwords x 8 rows, for each 32 columns */
        for (int j = 0; j < 8; j++) {
            __m256i r[8], t[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_load_si256((const __m256i *)(vals[i] + 32 * j));
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
                r[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
                r[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
                r[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
            }
            /* r[0..3]: rows 0-3, r[4..7]: rows 4-7; dwords (0, 4), (1, 5), (2, 6), (3, 7) by 128-bit half */
            uint8_t *v = o + 800 + 256 * j;
            for (int q = 0; q < 4; q++) {
                _mm256_storeu_si256((__m256i *)(v + 32 * q), _mm256_permute2x128_si256(r[q], r[q + 4], 0x20));
                _mm256_storeu_si256((__m256i *)(v + 32 * (q + 4)), _mm256_permute2x128_si256(r[q], r[q + 4], 0x31));
            }
        }
    }
}

/* A widened Q6_K group's super-block b into the rows' float sums: each row's integer sum less 32 times
 * its scaled x sums (the values' offset), times d x_d. */
GI void q6ke8_add(const uint8_t *blk, const xrow *x, int b, const int R, __m256i *sum, __m256 *acc) {
    const __m256 d8 = _mm256_loadu_ps((const float *)blk);
    for (int r = 0; r < R; r++) {
        const int16_t *bs = x[r].bs + 16 * b;
        __m256i bias = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
            const int pair = (int)((uint32_t)(uint16_t)bs[2 * k] | (uint32_t)(uint16_t)bs[2 * k + 1] << 16);
            bias = _mm256_add_epi32(bias, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(blk + 544 + 32 * k)),
                                                            _mm256_set1_epi32(pair)));
        }
        sum[r] = _mm256_sub_epi32(sum[r], _mm256_slli_epi32(bias, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(x[r].d[b])), _mm256_cvtepi32_ps(sum[r]), acc[r]);
    }
}

/* out [R][8]: the 8 widened rows times R rows of x. Two products of 4 columns add in 16 bits
 * (2 x 2 x 63 x 127 < 32768) before one vpmaddwd by the rows' scales. */
GI void q6ke8_rows(int K, const uint8_t *w, const xrow *x, float *out, const int R) {
    __m256 acc[MAXR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk = w + (size_t)b * E8_Q6K, *vals = blk + 800;
        __m256i sum[MAXR];
        for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
        for (int g = 0; g < 16; g++) {
            const __m256i sp = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * g));
            for (int t = 4 * g; t < 4 * g + 4; t += 2) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(vals + 32 * t));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(vals + 32 * t + 32));
                for (int r = 0; r < R; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, x[r].q + 256 * b + 4 * t, 4);
                    memcpy(&x1, x[r].q + 256 * b + 4 * t + 4, 4);
                    const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(v0, _mm256_set1_epi32(x0)),
                                                         _mm256_maddubs_epi16(v1, _mm256_set1_epi32(x1)));
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(s16, sp));
                }
            }
        }
        q6ke8_add(blk, x, b, R, sum, acc);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

BY_ROWS(dot_q6ke8, q6ke8_rows, 8)

#ifndef LLMD_AVX2
/* q6ke8_rows on the AVX-512 library, for G (1 or 2) widened groups (the second ``gbytes`` after the
 * first): steps t and t + 1 a 512-bit vector, their byte products in 16-bit pairs by one vpmaddubsw,
 * times the group's scales and added into 32 bits by vpdpwssd; a step's permuted x serves every group.
 * The same integer sums and float operations: the same bits. */
VI void q6ke_vnni(const int G, int K, const uint8_t *w, size_t gbytes, const xrow *x, float *out, const int R) {
    __m256 acc[2][MAXR];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) acc[g][r] = _mm256_setzero_ps();
    const __m512i at_t = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int b = 0; b < K / 256; b++) {
        const uint8_t *blk[2] = {w + (size_t)b * E8_Q6K, w + gbytes + (size_t)b * E8_Q6K};
        __m512i sum[2][MAXR];
        for (int g = 0; g < G; g++)
            for (int r = 0; r < R; r++) sum[g][r] = _mm512_setzero_si512();
        for (int c = 0; c < 16; c++) {
            __m512i sp[2];
            for (int g = 0; g < G; g++)
                sp[g] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk[g] + 32 + 32 * c)));
            for (int t = 4 * c; t < 4 * c + 4; t += 2) {
                __m512i v[2];
                for (int g = 0; g < G; g++) v[g] = _mm512_loadu_si512((const void *)(blk[g] + 800 + 32 * t));
                for (int r = 0; r < R; r++) {
                    const __m512i xv = _mm512_permutexvar_epi32(at_t, _mm512_castsi128_si512(
                        _mm_loadl_epi64((const __m128i *)(x[r].q + 256 * b + 4 * t))));
                    for (int g = 0; g < G; g++)
                        sum[g][r] = _mm512_dpwssd_epi32(sum[g][r], _mm512_maddubs_epi16(v[g], xv), sp[g]);
                }
            }
        }
        for (int g = 0; g < G; g++) {
            __m256i total[MAXR];
            for (int r = 0; r < R; r++) total[r] = halves(sum[g][r]);
            q6ke8_add(blk[g], x, b, R, total, acc[g]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) _mm256_storeu_ps(out + 8 * G * r + 8 * g, acc[g][r]);
}
BY_GROUPS(dot_q6ke8_vnni, q6ke_vnni, 1)
BY_GROUPS(dot16_q6ke_vnni, q6ke_vnni, 2)
#endif

/* Q5_K (or Q4_K) 8-row groups (llmd_gg_pack8's layout) widened: the group's 128 bytes of d, dmin and
 * scales as they are, then for each j (0-3) and t (0-7) the low-nibble values (columns 64 j + 4 t ..)
 * and the high-nibble values (columns 64 j + 32 + 4 t ..), 32 bytes each, with Q5_K's fifth bit in. */
static GT void k45_widen8(const int five, const uint8_t *w, int nb, uint8_t *dst) {
    const __m256i low = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
    const int bytes = five ? 1408 : 1152, at = five ? 384 : 128;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)b * bytes;
        uint8_t *o = dst + (size_t)b * E8_K45;
        memcpy(o, blk, 128);
        for (int j = 0; j < 4; j++)
            for (int t = 0; t < 8; t++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + at + (8 * j + t) * 32));
                __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if (five) {
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * t));
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * j + 1), one), 4));
                }
                _mm256_storeu_si256((__m256i *)(o + 128 + (8 * j + t) * 64), lo);
                _mm256_storeu_si256((__m256i *)(o + 160 + (8 * j + t) * 64), hi);
            }
    }
}

/* Whether a part's 8-row groups are widened for a call of M rows. */
static int widened(const llmd_gg_part *part, int M) {
    if (M < E8_MIN) return 0;
#ifndef LLMD_AVX2
    return part->type == T_Q6_K && part->rows % 8 == 0;      /* Q4_K, Q5_K: their VNNI forms are faster */
#else
    return part->type == T_Q5_K_X8 || (part->type == T_Q6_K && part->rows % 8 == 0);     /* Q4_K: no faster */
#endif
}

/* Calls of PAIR_MIN rows of x or more take two 8-row groups at a time. Fewer rows read the weights at
 * the memory's pace, and there one stream a thread reads faster than two: at 1 to 8 rows the one-group
 * forms finish first (python -m llmd.bench.membw, and products of weights larger than the caches). */
#define PAIR_MIN 16

/* Whether a part's 8-row groups are taken two at a time for a call of M rows (the AVX-512 library's
 * Q4_K, Q5_K and Q8_0 forms, and its widened Q6_K), given whether they are widened. */
static int paired(const llmd_gg_part *part, int wide, int M) {
#ifndef LLMD_AVX2
    if (part->rows % 16 || M < PAIR_MIN) return 0;
    return wide ? part->type == T_Q6_K : part->type == T_Q4_K_X8 || part->type == T_Q5_K_X8 || part->type == T_Q8_0_X8;
#else
    (void)part, (void)wide, (void)M;
    return 0;
#endif
}

/* Groups g .. g + n - 1 of a widened part into this thread's buffer, one after another (widened_bytes
 * apart): NULL when out of memory. */
static size_t widened_bytes(int type, int K) { return (size_t)(K / 256) * (type == T_Q6_K ? E8_Q6K : E8_K45); }

static const uint8_t *widen_groups(const llmd_gg_part *part, int g, int n, size_t rowbytes, int K) {
    const int nb = K / 256;
    const size_t each = widened_bytes(part->type, K);
    uint8_t *buf = wide_buffer(n * each);
    if (!buf) return NULL;
    const uint8_t *data = part->data;
    for (int k = 0; k < n; k++, g++) {
        if (part->type != T_Q6_K) {
            k45_widen8(part->type == T_Q5_K_X8, data + (size_t)g * 8 * rowbytes, nb, buf + k * each);
            continue;
        }
        const uint8_t *rows8[8];
        for (int i = 0; i < 8; i++) rows8[i] = data + (size_t)(part->order ? part->order[8 * g + i] : 8 * g + i) * rowbytes;
        q6k_widen8(rows8, nb, buf + k * each);
    }
    return buf;
}

/* G (1, or 2 where paired) 8-row groups, gbytes apart, in the part's layout or widened: 8 G outputs a row.
 * The AVX-512 library's forms take either group count; the AVX2 library's one (it never pairs). */
static void groups_dot(int type, int wide, int G, int K, const uint8_t *w, size_t gbytes, const xrow *x, int R,
                       float *out) {
#ifndef LLMD_AVX2
    if (wide) {                            /* Q6_K: the AVX-512 library widens no other type */
        (G == 2 ? dot16_q6ke_vnni : dot_q6ke8_vnni)(K, w, gbytes, x, R, out);
        return;
    }
    switch (type) {
    case T_Q4_K_X8: (G == 2 ? dot16_q4k_vnni : dot8_q4k_vnni)(K, w, gbytes, x, R, out); return;
    case T_Q5_K_X8: (G == 2 ? dot16_q5k_vnni : dot8_q5k_vnni)(K, w, gbytes, x, R, out); return;
    default: (G == 2 ? dot16_q80_vnni : dot8_q80_vnni)(K, w, gbytes, x, R, out); return;
    }
#endif
    (void)G, (void)gbytes;
    if (wide) {
        (type == T_Q5_K_X8 ? dotw_q5k : dot_q6ke8)(K, w, x, R, out);
        return;
    }
    switch (type) {
    case T_Q4_K_X8: dot8_q4k(K, w, x, R, out); return;
    case T_Q5_K_X8: dot8_q5k(K, w, x, R, out); return;
    default: dot8_q80(K, w, x, R, out);
    }
}

/* ---- entry points ----------------------------------------------------------------------------- */

/* n values of a type as float32 */
static int dequant_values(const void *data, int type, int64_t n, float *out) {
    int bytes, per = type_block(type, &bytes);
    if (!per || n % per) return -1;
    for (int64_t b = 0; b < n / per; b++) dequant_block(type, (const uint8_t *)data + b * bytes, out + b * per);
    return 0;
}

int llmd_gg_rows(const void *data, int type, int K, const int64_t *ids, int C, float *out) {
    int bytes, per = type_block(type, &bytes);
    if (!per || K % per) return -1;
    const size_t row = (size_t)(K / per) * bytes;
    for (int c = 0; c < C; c++) dequant_values((const uint8_t *)data + (size_t)ids[c] * row, type, K, out + (size_t)c * K);
    return 0;
}

/* Rows of x a tile of outputs reads while its quantized rows stay in cache. */
#define M_TILE 64

int llmd_gg_x(const float *x, int M, int K, const llmd_gg_part *parts, int P, float *y, int N, int nt) {
    if (!llmd_cpu_ok() || M < 1 || K < 1 || P < 1 || P > 64 || N < 1) return -1;
    int start[65], need[3] = {0, 0, 0};
    size_t rowbytes[64];
    start[0] = 0;
    for (int p = 0; p < P; p++) {
        int bytes, per = type_block(parts[p].type, &bytes);
        if (!per || K % per || parts[p].rows < 1 || !parts[p].data) return -1;
        if (parts[p].type >= PACKED8 && (parts[p].rows % 8 || parts[p].order)) return -1;
        rowbytes[p] = (size_t)(K / per) * bytes;
        need[type_act(parts[p].type)] = 1;
        start[p + 1] = start[p] + parts[p].rows;
    }
    if (start[P] != N || ((need[A_32] || need[A_256]) && K % 32)) return -1;
    if (need[A_256] && K % 256) return -1;
    /* x's forms: xrow [3][M], then q32, d32, ds32, q256, d256, bs256 */
    const size_t n32 = need[A_32] ? (size_t)M * K : 0, n256 = need[A_256] ? (size_t)M * K : 0;
    const size_t sz_rows = sizeof(xrow) * 3 * (size_t)M;
    const size_t sz = sz_rows + n32 + n32 / 32 * 10 + n256 + n256 / 256 * 4 + n256 / 16 * 2 + n256 / 32 * 2 + 256;
    char *buf = act_buffer(sz);
    if (!buf) return -2;
    xrow *xr = (xrow *)buf;
    int8_t *q32 = (int8_t *)(buf + sz_rows);
    float *d32 = (float *)(q32 + n32), *ds32 = d32 + n32 / 32;
    int8_t *q256 = (int8_t *)(ds32 + n32 / 32);
    float *d256 = (float *)(q256 + n256);
    int16_t *bs256 = (int16_t *)(d256 + n256 / 256), *b32 = bs256 + n256 / 16, *s32q = b32 + n256 / 32;
    #pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)M * K > (1u << 16))
    for (int m = 0; m < M; m++) {
        const float *xm = x + (size_t)m * K;
        xr[m].f = xm;
        if (need[A_32]) {
            xrow *a = xr + M + m;
            int8_t *q = q32 + (size_t)m * K;
            float *d = d32 + (size_t)m * (K / 32), *ds = ds32 + (size_t)m * (K / 32);
            int16_t *s = s32q + (size_t)m * (K / 32);
            for (int b = 0; b < K / 32; b++) {
                d[b] = quantize_span(xm + 32 * b, 32, q + 32 * b);
                s[b] = (int16_t)row_sum(q + 32 * b, 32);
                ds[b] = d[b] * (float)s[b];
            }
            a->q = q, a->d = d, a->ds = ds, a->b32 = s;
        }
        if (need[A_256]) {
            xrow *a = xr + 2 * M + m;
            int8_t *q = q256 + (size_t)m * K;
            float *d = d256 + (size_t)m * (K / 256);
            int16_t *bs = bs256 + (size_t)m * (K / 16);
            for (int b = 0; b < K / 256; b++) d[b] = quantize_span(xm + 256 * b, 256, q + 256 * b);
            for (int g = 0; g < K / 16; g++) bs[g] = (int16_t)row_sum(q + 16 * g, 16);
            int16_t *s32 = b32 + (size_t)m * (K / 32);
            for (int g = 0; g < K / 32; g++) s32[g] = (int16_t)(bs[2 * g] + bs[2 * g + 1]);
            a->q = q, a->d = d, a->bs = bs, a->b32 = s32;
        }
    }
    /* units of work: one output row, a group of 8 for a part in 8-row layout or widened, or two
     * neighbouring groups (16 rows) where a two-group form serves the part */
    int ustart[65], wide[64], pair[64];
    ustart[0] = 0;
    for (int p = 0; p < P; p++) {
        wide[p] = widened(parts + p, M);
        pair[p] = paired(parts + p, wide[p], M);
        ustart[p + 1] = ustart[p] + (pair[p] ? parts[p].rows / 16
                                     : parts[p].type >= PACKED8 || wide[p] ? parts[p].rows / 8 : parts[p].rows);
    }
    const int U = ustart[P];
    int failed = 0;
    #pragma omp parallel num_threads(nt) if ((size_t)N * K > (1u << 18))
    for (int mt = 0; mt < M; mt += M_TILE) {
        const int me = mt + M_TILE < M ? mt + M_TILE : M;
        #pragma omp for schedule(static)
        for (int u = 0; u < U; u++) {
            int p = 0;
            while (u >= ustart[p + 1]) p++;
            const int local = u - ustart[p], type = parts[p].type;
            const xrow *xs = xr + (size_t)type_act(type) * M;
            float out[16 * MAXR];
            if (type >= PACKED8 || wide[p]) {
                const int G = pair[p] ? 2 : 1;           /* 8-row groups a unit takes */
                const uint8_t *w = (const uint8_t *)parts[p].data + (size_t)local * 8 * G * rowbytes[p];
                size_t gbytes = 8 * rowbytes[p];
                const int n0 = start[p] + 8 * G * local;
                /* a widened unit is made once and then takes every row of x, in the first tile's pass:
                 * widening it again for each tile cost more than reading x's rows from further away */
                int m0 = mt, m1 = me;
                if (wide[p]) {
                    if (mt) continue;
                    m0 = 0, m1 = M;
                    gbytes = widened_bytes(type, K);
                    if (!(w = widen_groups(parts + p, G * local, G, rowbytes[p], K))) {
                        #pragma omp atomic write
                        failed = 1;
                        continue;
                    }
                }
                for (int m = m0; m < m1; m += MAXR) {
                    const int R = m1 - m < MAXR ? m1 - m : MAXR;
                    groups_dot(type, wide[p], G, K, w, gbytes, xs + m, R, out);
                    for (int r = 0; r < R; r++)
                        memcpy(y + (size_t)(m + r) * N + n0, out + 8 * G * r, sizeof(float) * 8 * G);
                }
                continue;
            }
            const int row = parts[p].order ? parts[p].order[local] : local;
            const uint8_t *w = (const uint8_t *)parts[p].data + (size_t)row * rowbytes[p];
            const int n = start[p] + local;
            for (int m = mt; m < me; m += MAXR) {
                const int R = me - m < MAXR ? me - m : MAXR;
                dot_row(type, K, w, xs + m, R, out);
                for (int r = 0; r < R; r++) y[(size_t)(m + r) * N + n] = out[r];
            }
        }
    }
    return failed ? -2 : 0;
}
