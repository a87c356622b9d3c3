/* Float32 products over weights stored in blocks of 64 output columns. */
#include "kernels.h"

/* ---- float32 weights in blocks of 64 output columns ------------------------------------- */
/* The weight is stored as [N/64, K, 64]: block b holds W[k, 64b:64b+64] for every k, one after
 * another, so each thread streams whole blocks front to back. y[m, block] = sum_k x[m,k] W[k, block]:
 * x broadcast, one FMA per 16 weights, no reductions. N a multiple of 64.
 *
 * The same blocks may hold bfloat16 values (wide = 0): a float32 weight whose every value is a
 * bfloat16 (a checkpoint stored in bfloat16 and served in float32) is kept in half the bytes and
 * widened exactly on load, so the products are the float32 ones, bit for bit, from half the memory
 * traffic. */

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

#ifndef LLMD_AVX2
/* The 32 outputs of a pair of vectors in that unpacked order (a: columns {0-3, 8-11, 16-19, 24-27}, b:
 * {4-7, ...}) back in column order: y[0] columns 0-15, y[1] 16-31 (block_out, and f32.c's tile sums). */
static inline TARGET __attribute__((always_inline)) void unpacked_in_order(__m512 a, __m512 b, __m512 y[2]) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    y[0] = _mm512_permutex2var_ps(a, first, b);
    y[1] = _mm512_permutex2var_ps(a, second, b);
}
#endif

static inline TARGET __attribute__((always_inline)) void block_out(float *y, const int wide, const __m512 acc[4]) {
#ifndef LLMD_AVX2
    if (!wide) {
        for (int h = 0; h < 2; h++) {
            __m512 v[2];
            unpacked_in_order(acc[2 * h], acc[2 * h + 1], v);
            _mm512_storeu_ps(y + 32 * h, v[0]);
            _mm512_storeu_ps(y + 32 * h + 16, v[1]);
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

/* Rows in groups of four per block, so a block is read from memory once and from cache for the
 * later groups (verification of a few proposals, small batches). Where fours would leave a group of
 * one or two rows, whose sums wait on each FMA's latency, the rows are shared out over one group
 * fewer, of five or six: five rows (four proposals verified) take 0.81x the time of four and one, nine
 * rows 0.90x (`bench/bench_kernels.py --products 5,9`). From eleven rows the groups are of five or
 * six: fewer passes over the block, and each bfloat16 weight widened for more rows (sixteen rows in
 * three groups, not four). The same sums: each row's order over k is unchanged, whatever its group.
 *
 * So the loop takes any row count (F32_MANY_ROWS) with each row summed as it is alone: a decode row
 * gets the same bits in a batch of 40 or beside a prompt chunk, and a prompt's rows whatever its
 * chunks. From F32_SHARE_ROWS rows, where arithmetic bounds the product, the rows of a block are also
 * shared out over the threads in slices (a weight of few blocks still keeps every thread busy); below,
 * a thread takes whole blocks. bfloat16 blocks take the tile unit past F32_AMX_ROWS rows where AMX has
 * bfloat16 products (below), which sums in its own order: in a whole step, whose weights stream from
 * memory, the vector loop is the faster up to about that many rows, the tile unit past them
 * (docs/performance.md, "bfloat16 blocks on the vector loop up to 20 rows"). */
#define F32_MAXM 16
#define F32_AMX_ROWS 20
#define F32_MANY_ROWS 8192
#define F32_SHARE_ROWS 32

/* ---- bfloat16 blocks of many rows on AMX -------------------------------------------------- */
/* Where the CPU has AMX with bfloat16 products, products of more than F32_AMX_ROWS rows over bfloat16
 * blocks (prompt chunks, and steps that mix them with decodes) take the tile unit instead of a second,
 * float32 copy of the weight in oneDNN's layout. The tile unit multiplies bfloat16 by bfloat16 and sums
 * in float32, so each float32 row of x is split into three bfloat16 parts, x = hi + mid + lo (each the
 * rounded remainder of the ones before: 24 bits of x's 24), and y = W hi + W mid + W lo: every product
 * of a bfloat16 weight and a part is exact in float32, and the sums are float32 sums, so y is a float32
 * product (to within float32 rounding of the exact one; the order of the sums is the tile unit's, not
 * the vector loop's, so these rows differ from a row of 16 or fewer in their last bits).
 * Each row is summed in the same order whatever the other rows of the call, as with oneDNN's copy
 * before. A block's 64 columns are first interleaved in pairs of rows of k (the tile unit's right-hand
 * layout) into a buffer of the thread's; 32 rows by 32 columns at a time against it. */
#define BF16_MANY_ROWS 8192

#if defined(LLMD_AMX) && (__has_include(<amxbf16intrin.h>) || __has_include(<amxintrin.h>))
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16")))

static int bf16_amx_usable(void) {
    static int has = -1;
    if (has < 0) {
        unsigned a, b, c, d, a1, b1, c1, d1;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        __asm__ volatile("cpuid" : "=a"(a1), "=b"(b1), "=c"(c1), "=d"(d1) : "a"(7), "c"(1));
        has = (d >> 22 & 1) && (a1 >> 5 & 1);       /* AMX-BF16, AVX512-BF16 */
    }
    return has && amx_usable();
}

/* x's rows [M, K] as bfloat16 parts xs [MP][3][KP] (hi, mid, lo), rows past M and columns past K zero */
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

/* Block w [K, 64] as tiles bt [KP/32][4][16][32]: tile g of a 32-row step holds, for each pair of rows
 * k, k + 1, the weights of columns 32 (g / 2) + {0-3, 8-11, 16-19, 24-27} (g even) or {4-7, ...} (g odd)
 * interleaved (the unpacks' lane order; bf16_out puts it back). Rows past K zero. */
static BF16_TARGET void bf16_tiles(const uint16_t *w, int K, int KP, uint16_t *bt) {
    for (int c = 0; c < KP / 32; c++)
        for (int r = 0; r < 16; r++) {
            const int k = 32 * c + 2 * r;
            _mm_prefetch((const char *)(w + ((size_t)k + F32_AHEAD) * 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + ((size_t)k + F32_AHEAD) * 64 + 32), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + ((size_t)k + F32_AHEAD + 1) * 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(w + ((size_t)k + F32_AHEAD + 1) * 64 + 32), _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                const __m512i a = k < K ? _mm512_loadu_si512(w + (size_t)k * 64 + 32 * h) : _mm512_setzero_si512();
                const __m512i b = k + 1 < K ? _mm512_loadu_si512(w + (size_t)(k + 1) * 64 + 32 * h) : _mm512_setzero_si512();
                _mm512_store_si512(bt + (((size_t)c * 4 + 2 * h) * 16 + r) * 32, _mm512_unpacklo_epi16(a, b));
                _mm512_store_si512(bt + (((size_t)c * 4 + 2 * h + 1) * 16 + r) * 32, _mm512_unpackhi_epi16(a, b));
            }
        }
}

/* Rows of two column tiles' sums (c0: the even tile, c1: the odd one) as 32 outputs in column order, plus
 * the bias. */
static BF16_TARGET void bf16_out(const float *c0, const float *c1, const float *bias, float *y) {
    __m512 v[2];
    unpacked_in_order(_mm512_load_ps(c0), _mm512_load_ps(c1), v);
    for (int j = 0; j < 2; j++)
        _mm512_storeu_ps(y + 16 * j, bias ? _mm512_add_ps(v[j], _mm512_loadu_ps(bias + 16 * j)) : v[j]);
}

/* y [M, N] = x [M, K] times bfloat16 blocks w, plus bias: 0, or -2 where the buffers could not be had.
 * Tiles 0-3 the sums of two row tiles by two column tiles, 4-5 x's parts, 6-7 the weights'. The work is
 * (block, share of the row tiles) items, so a few blocks still spread over the threads; a thread lays
 * out a block's tiles once for its consecutive items. */
static BF16_TARGET int bf16_amx(const uint16_t *w, const float *x, int M, int K, const float *bias, float *y, int N,
                                int nt) {
    const int KP = (K + 31) / 32 * 32, MP = (M + 15) / 16 * 16, nb = N / 64, pairs = (MP + 31) / 32;
    const int shares = pairs < (8 * nt + nb - 1) / nb ? pairs : (8 * nt + nb - 1) / nb;
    uint16_t *xs = scratch_for(0, (size_t)MP * 3 * KP * 2);      /* x's parts */
    if (!xs) return -2;
    bf16_parts(x, M, MP, K, KP, xs, nt);
    int failed = 0;
    const long stride = (long)3 * KP * 2;
    #pragma omp parallel num_threads(nt)
    {
        uint16_t *bt = scratch_for(1, (size_t)KP * 64 * 2);     /* a block's tiles */
        if (!bt) {
            #pragma omp atomic write
            failed = 1;
        }
        amx_tiles_16x64();
        float c[4][16][16] __attribute__((aligned(64)));
        int laid = -1;
        #pragma omp for schedule(static)
        for (int item = 0; item < nb * shares; item++) {
            if (!bt) continue;
            const int b = item / shares, s = item % shares;
            if (b != laid) {
                bf16_tiles(w + (size_t)b * K * 64, K, KP, bt);
                laid = b;
            }
            for (int p = pairs * s / shares; p < pairs * (s + 1) / shares; p++) {
                const int m0 = 32 * p, two = m0 + 16 < MP;
                const uint16_t *x0 = xs + (size_t)m0 * 3 * KP, *x1 = x0 + (size_t)16 * 3 * KP;
                for (int h = 0; h < 2; h++) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int ch = 0; ch < KP / 32; ch++) {
                        const uint16_t *bb = bt + ((size_t)ch * 4 + 2 * h) * 512;
                        _tile_loadd(6, bb, 64);
                        _tile_loadd(7, bb + 512, 64);
                        /* hi, then mid, then lo: each sum's order over a step of 32 columns */
#define BF16_PART(P)                                               \
                        _tile_loadd(4, x0 + (P) * KP + 32 * ch, stride); \
                        _tile_dpbf16ps(0, 4, 6);                   \
                        _tile_dpbf16ps(1, 4, 7);                   \
                        if (two) {                                 \
                            _tile_loadd(5, x1 + (P) * KP + 32 * ch, stride); \
                            _tile_dpbf16ps(2, 5, 6);               \
                            _tile_dpbf16ps(3, 5, 7);               \
                        }
                        BF16_PART(0) BF16_PART(1) BF16_PART(2)
#undef BF16_PART
                    }
                    amx_sums_out(c);
                    for (int r = 0; r < 32 && m0 + r < M; r++)
                        bf16_out(c[2 * (r >= 16)][r % 16], c[2 * (r >= 16) + 1][r % 16], bias ? bias + 64 * b + 32 * h : 0,
                                 y + (size_t)(m0 + r) * N + 64 * b + 32 * h);
                }
            }
        }
        _tile_release();
    }
    return failed ? -2 : 0;
}
#else
static int bf16_amx_usable(void) { return 0; }
static int bf16_amx(const uint16_t *w, const float *x, int M, int K, const float *bias, float *y, int N, int nt) {
    (void)w, (void)x, (void)M, (void)K, (void)bias, (void)y, (void)N, (void)nt;
    return -1;
}
#endif

int llmd_f32_w16_rows(void) { return bf16_amx_usable() ? BF16_MANY_ROWS : F32_MANY_ROWS; }
int llmd_f32_rows(void) { return F32_MANY_ROWS; }
int llmd_f32_w16_amx_rows(void) { return bf16_amx_usable() ? F32_AMX_ROWS : 0; }

/* Rows first .. first + rows - 1 of block b, in groups (see F32_MAXM above). */
static inline TARGET __attribute__((always_inline))
void f32_rows_of_block(const float *x, int first, int rows, int K, const void *w, int b, const float *bias, float *y,
                       int N, const void *next, const int wide) {
    const int es = wide ? 4 : 2;
    const int groups = rows >= 11 ? (rows + 5) / 6 : (rows + 3) / 4 - (rows > 4 && (rows % 4 == 1 || rows % 4 == 2));
    for (int gi = 0, m0 = first; gi < groups; gi++) {
        const int g = rows / groups + (gi < rows % groups);
        switch (g) {
        case 1: F32_CASE(1) break;
        case 2: F32_CASE(2) break;
        case 3: F32_CASE(3) break;
        case 4: F32_CASE(4) break;
        case 5: F32_CASE(5) break;
        default: F32_CASE(6) break;
        }
        m0 += g;
    }
}

/* The product for one storage (wide: float32 blocks), as its own function so that each has its own
 * parallel region with the storage fixed (a shared region would test it in the inner loop). */
#define F32_PRODUCT(NAME, WIDE, WTYPE) \
TARGET int NAME(const float *x, int M, int K, const WTYPE *w, const float *bias, float *y, int N, int nt) { \
    const int wide = WIDE; \
    if (!wide && M > F32_AMX_ROWS && M <= BF16_MANY_ROWS && N % 64 == 0 && K >= 1 && bf16_amx_usable()) \
        return bf16_amx((const uint16_t *)w, x, M, K, bias, y, N, nt); \
    if (!llmd_cpu_ok() || M < 1 || M > F32_MANY_ROWS || N % 64) return -1; \
    const int nb = N / 64, es = wide ? 4 : 2; \
    /* slices of a block's rows: as many as keep every thread busy, none under F32_MAXM rows */ \
    int slices = 1; \
    if (M >= F32_SHARE_ROWS && nt > 1) { \
        slices = (8 * nt + nb - 1) / nb; \
        if (slices > M / F32_MAXM) slices = M / F32_MAXM; \
        if (slices < 1) slices = 1; \
    } \
    _Pragma("omp parallel for num_threads(nt) schedule(static)") \
    for (int item = 0; item < nb * slices; item++) { \
        const int b = item / slices, s = item % slices; \
        const int m0 = (int)((long)M * s / slices), rows = (int)((long)M * (s + 1) / slices) - m0; \
        /* with several row groups a block is computed more than once from cache: the groups fetch \
         * the next block meanwhile (static schedule: a thread's items are consecutive) */ \
        const void *next = rows > 6 && s == slices - 1 && b + 1 < nb ? (const char *)w + (size_t)(b + 1) * K * 64 * es : 0; \
        f32_rows_of_block(x, m0, rows, K, w, b, bias, y, N, next, wide); \
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
