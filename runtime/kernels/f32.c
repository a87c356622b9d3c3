/* Float32 products of up to 16 rows over weights stored in blocks of 64 output columns. */
#include "kernels.h"

/* ---- float32 weights in blocks of 64 output columns ------------------------------------- */
/* The weight is stored as [N/64, K, 64]: block b holds W[k, 64b:64b+64] for every k, one after
 * another, so each thread streams whole blocks front to back. y[m, block] = sum_k x[m,k] W[k, block]:
 * x broadcast, one FMA per 16 weights, no reductions. N a multiple of 64.
 *
 * The same blocks may hold bfloat16 values (wide = 0): a float32 weight whose every value is a
 * bfloat16 (a checkpoint stored in bfloat16 and served in float32) is kept in half the bytes and
 * widened exactly on load, so the products are the float32 ones, bit for bit, from half the memory
 * traffic (where AMX multiplies bfloat16 they take the tile unit instead: see bf16_amx). */

#define F32_GROUP 6       /* most rows in a group (see F32_MAXM below) */
#define F32_AHEAD 48      /* rows of a bfloat16 block fetched ahead of the one summed */

/* Row k's sixteen weights j of a block: float32, or bfloat16 widened (its bits are a float32's top half). */
static inline TARGET __attribute__((always_inline)) __m512 weights16(const void *w, size_t at, const int wide) {
    if (wide) return _mm512_loadu_ps((const float *)w + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + at));
#ifdef LLMD_AVX2
    /* each value under a zero half: one unpack per eight, the halves holding weights 0-3, 8-11 and
     * 4-7, 12-15 (lanes_ordered puts the sums back in order) */
    const __m256i z = _mm256_setzero_si256();
    return (__m512){_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h))};
#else
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#endif
}

/* Sixteen lanes in the order weights16 gives bfloat16 weights in (wide 0, AVX2), or back: the same swap
 * of the middle two quarters both ways. */
static inline TARGET __attribute__((always_inline)) __m512 lanes_ordered(__m512 v, const int wide) {
#ifdef LLMD_AVX2
    if (!wide) return (__m512){_mm256_permute2f128_ps(v.lo, v.hi, 0x20), _mm256_permute2f128_ps(v.lo, v.hi, 0x31)};
#else
    (void)wide;
#endif
    return v;
}

/* Row k's 64 weights of a block in four vectors, and the block's outputs back in column order. AVX-512
 * widens bfloat16 weights by one unpack per sixteen (each value under a zero half), so vector 2h holds
 * columns 32h + {0-3, 8-11, 16-19, 24-27} and vector 2h + 1 columns 32h + {4-7, 12-15, 20-23, 28-31}:
 * block_in puts a block's bias in that order, block_out its sums back. Elsewhere (float32 blocks, and
 * AVX2 with its own order per vector) the vectors hold columns 16j..16j+15 as weights16 gives them. */
static inline TARGET __attribute__((always_inline)) void block_row(const void *w, int k, const int wide, __m512 wv[4]) {
#ifndef LLMD_AVX2
    if (!wide) {
        const __m512i z = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_loadu_si512((const void *)((const uint16_t *)w + (size_t)k * 64 + 32 * h));
            wv[2 * h] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v));
            wv[2 * h + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v));
        }
        return;
    }
#endif
    for (int j = 0; j < 4; j++) wv[j] = weights16(w, (size_t)k * 64 + 16 * j, wide);
}

static inline TARGET __attribute__((always_inline)) void block_in(const float *bias, const int wide, __m512 b[4]) {
    for (int j = 0; j < 4; j++) b[j] = bias ? lanes_ordered(_mm512_loadu_ps(bias + 16 * j), wide) : _mm512_setzero_ps();
#ifndef LLMD_AVX2
    if (!wide && bias) {
        const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
        const __m512i hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
        for (int h = 0; h < 2; h++) {
            const __m512 a = b[2 * h], c = b[2 * h + 1];
            b[2 * h] = _mm512_permutex2var_ps(a, lo, c);
            b[2 * h + 1] = _mm512_permutex2var_ps(a, hi, c);
        }
    }
#endif
}

static inline TARGET __attribute__((always_inline)) void block_out(float *y, const int wide, const __m512 acc[4]) {
#ifndef LLMD_AVX2
    if (!wide) {
        const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        for (int h = 0; h < 2; h++) {
            _mm512_storeu_ps(y + 32 * h, _mm512_permutex2var_ps(acc[2 * h], first, acc[2 * h + 1]));
            _mm512_storeu_ps(y + 32 * h + 16, _mm512_permutex2var_ps(acc[2 * h], second, acc[2 * h + 1]));
        }
        return;
    }
#endif
    for (int j = 0; j < 4; j++) _mm512_storeu_ps(y + 16 * j, lanes_ordered(acc[j], wide));
}

static inline TARGET __attribute__((always_inline))
void f32_block(const float *x, const int MM, int K, const void *w, const float *bias, float *y, int N,
               const void *next, int part, int parts, const int wide) {
    const int es = wide ? 4 : 2;
#ifdef LLMD_AVX2
    if (!wide && MM > 3 && (MM > 4 || parts > 1)) {
        /* AVX2 has 16 registers, too few for a group's sums over the whole block (each __m512 is two):
         * a quarter of the block (16 outputs) at a time, each row's sums in two registers and the
         * quarter's weights in two more, so no sum waits on memory. Each output's FMAs are the same, in
         * the same order. The first quarter's pass fetches the rest of each row for the later ones, and
         * the next block as below. Taken where arithmetic bounds the group (bfloat16 blocks, five or
         * six rows, or four from cache); float32 blocks and fewer rows stream faster the other way. */
        for (int j = 0; j < 4; j++) {
            const __m512 b = bias ? lanes_ordered(_mm512_loadu_ps(bias + 16 * j), wide) : _mm512_setzero_ps();
            __m512 acc[F32_GROUP];
            for (int m = 0; m < MM; m++) acc[m] = b;
            for (int k = 0, due = part; k < K; k++) {
                if (j == 0) {
                    /* the rest of row k for the later quarters: the block streams in whole from memory */
                    for (int i = 64; i < 64 * es; i += 64) _mm_prefetch((const char *)w + (size_t)k * 64 * es + i, _MM_HINT_T0);
                    if (next && k == due) {
                        for (int i = 0; i < 64 * es; i += 64) _mm_prefetch((const char *)next + (size_t)k * 64 * es + i, _MM_HINT_T1);
                        due += parts;
                    }
                }
                const __m512 wv = weights16(w, (size_t)k * 64 + 16 * j, wide);
                for (int m = 0; m < MM; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)m * K + k]), wv, acc[m]);
            }
            for (int m = 0; m < MM; m++) _mm512_storeu_ps(y + (size_t)m * N + 16 * j, lanes_ordered(acc[m], wide));
        }
        return;
    }
#endif
    __m512 acc[F32_GROUP][4], b[4];
    block_in(bias, wide, b);
    for (int m = 0; m < MM; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = b[j];
    for (int k = 0; k < K; k++) {
        /* bfloat16 blocks, the first row group (the one that reads the block from memory): row
         * k + F32_AHEAD fetched now (past the block's end, the start of the thread's next block), more
         * reads in flight than the hardware's prefetch keeps where each row's arithmetic is short;
         * float32 rows are long enough without it */
        if (!wide && part == 0)
            for (int j = 0; j < 64 * es; j += 64)
                _mm_prefetch((const char *)w + ((size_t)k + F32_AHEAD) * 64 * es + j, _MM_HINT_T0);
        /* the next block's row k, fetched into L2 by one of this block's row groups, so memory
         * keeps streaming while the later groups compute from cache */
        if (next && k % parts == part)
            for (int j = 0; j < 64 * es; j += 64) _mm_prefetch((const char *)next + (size_t)k * 64 * es + j, _MM_HINT_T1);
        __m512 wv[4];
        block_row(w, k, wide, wv);
        for (int m = 0; m < MM; m++) {
            __m512 xb = _mm512_set1_ps(x[(size_t)m * K + k]);
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(xb, wv[j], acc[m][j]);
        }
    }
    for (int m = 0; m < MM; m++) block_out(y + (size_t)m * N, wide, acc[m]);
}

#define F32_CASE(MM) f32_block(x + (size_t)m0 * K, MM, K, (const char *)w + (size_t)b * K * 64 * es, \
                            bias ? bias + 64 * b : 0, y + (size_t)m0 * N + 64 * b, N, next, gi, groups, wide);

/* Up to F32_MAXM rows, in groups of four rows per block, so a block is read from memory once and
 * from cache for the later groups (verification of a few proposals, small batches). Where fours would
 * leave a group of one or two rows, whose sums wait on each FMA's latency, the rows are shared out
 * over one group fewer, of five or six: five rows (four proposals verified) take 0.81x the time of
 * four and one, nine rows 0.90x (`bench/bench_kernels.py --products 5,9`). From eleven rows the groups
 * are of five or six: fewer passes over the block, and each bfloat16 weight widened for more rows
 * (sixteen rows in three groups, not four). The same sums: each row's order over k is unchanged. */
#define F32_MAXM 16

/* ---- bfloat16 blocks on AMX -------------------------------------------------------------- */
/* Where the CPU has AMX with bfloat16 products, every product over bfloat16 blocks takes the tile unit,
 * whatever its row count: decode rows, verification, prompt chunks and steps that mix them all sum in
 * one way, so a row's numbers never depend on the rows beside it, and no float32 copy of the weight is
 * kept for prompts. The tile unit multiplies bfloat16 by bfloat16 and sums in float32, so each float32
 * row of x is split into three bfloat16 parts, x = hi + mid + lo (each the rounded remainder of the
 * ones before: all 24 bits of x), every product of a bfloat16 weight and a part is exact in float32,
 * and y = (W hi + W mid) + W lo + bias, each W part summed in float32 by the tile unit over steps of 32
 * columns in order. That is a float32 product (within float32 rounding of the exact one), though not
 * the vector loop's bits: the tile unit sums in its own order.
 * The parts are the rows of the left-hand tiles, 15 to a tile (five rows of x), 3 M rows in all; a
 * block's 64 columns are interleaved in pairs of rows of k (the right-hand layout) step by step into a
 * buffer in L1 where one pass reads each block (up to 10 rows of x), or once per block into a buffer in
 * L2 that the passes share. */
#define BF16_MANY_ROWS 8192

#if defined(LLMD_AMX) && (__has_include(<amxbf16intrin.h>) || __has_include(<amxintrin.h>))
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16")))

static int bf16_amx_usable(void) {
    static int ok = -1;
    if (ok < 0) {
        unsigned a, b, c, d, a1, b1, c1, d1;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        __asm__ volatile("cpuid" : "=a"(a1), "=b"(b1), "=c"(c1), "=d"(d1) : "a"(7), "c"(1));
        ok = amx_usable() && (d >> 22 & 1) && (a1 >> 5 & 1);       /* AMX-BF16, AVX512-BF16 */
    }
    return ok;
}

/* A thread's buffers (0: x's parts, 1: a block's tiles), kept from call to call, 64-byte aligned. */
static __thread void *bf16_buffer[2];
static __thread size_t bf16_buffer_bytes[2];

static void *bf16_scratch(int which, size_t bytes) {
    if (bytes > bf16_buffer_bytes[which]) {
        free(bf16_buffer[which]);
        bf16_buffer[which] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        bf16_buffer_bytes[which] = bf16_buffer[which] ? bytes : 0;
    }
    return bf16_buffer[which];
}

/* x's rows [M, K] as bfloat16 parts xs [MP][3][KP] (row 3m + part of the left-hand tiles), rows past M
 * and columns past K zero */
static BF16_TARGET void bf16_parts(const float *x, int M, int MP, int K, int KP, uint16_t *xs, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)M * K > (1u << 16))
    for (int m = 0; m < MP; m++) {
        uint16_t *o = xs + (size_t)m * 3 * KP;
        if (m >= M) {
            memset(o, 0, (size_t)3 * KP * 2);
            continue;
        }
        for (int k = 0; k < KP; k += 16) {
            const __mmask16 in = K - k >= 16 ? 0xffff : K > k ? (__mmask16)((1u << (K - k)) - 1) : 0;
            const __m512 v = _mm512_maskz_loadu_ps(in, x + (size_t)m * K + k);
            const __m256bh hi = _mm512_cvtneps_pbh(v);
            const __m512 r1 = _mm512_sub_ps(v, _mm512_cvtpbh_ps(hi));
            const __m256bh mid = _mm512_cvtneps_pbh(r1);
            const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, _mm512_cvtpbh_ps(mid)));
            _mm256_storeu_si256((__m256i *)(o + k), (__m256i)hi);
            _mm256_storeu_si256((__m256i *)(o + KP + k), (__m256i)mid);
            _mm256_storeu_si256((__m256i *)(o + 2 * KP + k), (__m256i)lo);
        }
    }
}

/* Step c (32 rows of k) of block w [K, 64], columns 32 h .. 32 h + 31 (hs: 1 one half, 2 both from
 * h = 0), as right-hand tiles at bt, 512 values each: tile g holds, for each pair of rows k, k + 1, the
 * weights of columns 32 (g / 2) + {0-3, 8-11, 16-19, 24-27} (g even) or {4-7, ...} (g odd) interleaved
 * (the unpacks' lane order; bf16_rows puts it back). Rows past K zero; rows F32_AHEAD on fetched now. */
static BF16_TARGET inline void bf16_step(const uint16_t *w, int K, int c, int h, int hs, uint16_t *bt) {
    for (int r = 0; r < 16; r++) {
        const int k = 32 * c + 2 * r;
        for (int j = 0; j < hs; j++) {
            const int half = h + j;
            _mm_prefetch((const char *)(w + ((size_t)k + F32_AHEAD) * 64 + 32 * half), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + ((size_t)k + F32_AHEAD + 1) * 64 + 32 * half), _MM_HINT_T0);
            const __m512i a = k < K ? _mm512_loadu_si512(w + (size_t)k * 64 + 32 * half) : _mm512_setzero_si512();
            const __m512i b = k + 1 < K ? _mm512_loadu_si512(w + (size_t)(k + 1) * 64 + 32 * half) : _mm512_setzero_si512();
            _mm512_store_si512(bt + ((size_t)(2 * j) * 16 + r) * 32, _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(bt + ((size_t)(2 * j + 1) * 16 + r) * 32, _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* Rows of x from the sums of their parts: tile rows 3 j .. 3 j + 2 of c0 (the even column tile) and c1
 * (the odd one) as 32 outputs in column order, (hi + mid) + lo, plus the bias, into y, for n rows. */
static BF16_TARGET void bf16_rows(float (*c0)[16], float (*c1)[16], int n, const float *bias, float *y, size_t ldy) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < n; j++) {
        const __m512 a = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(c0[3 * j]), _mm512_load_ps(c0[3 * j + 1])),
                                       _mm512_load_ps(c0[3 * j + 2]));
        const __m512 b = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(c1[3 * j]), _mm512_load_ps(c1[3 * j + 1])),
                                       _mm512_load_ps(c1[3 * j + 2]));
        __m512 y0 = _mm512_permutex2var_ps(a, first, b), y1 = _mm512_permutex2var_ps(a, second, b);
        if (bias) {
            y0 = _mm512_add_ps(y0, _mm512_loadu_ps(bias));
            y1 = _mm512_add_ps(y1, _mm512_loadu_ps(bias + 16));
        }
        _mm512_storeu_ps(y + (size_t)j * ldy, y0);
        _mm512_storeu_ps(y + (size_t)j * ldy + 16, y1);
    }
}

/* Rows 10 p0 .. 10 p1 - 1 of x (passes p0 .. p1 - 1: two left-hand tiles of five rows each) times one
 * block w [K, 64] (its tiles already at bt where laid, else laid step by step into bt) -> y (stride ldy),
 * plus bias [64] or NULL. The tiles are configured for `rows` left-hand rows (15, or 3 M below five
 * rows). Tiles 0-3 sums, 4-5 x's parts, 6-7 the block's. One tile of x (five rows or fewer): all four
 * column tiles a step; two: two column tiles at a time, the block's two halves in turn. */
static BF16_TARGET void bf16_block(const uint16_t *w, int K, int KP, const uint16_t *xs, int M, int p0, int p1,
                                   const float *bias, float *y, size_t ldy, uint16_t *bt, int laid) {
    float c[4][16][16] __attribute__((aligned(64)));
    const long stride = (long)KP * 2;
    for (int p = p0; p < p1; p++) {
        const int m0 = 10 * p, two = m0 + 5 < M;
        const uint16_t *x0 = xs + (size_t)m0 * 3 * KP, *x1 = x0 + (size_t)15 * KP;
        for (int h = 0; h < 2; h += two ? 1 : 2) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const int hs = two ? 1 : 2;
            if (!laid) bf16_step(w, K, 0, h, hs, bt);
            for (int ch = 0; ch < KP / 32; ch++) {
                const uint16_t *bb = bt + ((size_t)ch * 4 + 2 * h) * 512;
                if (!laid) {    /* two buffers: the next step laid out while this one's tiles load */
                    bb = bt + (size_t)(ch & 1) * 2048;
                    if (ch + 1 < KP / 32) bf16_step(w, K, ch + 1, h, hs, bt + (size_t)((ch + 1) & 1) * 2048);
                }
                _tile_loadd(4, x0 + 32 * ch, stride);
                _tile_loadd(6, bb, 64);
                _tile_loadd(7, bb + 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, x1 + 32 * ch, stride);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                } else {
                    _tile_loadd(6, bb + 1024, 64);
                    _tile_loadd(7, bb + 1536, 64);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_dpbf16ps(3, 4, 7);
                }
            }
            amx_sums_out(c);
            const int n0 = M - m0 < 5 ? M - m0 : 5;
            float *y0 = y + (size_t)m0 * ldy + 32 * h;
            bf16_rows(c[0], c[1], n0, bias ? bias + 32 * h : 0, y0, ldy);
            if (!two)
                bf16_rows(c[2], c[3], n0, bias ? bias + 32 : 0, y0 + 32, ldy);
            else if (M - m0 > 5)
                bf16_rows(c[2], c[3], M - m0 - 5 < 5 ? M - m0 - 5 : 5, bias ? bias + 32 * h : 0, y0 + 5 * ldy, ldy);
        }
    }
}

/* This thread's tile unit for `rows` left-hand rows (tiles 0-5; the block's 6-7 take 16). */
static BF16_TARGET void bf16_config(int rows) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = t < 6 ? rows : 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* x's parts for M rows, padded to whole tiles: the buffer, or NULL */
static BF16_TARGET uint16_t *bf16_x(const float *x, int M, int K, int KP, int nt) {
    const int MP = (M + 9) / 10 * 10;
    uint16_t *xs = bf16_scratch(0, (size_t)MP * 3 * KP * 2);
    if (xs) bf16_parts(x, M, MP, K, KP, xs, nt);
    return xs;
}

/* y [M, N] = x [M, K] times bfloat16 blocks w, plus bias: 0, or -2 where the buffers could not be had.
 * The work is (block, share of the passes) items, so a few blocks still spread over the threads; where
 * passes share a block, a thread lays out its tiles once for its consecutive items. */
static BF16_TARGET int bf16_amx(const uint16_t *w, const float *x, int M, int K, const float *bias, float *y, int N,
                                int nt) {
    const int KP = (K + 31) / 32 * 32, nb = N / 64, passes = (M + 9) / 10, prelay = passes > 1;
    const int shares = passes < (8 * nt + nb - 1) / nb ? passes : (8 * nt + nb - 1) / nb;
    const uint16_t *xs = bf16_x(x, M, K, KP, nt);
    if (!xs) return -2;
    int failed = 0;
    #pragma omp parallel num_threads(nt) if (nb * shares > 1)
    {
        uint16_t *bt = bf16_scratch(1, prelay ? (size_t)KP * 64 * 2 : 4096 * 2);
        if (!bt) {
            #pragma omp atomic write
            failed = 1;
        }
        bf16_config(M < 5 ? 3 * M : 15);
        int laid = -1;
        #pragma omp for schedule(static)
        for (int item = 0; item < nb * shares; item++) {
            if (!bt) continue;
            const int b = item / shares, s = item % shares;
            const uint16_t *wb = w + (size_t)b * K * 64;
            if (prelay && b != laid) {
                for (int ch = 0; ch < KP / 32; ch++) bf16_step(wb, K, ch, 0, 2, bt + (size_t)ch * 2048);
                laid = b;
            }
            bf16_block(wb, K, KP, xs, M, passes * s / shares, passes * (s + 1) / shares, bias ? bias + 64 * b : 0,
                       y + 64 * b, N, bt, prelay);
        }
        _tile_release();
    }
    return failed ? -2 : 0;
}

/* llmd_f32_pick's values on AMX: the chosen columns gathered 64 to a block, which gives each the bits it
 * has in the whole product (a column's sums do not depend on the others'). */
static BF16_TARGET int bf16_amx_pick(const float *x, int M, int K, const uint16_t *w, const int64_t *idx, int C,
                                     float *y) {
    const int KP = (K + 31) / 32 * 32, passes = (M + 9) / 10;
    const uint16_t *xs = bf16_x(x, M, K, KP, 1);
    uint16_t *g = malloc((size_t)K * 64 * 2 + 4096 * 2 + 64);
    float *out = malloc(sizeof(float) * 64 * (size_t)M);
    if (!xs || !g || !out) {
        free(g);
        free(out);
        return -2;
    }
    uint16_t *bt = (uint16_t *)(((uintptr_t)(g + (size_t)K * 64) + 63) & ~(uintptr_t)63);
    bf16_config(M < 5 ? 3 * M : 15);
    for (int c0 = 0; c0 < C; c0 += 64) {
        const int lanes = C - c0 < 64 ? C - c0 : 64;
        for (int k = 0; k < K; k++)
            for (int j = 0; j < 64; j++) {
                const int64_t n = idx[c0 + (j < lanes ? j : 0)];
                g[(size_t)k * 64 + j] = w[(size_t)(n / 64) * K * 64 + (size_t)k * 64 + n % 64];
            }
        bf16_block(g, K, KP, xs, M, 0, passes, 0, out, 64, bt, 0);
        for (int m = 0; m < M; m++) memcpy(y + (size_t)m * C + c0, out + (size_t)m * 64, sizeof(float) * lanes);
    }
    _tile_release();
    free(g);
    free(out);
    return 0;
}
#else
static int bf16_amx_usable(void) { return 0; }
static int bf16_amx(const uint16_t *w, const float *x, int M, int K, const float *bias, float *y, int N, int nt) {
    (void)w, (void)x, (void)M, (void)K, (void)bias, (void)y, (void)N, (void)nt;
    return -1;
}
static int bf16_amx_pick(const float *x, int M, int K, const uint16_t *w, const int64_t *idx, int C, float *y) {
    (void)x, (void)M, (void)K, (void)w, (void)idx, (void)C, (void)y;
    return -1;
}
#endif

/* The most rows llmd_f32_w16 takes here: BF16_MANY_ROWS with AMX's bfloat16 products, else F32_MAXM. */
int llmd_f32_w16_rows(void) {
    return bf16_amx_usable() ? BF16_MANY_ROWS : F32_MAXM;
}

/* The product for one storage (wide: float32 blocks), as its own function so that each has its own
 * parallel region with the storage fixed (a shared region would test it in the inner loop). */
#define F32_PRODUCT(NAME, WIDE, WTYPE) \
TARGET int NAME(const float *x, int M, int K, const WTYPE *w, const float *bias, float *y, int N, int nt) { \
    const int wide = WIDE; \
    if (!wide && M >= 1 && M <= BF16_MANY_ROWS && N % 64 == 0 && K >= 1 && bf16_amx_usable()) \
        return bf16_amx((const uint16_t *)w, x, M, K, bias, y, N, nt); \
    if (!llmd_cpu_ok() || M < 1 || M > F32_MAXM || N % 64) return -1; \
    const int groups = M >= 11 ? (M + 5) / 6 : (M + 3) / 4 - (M > 4 && (M % 4 == 1 || M % 4 == 2)); \
    const int nb = N / 64, es = wide ? 4 : 2; \
    _Pragma("omp parallel for num_threads(nt) schedule(static)") \
    for (int b = 0; b < nb; b++) { \
        /* with several row groups a block is computed more than once from cache: the groups fetch \
         * the thread's next block meanwhile (static schedule: a thread's blocks are consecutive) */ \
        const void *next = groups > 1 && b + 1 < nb ? (const char *)w + (size_t)(b + 1) * K * 64 * es : 0; \
        for (int gi = 0, m0 = 0; gi < groups; gi++) { \
            const int rows = M / groups + (gi < M % groups); \
            switch (rows) { \
            case 1: F32_CASE(1) break; \
            case 2: F32_CASE(2) break; \
            case 3: F32_CASE(3) break; \
            case 4: F32_CASE(4) break; \
            case 5: F32_CASE(5) break; \
            default: F32_CASE(6) break; \
            } \
            m0 += rows; \
        } \
    } \
    return 0; \
}

F32_PRODUCT(llmd_f32, 1, float)

/* The same product over bfloat16 blocks (see above). */
F32_PRODUCT(llmd_f32_w16, 0, uint16_t)

/* ---- chosen outputs of a blocked product ------------------------------------------------------ */
/* y[m, c] = the value llmd_f32 (wide) or llmd_f32_w16 (wide 0) gives output idx[c] of row m without a
 * bias: each output is one lane of its block, summed by one FMA chain over k from zero, whatever the
 * other lanes hold, so its value is computed here from that lane alone. Sixteen outputs at a time are
 * gathered into a block of their own and summed by the same FMAs in the same order: the same bits. The
 * head screen (llmd.runtime.formats.head_screen) scores the outputs it cannot rule out with it. */
TARGET int llmd_f32_pick(const float *x, int M, int K, const void *w, int wide, int N, const int64_t *idx, int C,
                         float *y, int nt) {
    if (!llmd_cpu_ok() || M < 1 || M > F32_MAXM || K < 1 || N < 64 || N % 64 || C < 1) return -1;
    for (int c = 0; c < C; c++)
        if (idx[c] < 0 || idx[c] >= N) return -1;
    if (!wide && bf16_amx_usable()) return bf16_amx_pick(x, M, K, w, idx, C, y);
    const int chunks = (C + 15) / 16;
    int failed = 0;
    #pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)C * K > (1u << 16))
    for (int t = 0; t < chunks; t++) {
        float *g = malloc(sizeof(float) * 16 * (size_t)K);
        if (!g) {
            #pragma omp atomic write
            failed = 1;
            continue;
        }
        const int c0 = 16 * t, lanes = C - c0 < 16 ? C - c0 : 16;
        for (int j = 0; j < 16; j++) block_column(w, !wide, K, idx[c0 + (j < lanes ? j : 0)], g + j, 16);
        for (int m = 0; m < M; m++) {
            __m512 acc = _mm512_setzero_ps();
            for (int k = 0; k < K; k++)
                acc = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)m * K + k]), _mm512_loadu_ps(g + (size_t)k * 16), acc);
            float out[16];
            _mm512_storeu_ps(out, acc);
            memcpy(y + (size_t)m * C + c0, out, sizeof(float) * (size_t)lanes);
        }
        free(g);
    }
    return failed ? -2 : 0;
}
