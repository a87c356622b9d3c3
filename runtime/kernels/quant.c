/* Quantized products, x86-64 with AVX-512: decode rows, verification, batches (int4 and int8g: prompts too).
 *
 * llmd's decode step reads every weight once per token, so its speed is the rate at which weights
 * stream from memory. torch's packed int8/int4 kernels convert and multiply at a rate below that
 * on small machines; these loops keep the arithmetic per weight byte small enough that the memory
 * system is the limit. Rows of the output are split across threads with OpenMP (the same runtime
 * torch uses, loaded once per process). Built and loaded by llmd.runtime.kernels.
 *
 *   int8:  y[m,n] = s[n] * sum_k w[n,k] x[m,k]                 w int8 [N,K], x as 16-bit integers
 *   int4:  y[m,n] = sum_g s[n,g] sum_{k in g} (q[n,k] - 8) x[m,k] + z[n,g] sum_{k in g} x[m,k]
 *          q in [0,15], x as 8-bit integers per block of 128; weights in the layout of llmd_int4_pack
 *   w8a8:  y[m,n] = sx[m] s[n] sum_k w[n,k] xq[m,k]            xq = round(x / sx), sx = max|x| / 127
 * The entry points (llmd_*_x) take 1..8192 rows and K a multiple of 64 (int8, int8g, w8a8: below
 * 65536; int4: of 64 and of its group size G) and return 0, -1 for a CPU or shape they do not take (the
 * caller then uses torch's kernels), -2 out of memory.
 *
 * Batch invariance: every row of x is quantized on its own (its own scales) and each output value
 * y[m, n] is summed by the same code in the same order whatever M is and wherever row m falls in
 * its tile (MANY_ROWS below), so a row's result never depends on the other rows of the call (a
 * request's tokens are the same alone and in a batch). The int8 and w8a8 sums are exact integers.
 */
#include "kernels.h"

int llmd_cpu_ok(void) {
    static int ok = -1;                     /* asked once: every entry point checks it */
    if (ok < 0) {
        __builtin_cpu_init();
        ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
            && __builtin_cpu_supports("avx512vnni");
    }
    return ok;
}

/* Rows of x taken CHUNK_ROWS at a time; within a chunk each output row's weights are used by
 * every tile of up to TILE_ROWS rows while they sit in the first-level cache, so the weights are
 * read from memory once per chunk and never widened to floats. TILE(MM) computes rows m..m+MM-1 of
 * x against output row n; each row's sums are its own (see batch invariance above). */
#define CHUNK_ROWS 64
#define TILE_ROWS 4
#define MANY_ROWS(TILE) \
    for (int c0 = 0; c0 < M; c0 += CHUNK_ROWS) { \
        const int c1 = c0 + CHUNK_ROWS < M ? c0 + CHUNK_ROWS : M; \
        _Pragma("omp parallel for num_threads(nt) schedule(static)") \
        for (int n = 0; n < N; n++) \
            for (int m = c0; m < c1; m += TILE_ROWS) { \
                switch (c1 - m) { \
                case 1: TILE(1) break; \
                case 2: TILE(2) break; \
                case 3: TILE(3) break; \
                default: TILE(4) break; \
                } \
            } \
    }

/* ---- int8 weights, 16-bit integer activations ------------------------------------------- */
/* x is carried per row as 16-bit integers, xi = round(x / sx) with sx = max|x| / 32767 (finer than
 * the bfloat16 that torch's int8 kernel rounds x to), split into a signed high byte and an
 * unsigned low byte, xi = 256 * hi + lo. vpdpbusd multiplies unsigned by signed bytes: lo enters
 * as it is; hi enters as |hi| with its sign moved onto the weight (w negated where hi < 0).
 * Both sums are exact in int32 for K < 2^16. Columns go 64 at a time into two accumulators in
 * turn (independent chains); K a multiple of 64. */

static inline TARGET __attribute__((always_inline))
void int8_row(const uint8_t *xh, const uint8_t *xl, const uint64_t *neg, const float *sx, const int MM, int K,
              const int8_t *w, float s, float b, float *y, int N) {
    __m512i ah[TILE_ROWS][2], al[TILE_ROWS][2];
    const __m512i zero = _mm512_setzero_si512();
    for (int m = 0; m < TILE_ROWS; m++) ah[m][0] = ah[m][1] = al[m][0] = al[m][1] = zero;
    for (int c = 0; c < K; c += 128)
        for (int j = 0; j < 2 && c + 64 * j < K; j++) {     /* j constant once unrolled: registers, not memory */
            const __m512i wv = _mm512_loadu_si512((const void *)(w + c + 64 * j));
            for (int m = 0; m < MM; m++) {
                const size_t at = (size_t)m * K + c + 64 * j;
                const __m512i ws = _mm512_mask_sub_epi8(wv, neg[at / 64], zero, wv);
                ah[m][j] = _mm512_dpbusd_epi32(ah[m][j], _mm512_loadu_si512((const void *)(xh + at)), ws);
                al[m][j] = _mm512_dpbusd_epi32(al[m][j], _mm512_loadu_si512((const void *)(xl + at)), wv);
            }
        }
    for (int m = 0; m < MM; m++) {
        const float hi = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(ah[m][0], ah[m][1]));
        const float lo = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(al[m][0], al[m][1]));
        y[(size_t)m * N] = (256.f * hi + lo) * (sx[m] * s) + b;
    }
}

#define INT8_TILE(MM) int8_row(xh + (size_t)m * K, xl + (size_t)m * K, neg + (size_t)m * (K / 64), sx + m, MM, K, \
                               w + (size_t)n * K, s[n], bias ? bias[n] : 0.f, y + (size_t)m * N + n, N);

/* x float32 [M,K] -> |hi| and lo bytes, sign masks of hi (one bit per column), scales sx [M]. */
static TARGET void x16_quantize(const float *x, int M, int K, uint8_t *xh, uint8_t *xl, uint64_t *neg, float *sx) {
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * K;
        const float scale = sx[m] = row_scale(r, K, 32767.f);
        const __m512 inv = _mm512_set1_ps(1.f / scale);
        for (int k = 0; k < K; k += 64) {
            uint64_t bits = 0;
            for (int j = 0; j < 4; j++) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + k + 16 * j), inv));
                q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)), _mm512_set1_epi32(-32767));
                __m512i h = _mm512_srai_epi32(q, 8), l = _mm512_and_si512(q, _mm512_set1_epi32(255));
                bits |= (uint64_t)_mm512_cmplt_epi32_mask(h, _mm512_setzero_si512()) << (16 * j);
                size_t at = (size_t)m * K + k + 16 * j;
                _mm_storeu_si128((__m128i *)(xh + at), _mm512_cvtepi32_epi8(_mm512_abs_epi32(h)));
                _mm_storeu_si128((__m128i *)(xl + at), _mm512_cvtepi32_epi8(l));
            }
            neg[((size_t)m * K + k) / 64] = bits;
        }
    }
}

static TARGET void int8_rows(const uint8_t *xh, const uint8_t *xl, const uint64_t *neg, const float *sx, int M, int K,
                             const int8_t *w, const float *s, const float *bias, float *y, int N, int nt) {
    MANY_ROWS(INT8_TILE);
}

/* ---- int8 weights with a scale per group of G columns, 16-bit integer activations --------- */
/* As the int8 product above, with w = q * s[n, g]: the output head, whose rows (a tied embedding's
 * token vectors) carry outliers that a single scale per row rounds coarsely. Per group the hi and
 * lo sums are combined exactly in int32 (|256 hi + lo| < 2^31 for G <= 256) and scaled once.
 * G is 64, 128 or 256. */

static inline TARGET __attribute__((always_inline))
void int8g_row(const uint8_t *xh, const uint8_t *xl, const uint64_t *neg, const float *sx, const int MM, int K,
               int G, const int8_t *w, const float *s, float b, float *y, int N) {
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[TILE_ROWS];
    for (int m = 0; m < TILE_ROWS; m++) acc[m] = _mm512_setzero_ps();
    for (int g0 = 0; g0 < K; g0 += G) {
        __m512i d[TILE_ROWS];
        for (int m = 0; m < TILE_ROWS; m++) d[m] = zero;
        for (int c = g0; c < g0 + G; c += 64) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + c));
            for (int m = 0; m < MM; m++) {
                const size_t at = (size_t)m * K + c;
                const __m512i ws = _mm512_mask_sub_epi8(wv, neg[at / 64], zero, wv);
                const __m512i dh = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512((const void *)(xh + at)), ws);
                const __m512i dl = _mm512_dpbusd_epi32(zero, _mm512_loadu_si512((const void *)(xl + at)), wv);
                d[m] = _mm512_add_epi32(d[m], _mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl));
            }
        }
        const float sg = s[g0 / G];
        for (int m = 0; m < MM; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[m]), _mm512_set1_ps(sg * sx[m]), acc[m]);
    }
    for (int m = 0; m < MM; m++) y[(size_t)m * N] = _mm512_reduce_add_ps(acc[m]) + b;
}

#define INT8G_TILE(MM) int8g_row(xh + (size_t)m * K, xl + (size_t)m * K, neg + (size_t)m * (K / 64), sx + m, MM, \
                                 K, G, w + (size_t)n * K, s + (size_t)n * (K / G), bias ? bias[n] : 0.f, \
                                 y + (size_t)m * N + n, N);

static TARGET void int8g_rows(const uint8_t *xh, const uint8_t *xl, const uint64_t *neg, const float *sx, int M,
                              int K, int G, const int8_t *w, const float *s, const float *bias, float *y, int N,
                              int nt) {
    MANY_ROWS(INT8G_TILE);
}

/* ---- int4 weights, 8-bit activations per block of 128 columns ---------------------------- */
/* Layout: each 128 columns of a row are 64 bytes; byte j holds q[c+j] | q[c+64+j] << 4, so the
 * low nibbles of a line are 64 consecutive columns and the high nibbles the next 64. Where K is
 * 64 past a multiple of 128 (SmolLM2's 576), its last 64 columns are a half line of 32 bytes, byte
 * j holding q[c+j] | q[c+32+j] << 4. x is quantized per block b of 128 columns (the half line: 64),
 * xq = round(x / sx[b]), sx[b] = max|x in b| / 127 (as for the weights, the error is bounded by
 * the block, not the row). The weights take vpdpbusd's unsigned side as they are. Per row n and
 * half-line h (64 columns, inside weight group g):
 *   sum_k ((q - 8) s + z) x = s sx[b] sum_k q xq + (z - 8 s) X[h],   X[h] = sx[b] sum_{k in h} xq
 * and the last term summed over a group is (z - 8 s) X[g].
 * G is 32, 64, 128 or 256 (a half line: 64, or 32). With G = 32 each 64 columns hold two groups:
 * vpdpbusd sums 4 columns into a lane, so lanes 0-7 hold the first group's and lanes 8-15 the
 * second's, and one vector of two scales (one per half) scales both. */

TARGET void llmd_int4_pack(const uint8_t *q, int N, int K, uint8_t *out) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < K; c += 128) {
            const int half = K - c < 128 ? 32 : 64;       /* bytes of this line */
            const uint8_t *r = q + (size_t)n * K + c;
            for (int j = 0; j < half; j++)
                out[((size_t)n * K + c) / 2 + j] = (uint8_t)(r[j] | r[half + j] << 4);
        }
}

/* x float32 [M,K] -> xq int8 [M,K], block scales sx [M, ceil(K/128)], and the sums X of sx xq over
 * each weight group [M, K/G] (integer sums per 32 columns, exact; G = 32 scales each alone). */
static TARGET void x8_blocks(const float *x, int M, int K, int G, int8_t *xq, float *sx, float *xs) {
    const int nb = (K + 127) / 128;
    memset(xs, 0, sizeof(float) * (size_t)M * (K / G));
    for (int m = 0; m < M; m++)
        for (int c = 0; c < K; c += 128) {
            const float *r = x + (size_t)m * K + c;
            const int width = K - c < 128 ? 64 : 128;
            const float scale = sx[(size_t)m * nb + c / 128] = row_scale(r, width, 127.f);
            const __m512 inv = _mm512_set1_ps(1.f / scale);
            for (int h = 0; h < width / 64; h++) {
                __m512i sum[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int k = 64 * h; k < 64 * h + 64; k += 16) {
                    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + k), inv));
                    q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                    sum[(k - 64 * h) / 32] = _mm512_add_epi32(sum[(k - 64 * h) / 32], q);
                    _mm_storeu_si128((__m128i *)(xq + (size_t)m * K + c + k), _mm512_cvtepi32_epi8(q));
                }
                const int s0 = _mm512_reduce_add_epi32(sum[0]), s1 = _mm512_reduce_add_epi32(sum[1]);
                float *to = xs + (size_t)m * (K / G) + (c + 64 * h) / G;
                if (G == 32) {
                    to[0] += scale * (float)s0;
                    to[1] += scale * (float)s1;
                } else {
                    to[0] += scale * (float)(s0 + s1);
                }
            }
        }
}

/* One line of 128 columns for MM rows of x into acc. With SPLIT 1 the two halves lie in different
 * weight groups (G = 64) and are scaled apart; with SPLIT 2 (G = 32) each half is scaled by a
 * vector of its two groups' scales (lanes 0-7, 8-15); otherwise their sums are added first. Row m
 * of x: xq + m K, its block scales sx + m nb. */
#define HALVES 0xFF00
#define INT4_LINE(c, acc, SPLIT) do { \
    __m512i v = _mm512_loadu_si512((const void *)(w + (c) / 2)); \
    __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib); \
    const float s0 = s[(c) >> gshift], s1 = s[((c) + 64) >> gshift]; \
    __m512 sv0 = _mm512_setzero_ps(), sv1 = _mm512_setzero_ps(); \
    if (SPLIT == 2) { \
        sv0 = _mm512_mask_blend_ps(HALVES, _mm512_set1_ps(s0), _mm512_set1_ps(s[((c) >> 5) + 1])); \
        sv1 = _mm512_mask_blend_ps(HALVES, _mm512_set1_ps(s1), _mm512_set1_ps(s[((c) >> 5) + 3])); \
    } \
    for (int m = 0; m < MM; m++) { \
        const int8_t *xr = xq + (size_t)m * K + (c); \
        const float bs = sx[(size_t)m * nb + (c) / 128]; \
        __m512i d0 = _mm512_dpbusd_epi32(zero, lo, _mm512_loadu_si512((const void *)xr)); \
        if (SPLIT == 2) { \
            __m512i d1 = _mm512_dpbusd_epi32(zero, hi, _mm512_loadu_si512((const void *)(xr + 64))); \
            const __m512 bv = _mm512_set1_ps(bs); \
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(sv0, bv), acc[m]); \
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_mul_ps(sv1, bv), acc[m]); \
        } else if (SPLIT) { \
            __m512i d1 = _mm512_dpbusd_epi32(zero, hi, _mm512_loadu_si512((const void *)(xr + 64))); \
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_set1_ps(s0 * bs), acc[m]); \
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(s1 * bs), acc[m]); \
        } else { \
            d0 = _mm512_dpbusd_epi32(d0, hi, _mm512_loadu_si512((const void *)(xr + 64))); \
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_set1_ps(s0 * bs), acc[m]); \
        } \
    } } while (0)

/* The half line of the last 64 columns (one group, or with G = 32 two: the low nibbles' and the
 * high nibbles'), in the low half of each vector. */
#define INT4_HALF_LINE(c, acc, SPLIT) do { \
    const __mmask64 half = 0xFFFFFFFFull; \
    __m512i v = _mm512_maskz_loadu_epi8(half, (const void *)(w + (c) / 2)); \
    __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib); \
    const float s0 = s[(c) >> gshift]; \
    for (int m = 0; m < MM; m++) { \
        const int8_t *xr = xq + (size_t)m * K + (c); \
        const float bs = sx[(size_t)m * nb + (c) / 128]; \
        __m512i d = _mm512_dpbusd_epi32(zero, lo, _mm512_maskz_loadu_epi8(half, (const void *)xr)); \
        if (SPLIT == 2) { \
            const __m512i d1 = _mm512_dpbusd_epi32(zero, hi, _mm512_maskz_loadu_epi8(half, (const void *)(xr + 32))); \
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(s0 * bs), acc[m]); \
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(s[((c) >> 5) + 1] * bs), acc[m]); \
        } else { \
            d = _mm512_dpbusd_epi32(d, hi, _mm512_maskz_loadu_epi8(half, (const void *)(xr + 32))); \
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(s0 * bs), acc[m]); \
        } \
    } } while (0)

#define INT4_LINES(SPLIT) do { \
    int c = 0; \
    for (; c + 256 <= K; c += 256) {       /* two lines, two accumulators: independent chains */ \
        INT4_LINE(c, a0, SPLIT); \
        INT4_LINE(c + 128, a1, SPLIT); \
    } \
    if (c + 128 <= K) { INT4_LINE(c, a0, SPLIT); c += 128; } \
    if (c < K) INT4_HALF_LINE(c, a1, SPLIT); } while (0)

static inline TARGET __attribute__((always_inline))
void int4_row(const int8_t *xq, const float *sx, const float *xs, const int MM, int K, int gshift,
              const uint8_t *w, const float *s, const float *off, float b, float *y, int N) {
    const __m512i nib = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    const int nb = (K + 127) / 128, groups = K >> gshift;
    __m512 a0[TILE_ROWS], a1[TILE_ROWS];
    for (int m = 0; m < TILE_ROWS; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    if (gshift == 5) INT4_LINES(2); else if (gshift == 6) INT4_LINES(1); else INT4_LINES(0);
    for (int m = 0; m < MM; m++) {
        for (int i = 0; i < groups; i += 16) {     /* the offsets, in the same vector as the rest */
            __mmask16 k = groups - i >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - i)) - 1);
            a1[m] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, off + i), _mm512_maskz_loadu_ps(k, xs + (size_t)m * groups + i), a1[m]);
        }
        y[(size_t)m * N] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m])) + b;
    }
}

#define INT4_TILE(MM) int4_row(xq + (size_t)m * K, sx + (size_t)m * nb, xs + (size_t)m * groups, MM, K, gshift, \
                               w + (size_t)n * K / 2, s + (size_t)n * groups, off + (size_t)n * groups, \
                               bias ? bias[n] : 0.f, y + (size_t)m * N + n, N);

/* xq, sx, xs from x8_blocks; w [N, K/2] in the layout above; s, off: [N, K/G] scales and z - 8 s;
 * G = 2^gshift. */
static TARGET void int4_rows(const int8_t *xq, const float *sx, const float *xs, int M, int K, int gshift,
                             const uint8_t *w, const float *s, const float *off, const float *bias,
                             float *y, int N, int nt) {
    const int groups = K >> gshift, nb = (K + 127) / 128;
    MANY_ROWS(INT4_TILE);
}

/* ---- int8 weights, int8 activations (w8a8) ---------------------------------------------- */
/* vpdpbusd multiplies unsigned by signed bytes: x enters as |xq| (unsigned) and its sign moves
 * onto the weight (w negated where xq < 0), so the sum is exact in int32. */

static inline TARGET __attribute__((always_inline))
void w8a8_row(const uint8_t *xa, const uint64_t *neg, const float *sx, const int MM, int K, const int8_t *w,
              float s, float b, float *y, int N) {
    __m512i acc[TILE_ROWS][2];
    const __m512i zero = _mm512_setzero_si512();
    for (int m = 0; m < TILE_ROWS; m++) acc[m][0] = acc[m][1] = zero;
    for (int c = 0; c < K; c += 128)
        for (int j = 0; j < 2 && c + 64 * j < K; j++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + c + 64 * j));
            for (int m = 0; m < MM; m++) {
                const size_t at = (size_t)m * K + c + 64 * j;
                const __m512i ws = _mm512_mask_sub_epi8(wv, neg[at / 64], zero, wv);
                acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], _mm512_loadu_si512((const void *)(xa + at)), ws);
            }
        }
    for (int m = 0; m < MM; m++)
        y[(size_t)m * N] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(acc[m][0], acc[m][1])) * (sx[m] * s) + b;
}

#define W8A8_TILE(MM) w8a8_row(xa + (size_t)m * K, neg + (size_t)m * (K / 64), sx + m, MM, K, w + (size_t)n * K, \
                               s[n], bias ? bias[n] : 0.f, y + (size_t)m * N + n, N);

/* x float32 [M,K] -> |xq| bytes, sign masks (one bit per column), per-row scales sx. */
static TARGET void w8a8_quantize(const float *x, int M, int K, uint8_t *xa, uint64_t *neg, float *sx) {
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * K;
        const float scale = sx[m] = row_scale(r, K, 127.f);
        const __m512 sv = _mm512_set1_ps(scale);
        for (int k = 0; k < K; k += 64) {
            uint64_t bits = 0;
            for (int j = 0; j < 4; j++) {
                __m512 v = _mm512_div_ps(_mm512_loadu_ps(r + k + 16 * j), sv);
                __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                bits |= (uint64_t)_mm512_cmplt_epi32_mask(q, _mm512_setzero_si512()) << (16 * j);
                _mm_storeu_si128((__m128i *)(xa + (size_t)m * K + k + 16 * j), _mm512_cvtepi32_epi8(_mm512_abs_epi32(q)));
            }
            neg[((size_t)m * K + k) / 64] = bits;
        }
    }
}

static TARGET void w8a8_rows(const uint8_t *xa, const uint64_t *neg, const float *sx, int M, int K, const int8_t *w,
                             const float *s, const float *bias, float *y, int N, int nt) {
    MANY_ROWS(W8A8_TILE);
}

/* ---- one call per product: quantize x into per-thread scratch, then multiply --------------- */
/* The scratch grows to the largest row seen and is kept for the thread's life, so a decode step
 * allocates nothing here; the caller passes x as float32 and gets y. */

static __thread void *scratch;
static __thread size_t scratch_bytes;

static void *scratch_for(size_t bytes) {
    if (bytes > scratch_bytes) {
        void *p = realloc(scratch, bytes);
        if (!p) return 0;
        scratch = p;
        scratch_bytes = bytes;
    }
    return scratch;
}

/* The shapes the int8 (and w8a8) products take: 1..MANY_MAX_ROWS rows of x, K a multiple of 64 below 2^16. */
#define MANY_MAX_ROWS 8192
static int takes(int M, int K) {
    return llmd_cpu_ok() && M >= 1 && M <= MANY_MAX_ROWS && K % 64 == 0 && K > 0 && K < 65536;
}

/* x16_quantize into the thread's scratch; 0, or -2 out of memory. */
static TARGET int x16_in_scratch(const float *x, int M, int K, uint8_t **xh, uint8_t **xl, uint64_t **neg,
                                 float **sx) {
    uint8_t *p = scratch_for((size_t)M * K * 2 + (size_t)M * (K / 64) * 8 + (size_t)M * 4 + 64);
    if (!p) return -2;
    *xh = p;
    *xl = p + (size_t)M * K;
    *neg = (uint64_t *)(*xl + (size_t)M * K);
    *sx = (float *)(*neg + (size_t)M * (K / 64));
    x16_quantize(x, M, K, *xh, *xl, *neg, *sx);
    return 0;
}

TARGET int llmd_int8_x(const float *x, int M, int K, const int8_t *w, const float *s, const float *bias, float *y,
                       int N, int nt) {
    if (!takes(M, K)) return -1;
    uint8_t *xh, *xl;
    uint64_t *neg;
    float *sx;
    if (x16_in_scratch(x, M, K, &xh, &xl, &neg, &sx)) return -2;
    int8_rows(xh, xl, neg, sx, M, K, w, s, bias, y, N, nt);
    return 0;
}

TARGET int llmd_int8g_x(const float *x, int M, int K, int G, const int8_t *w, const float *s, const float *bias,
                        float *y, int N, int nt) {
    if (!takes(M, K) || (G != 64 && G != 128 && G != 256) || K % G) return -1;
    uint8_t *xh, *xl;
    uint64_t *neg;
    float *sx;
    if (x16_in_scratch(x, M, K, &xh, &xl, &neg, &sx)) return -2;
    int8g_rows(xh, xl, neg, sx, M, K, G, w, s, bias, y, N, nt);
    return 0;
}

TARGET int llmd_int4_x(const float *x, int M, int K, int G, const uint8_t *w, const float *s, const float *off,
                       const float *bias, float *y, int N, int nt) {
    int gshift = 5;
    while (gshift < 9 && (1 << gshift) != G) gshift++;
    if (!llmd_cpu_ok() || M < 1 || M > MANY_MAX_ROWS || K < 64 || gshift == 9 || K % G || K % 64)
        return -1;  /* G: 32, 64, 128, 256 */
    const int nb = (K + 127) / 128;
    float *sx = scratch_for((size_t)M * nb * 4 + (size_t)M * (K / G) * 4 + (size_t)M * K + 64);
    if (!sx) return -2;
    float *xs = sx + (size_t)M * nb;
    int8_t *xq = (int8_t *)(xs + (size_t)M * (K / G));
    x8_blocks(x, M, K, G, xq, sx, xs);
    int4_rows(xq, sx, xs, M, K, gshift, w, s, off, bias, y, N, nt);
    return 0;
}

TARGET int llmd_w8a8_x(const float *x, int M, int K, const int8_t *w, const float *s, const float *bias, float *y,
                       int N, int nt) {
    if (!takes(M, K)) return -1;
    uint8_t *xa = scratch_for((size_t)M * K + (size_t)M * (K / 64) * 8 + (size_t)M * 4 + 64);
    if (!xa) return -2;
    uint64_t *neg = (uint64_t *)(xa + (size_t)M * K);
    float *sx = (float *)(neg + (size_t)M * (K / 64));
    w8a8_quantize(x, M, K, xa, neg, sx);
    w8a8_rows(xa, neg, sx, M, K, w, s, bias, y, N, nt);
    return 0;
}
