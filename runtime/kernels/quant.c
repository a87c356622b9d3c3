/* Quantized products, x86-64 with AVX-512 (VNNI): decode rows, verification, batches, and prompts.
 *
 * llmd's decode step reads every weight once per token, so its speed is the rate at which weights
 * stream from memory; with several rows (a batch of streams, a verification) it is also the
 * arithmetic per weight and row. int8, int8g and int4 weights are packed once into blocks of 16
 * outputs (below) whose every load serves all rows of a tile with one vpdpbusd per row (the AVX2
 * library's int8: its own loop, q8w_run); w8a8
 * keeps its weights as stored, one output row at a time. Rows of the output (blocks) are split
 * across threads with OpenMP (the same runtime torch uses, loaded once per process). Built and
 * loaded by llmd.runtime.kernels.
 *
 *   int8:  y[m,n] = s[n] * sum_k w[n,k] x[m,k]                 w int8 [N,K], x as 16-bit integers
 *   int8g: y[m,n] = sum_g s[n,g] sum_{k in g} w[n,k] x[m,k]     x as 16-bit integers
 *   int4:  y[m,n] = sum_g s[n,g] sum_{k in g} (q[n,k] - 8) x[m,k] + z[n,g] sum_{k in g} x[m,k]
 *          q in [0,15], x as 8-bit integers per block of 128; s and z held as float32, or (q4h) as
 *          float16 where every one is a float16 value: the same numbers in fewer bytes
 *   w8a8:  y[m,n] = sx[m] s[n] sum_k w[n,k] xq[m,k]            xq = round(x / sx), sx = max|x| / 127
 * The entry points (llmd_*_x) take 1..8192 rows and K a multiple of 64 (int8, int8g,
 * w8a8: below 65536; int4 and int8g: of their group size too) and return 0, -1 for a CPU or shape they
 * do not take (the caller then uses torch's kernels), -2 out of memory.
 *
 * Batch invariance: every row of x is quantized on its own (its own scales) and each output value
 * y[m, n] is summed by the same code in the same order whatever M is and wherever row m falls in
 * its tile, so a row's result never depends on the other rows of the call (a request's tokens are
 * the same alone and in a batch). The int8 and w8a8 sums are exact integers.
 */
#include "kernels.h"

int llmd_cpu_ok(void) {
    static int ok = -1;                     /* asked once: every entry point checks it */
    if (ok < 0) {
        __builtin_cpu_init();
#ifdef LLMD_AVX2
        ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
        ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
            && __builtin_cpu_supports("avx512vnni");
#endif
    }
    return ok;
}

/* ---- one call per product: quantize x into per-thread scratch, then multiply --------------- */
/* The scratch grows to the largest row seen and is kept for the thread's life, so a decode step
 * allocates nothing here; the caller passes x as float32 and gets y. */

static __thread void *scratch[2];
static __thread size_t scratch_bytes[2];

void *scratch_for(int which, size_t bytes) {
    if (bytes > scratch_bytes[which]) {
        void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!p) return 0;
        free(scratch[which]);
        scratch[which] = p;
        scratch_bytes[which] = bytes;
    }
    return scratch[which];
}


/* ---- blocked forms: int8, int8g and int4 weights ------------------------------------------- */
/* A packed weight (llmd_q8_pack, llmd_q4_pack) is a run of blocks of 16 output rows each (the last
 * padded with zero rows), G the columns per scale (int8: G = K, one group), groups = K / G:
 *
 *   block b: outputs 16b .. 16b+15                                   bytes: 128 groups + 16 K (int8, int8g)
 *   +---------------------+---------------------+--------------------------------  128 groups +  8 K (int4)
 *   | A [groups][16]      | B [groups][16]      | weights, 64 bytes per step,         64 groups +  8 K (q4h)
 *   | int8(g): int32 128W | int8(g): float32 s  |   lane j = output 16b+j:
 *   | int4: float32 s     | int4: float32 z-8s  |   int8(g): step i, 4 columns 4i..4i+3: byte 4j+t = w[., 4i+t] + 128
 *   | q4h: float16 s      | q4h: float16 z      |   int4: step i, 8 columns: byte 4j+t = q[., 8i+t] | q[., 8i+4+t] << 4
 *   +---------------------+---------------------+--------------------------------
 *   W = the group's sum of w over its columns (int8: the row's). The head is a whole number of 64-byte
 *   lines, so the weight steps keep the block's alignment. q4h widens s and z exactly and forms z - 8 s
 *   in float32 with one rounding (8 s is exact), as torch forms the int4 offsets it packs: the same
 *   numbers as the int4 blocks of the same values.
 *
 * vpdpbusd adds, in each of 16 lanes, four products of unsigned bytes (the weights of one output)
 * and signed bytes (four columns of one x row, the same in every lane: a broadcast). One weight load
 * thus advances 16 outputs of every row of a tile by 4 columns (int4: 8, from the two nibbles), with
 * one instruction per row and no sum across lanes; the bfloat16 blocks (f32.c) share loads the same
 * way, with four FMAs per 64 weights and row where int8 takes two vpdpbusd and int4 one.
 *
 *   int8:  x as 16-bit integers per row, xi = round(x / sx), sx = max|x| / 32767, xi = 256 hi + lo with
 *          hi = xi >> 8 and lo in [0, 255] (lo enters as lo - 128, a signed byte). With u = w + 128:
 *            H = sum w hi = sum u hi - 128 sum hi,   L = sum w lo = sum u (lo - 128) - 128 sum (lo - 128) + 128 W
 *          exact in int32 (K < 2^16), and y = (float)(256 H + L) sx s: sum w xi formed exactly (in double)
 *          and rounded once, as llmd.runtime.formats.quantized rounds its prompt rows (Int8Linear.large):
 *          the same numbers at every row count, and from the AVX2 library's other exact sums.
 *   int8g: per group the exact sum 256 H + L (|.| < 2^31 for G <= 256), then y += that sx s[g].
 *   int4:  x as 8-bit integers per block of 128 columns (x8_blocks); per run of min(G, 128) columns the
 *          exact sum of q xq, then y += that s[g] sx[block], and per group y += (z - 8 s) X[g].
 * Each row's sums are its own and run in the same order whatever the tile (integer sums may be split
 * into turns: they are exact), so a row's result never depends on the other rows of the call. */

#define QB 16                /* outputs per block */
#define Q_CHUNK 64           /* rows of x per pass over the weights (their x stays in cache) */

/* The lanes of block b (16 outputs from 16 b) that hold outputs below N. */
static inline __mmask16 q_keep(int N, int b) {
    return N - QB * b >= QB ? 0xFFFF : (__mmask16)((1u << (N - QB * b)) - 1);
}

/* Bytes of a block: its head (A and B, es bytes a value: 4, or 2 for q4h) and its weight steps. */
static size_t q_block_bytes(int K, int groups, int nibbles, int es) {
    return (size_t)32 * es * groups + (size_t)(nibbles ? 8 : 16) * K;
}

/* Groups of the int8 (G = 0: one) and int8g forms, or 0 for a shape they do not take. */
static int q8_groups(int K, int G) {
    if (K < 64 || K % 64 || K >= 65536) return 0;
    if (G == 0) return 1;
    return (G == 64 || G == 128 || G == 256) && K % G == 0 ? K / G : 0;
}

static int q4_groups(int K, int G) {
    return K >= 64 && K % 64 == 0 && (G == 32 || G == 64 || G == 128 || G == 256) && K % G == 0 ? K / G : 0;
}

#ifndef LLMD_AVX2
/* acc += w (unsigned bytes) times the four signed bytes at p in every lane, p read by the instruction
 * itself (an embedded broadcast: no separate load and broadcast per row). */
static inline TARGET __attribute__((always_inline)) __m512i dot4(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}
#endif

/* The next block is fetched while this one is computed (by a block's first tile: the others find
 * it in cache), a line ahead of each weight line read, and its head lines (2 per group; q4h: 1) first. */
#define Q_HINT _MM_HINT_T0
static inline void q_prefetch_head(const uint8_t *next, size_t head_bytes) {
    for (size_t at = 0; at < head_bytes; at += 64) _mm_prefetch((const char *)next + at, Q_HINT);
}

/* int8 w [N, K] with scales s [N] (G = 0) or [N, K/G] -> the blocks above. 0, or -1 for a shape not taken. */
TARGET int llmd_q8_pack(const int8_t *w, const float *s, int N, int K, int G, uint8_t *out) {
    const int groups = q8_groups(K, G);
    if (!groups || N < 1) return -1;
    const int width = K / groups;
    const size_t bytes = q_block_bytes(K, groups, 0, 4);
    for (int b = 0; b < (N + QB - 1) / QB; b++) {
        uint8_t *blk = out + (size_t)b * bytes, *u = blk + (size_t)128 * groups;
        int32_t *wsum = (int32_t *)blk;
        float *scale = (float *)(blk + (size_t)64 * groups);
        for (int j = 0; j < QB; j++) {
            const int n = QB * b + j;
            const int8_t *r = n < N ? w + (size_t)n * K : 0;
            for (int g = 0; g < groups; g++) {
                int32_t sum = 0;
                for (int k = g * width; r && k < (g + 1) * width; k++) sum += r[k];
                wsum[g * QB + j] = 128 * sum;
                scale[g * QB + j] = r ? s[(size_t)n * groups + g] : 0.f;
            }
            for (int k = 0; k < K; k++) u[(size_t)(k / 4) * 64 + 4 * j + k % 4] = (uint8_t)((r ? r[k] : 0) + 128);
        }
    }
    return 0;
}

/* int4 nibbles q uint8 [N, K] (values 0..15) with the head's values A and B [N, K/G] (es bytes each) -> the
 * blocks above (padding rows: zero bytes, 0.0 in either width). 0, or -1 for a shape not taken. */
static int q4_pack(const uint8_t *q, const void *A, const void *B, int es, int N, int K, int G, uint8_t *out) {
    const int groups = q4_groups(K, G);
    if (!groups || N < 1) return -1;
    const size_t bytes = q_block_bytes(K, groups, 1, es), part = (size_t)16 * es * groups;
    for (int b = 0; b < (N + QB - 1) / QB; b++) {
        uint8_t *blk = out + (size_t)b * bytes, *v = blk + 2 * part;
        for (int j = 0; j < QB; j++) {
            const int n = QB * b + j;
            const uint8_t *r = n < N ? q + (size_t)n * K : 0;
            for (int g = 0; g < groups; g++) {
                const size_t to = (size_t)es * (g * QB + j), from = (size_t)es * ((size_t)n * groups + g);
                if (r) {
                    memcpy(blk + to, (const uint8_t *)A + from, es);
                    memcpy(blk + part + to, (const uint8_t *)B + from, es);
                } else {
                    memset(blk + to, 0, es);
                    memset(blk + part + to, 0, es);
                }
            }
            for (int i = 0; i < K / 8; i++)
                for (int t = 0; t < 4; t++)
                    v[(size_t)i * 64 + 4 * j + t] = r ? (uint8_t)((r[8 * i + t] & 15) | (r[8 * i + 4 + t] & 15) << 4) : 0;
        }
    }
    return 0;
}

/* int4: scales s and offsets off = z - 8 s [N, K/G] as float32; q4h: scales s and zeros z [N, K/G] as
 * float16 bits. */
TARGET int llmd_q4_pack(const uint8_t *q, const float *s, const float *off, int N, int K, int G, uint8_t *out) {
    return q4_pack(q, s, off, 4, N, K, G, out);
}

TARGET int llmd_q4h_pack(const uint8_t *q, const uint16_t *s, const uint16_t *z, int N, int K, int G, uint8_t *out) {
    return q4_pack(q, s, z, 2, N, K, G, out);
}

/* x float32 [M, K] -> xhl int8 [M, K/4, 8] (per 4 columns their hi bytes, then their lo - 128; AVX2:
 * xi itself, int16 [M, K] in column order), sx [M],
 * and per 64 columns the sums of hi and of lo - 128 (int32 [M, K/64, 2]); xi and its split as llmd.runtime.formats.quantized.split16 makes them. */
static TARGET void x16_split(const float *x, int M, int K, int8_t *xhl, int32_t *sums, float *sx, int8_t *xh,
                             int8_t *xl, int nt) {
    #pragma omp parallel for num_threads(nt) schedule(static) if (M >= 16 && nt > 1)
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * K;
        const float scale = sx[m] = row_scale(r, K, 32767.f);
        const __m512 inv = _mm512_set1_ps(1.f / scale);
        for (int k = 0; k < K; k += 64) {
            __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + k + 16 * j), inv));
                q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)), _mm512_set1_epi32(-32767));
                const __m512i h = _mm512_srai_epi32(q, 8);
                const __m512i l = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(255)), _mm512_set1_epi32(128));
                sh = _mm512_add_epi32(sh, h);
                sl = _mm512_add_epi32(sl, l);
                int8_t *to = xhl + 2 * ((size_t)m * K + k + 16 * j);
#ifndef LLMD_AVX2
                const __m128i hb = _mm512_cvtepi32_epi8(h), lb = _mm512_cvtepi32_epi8(l);
                if (xh) {           /* AMX: high bytes and low bytes as tiles' rows [., K] (amx_q8) */
                    _mm_storeu_si128((__m128i *)(xh + (size_t)m * K + k + 16 * j), hb);
                    _mm_storeu_si128((__m128i *)(xl + (size_t)m * K + k + 16 * j), lb);
                    continue;
                }
                _mm_storeu_si128((__m128i *)to, _mm_unpacklo_epi32(hb, lb));
                _mm_storeu_si128((__m128i *)(to + 16), _mm_unpackhi_epi32(hb, lb));
#else
                (void)xh;
                (void)xl;
                /* AVX2: xi itself, in column order (q8w_run reads four columns at a time) */
                _mm256_storeu_si256((__m256i *)to, _mm512_cvtepi32_epi16(q));
#endif
            }
            int32_t *to = sums + ((size_t)m * (K / 64) + k / 64) * 2;
            to[0] = _mm512_reduce_add_epi32(sh);
            to[1] = _mm512_reduce_add_epi32(sl);
        }
    }
}

/* The x side's corrections per row: int8 (groups 1): 128 sum hi, 128 sum (lo - 128) over the row;
 * int8g: per group 128 sum (256 hi + lo - 128) (cx [M, 2] or [M, groups]). */
static void x16_corrections(const int32_t *sums, int M, int K, int G, int32_t *cx) {
    const int chunks = K / 64, per = G ? G / 64 : chunks, groups = chunks / per;
    for (int m = 0; m < M; m++)
        for (int g = 0; g < groups; g++) {
            int32_t h = 0, l = 0;
            for (int c = g * per; c < (g + 1) * per; c++) {
                h += sums[((size_t)m * chunks + c) * 2];
                l += sums[((size_t)m * chunks + c) * 2 + 1];
            }
            if (G) {
                cx[(size_t)m * groups + g] = 128 * (256 * h + l);
            } else {
                cx[2 * m] = 128 * h;
                cx[2 * m + 1] = 128 * l;
            }
        }
}

/* int8's one rounding: y = (float)(256 H + L) sx s, where H = sum w hi and L = sum w lo are the exact
 * integer sums and 256 H + L = sum w xi is formed exactly in double (below 2^53) before it is rounded once
 * to float32, so the same value comes from any exact way of summing w xi (the AVX2 library's below). */
static inline TARGET __attribute__((always_inline)) __m512 q8_round(__m512d lo, __m512d hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo)), _mm512_cvtpd_ps(hi), 1);
}

#ifndef LLMD_AVX2
/* One row's sixteen outputs of an int8 block (blk) from its exact sums AH = sum (w + 128) hi and
 * AL = sum (w + 128) (lo - 128): H = AH - cx[0] and L = AL - cx[1] + the block's 128 sum w, then
 * q8_round(256 H + L) times the row's and the outputs' scales (the vector loop and the AMX path alike). */
static inline TARGET __attribute__((always_inline))
void q8_out(__m512i ah, __m512i al, const int32_t *cx, float sx, const uint8_t *blk, float *y, __mmask16 keep) {
    const __m512i wsum = _mm512_loadu_si512((const void *)blk);
    const __m512 s = _mm512_loadu_ps((const float *)(blk + 64));
    const __m512d k256 = _mm512_set1_pd(256.0);
    const __m512i h = _mm512_sub_epi32(ah, _mm512_set1_epi32(cx[0]));
    const __m512i l = _mm512_add_epi32(_mm512_sub_epi32(al, _mm512_set1_epi32(cx[1])), wsum);
    const __m512d lo = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(h)), k256),
                                     _mm512_cvtepi32_pd(_mm512_castsi512_si256(l)));
    const __m512d hi = _mm512_add_pd(_mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(h, 1)), k256),
                                     _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(l, 1)));
    _mm512_mask_storeu_ps(y, keep, _mm512_mul_ps(q8_round(lo, hi), _mm512_mul_ps(_mm512_set1_ps(sx), s)));
}

/* MM rows of x (xhl at stride 2 K: per 4 columns their four hi bytes, then the four lo - 128) times
 * block blk, PH sums per row and part taken in turn over the steps (independent chains for few rows;
 * exact, so the split changes nothing): y[m, 0..15] at stride N, the lanes of keep. */
static inline TARGET __attribute__((always_inline))
void q8_steps(const int8_t *xhl, const int MM, const int PH, int K, int i0, int i1,
              const uint8_t *u, size_t ahead, __m512i ah[][4], __m512i al[][4]) {
    const __m512i zero = _mm512_setzero_si512();
    for (int m = 0; m < MM; m++)
        for (int p = 0; p < PH; p++) ah[m][p] = al[m][p] = zero;
    for (int i = i0; i < i1; i += PH)
        for (int p = 0; p < PH; p++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(u + (size_t)(i + p) * 64));
            if (ahead) _mm_prefetch((const char *)u + (size_t)(i + p) * 64 + ahead, Q_HINT);
            for (int m = 0; m < MM; m++) {
                const int8_t *xr = xhl + 2 * ((size_t)m * K + 4 * (size_t)(i + p));
                ah[m][p] = dot4(ah[m][p], wv, xr);
                al[m][p] = dot4(al[m][p], wv, xr + 4);
            }
        }
    for (int m = 0; m < MM; m++)
        for (int p = 1; p < PH; p++) {
            ah[m][0] = _mm512_add_epi32(ah[m][0], ah[m][p]);
            al[m][0] = _mm512_add_epi32(al[m][0], al[m][p]);
        }
}

static inline TARGET __attribute__((always_inline))
void q8_tile(const int8_t *xhl, const int32_t *cx, const float *sx, const int MM, const int PH,
             int K, const uint8_t *blk, size_t ahead, float *y, int N, __mmask16 keep) {
    __m512i ah[8][4], al[8][4];
    if (ahead) q_prefetch_head(blk + ahead, 128);
    q8_steps(xhl, MM, PH, K, 0, K / 4, blk + 128, ahead, ah, al);
    for (int m = 0; m < MM; m++) q8_out(ah[m][0], al[m][0], cx + 2 * m, sx[m], blk, y + (size_t)m * N, keep);
}

static inline TARGET __attribute__((always_inline))
void q8g_tile(const int8_t *xhl, const int32_t *cx, const float *sx, const int MM, const int PH,
              int K, int G, const uint8_t *blk, size_t ahead, float *y, int N, __mmask16 keep) {
    const int groups = K / G;
    if (ahead) q_prefetch_head(blk + ahead, (size_t)128 * groups);
    const int32_t *wsum = (const int32_t *)blk;
    const float *scale = (const float *)(blk + (size_t)64 * groups);
    __m512i ah[8][4], al[8][4];
    __m512 acc[8];
    for (int m = 0; m < MM; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        q8_steps(xhl, MM, PH, K, g * G / 4, (g + 1) * G / 4, blk + (size_t)128 * groups, ahead, ah, al);
        const __m512i ws = _mm512_loadu_si512((const void *)(wsum + QB * g));
        const __m512 s = _mm512_loadu_ps(scale + QB * g);
        for (int m = 0; m < MM; m++) {
            __m512i d = _mm512_add_epi32(_mm512_slli_epi32(ah[m][0], 8), al[m][0]);
            d = _mm512_add_epi32(_mm512_sub_epi32(d, _mm512_set1_epi32(cx[(size_t)m * groups + g])), ws);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(_mm512_set1_ps(sx[m]), s), acc[m]);
        }
    }
    for (int m = 0; m < MM; m++) _mm512_mask_storeu_ps(y + (size_t)m * N, keep, acc[m]);
}
#else
/* AVX2: no byte products to split xi over, so the weights are widened instead. Each step's 64 bytes
 * (u = w + 128) become four vectors of 16-bit values (interleaved with zeros), and x is xi itself at 16 bits, a step's
 * four columns one 64-bit broadcast: vpmaddwd sums u xi over a pair of columns, two lanes per output.
 * That is one product per pair of columns and row where the byte form takes two per byte part of xi.
 * Over a run of at most Q8W_RUN steps a lane is at most Q8W_RUN 2 255 32767 and an output's two lanes
 * together below 2^31, so a run's S_u = sum u xi is exact in int32; with S_w = S_u - 128 sum xi (xi's
 * sums from x16_split) these are the byte form's exact sums: int8g's per group as int32, int8's whole
 * row added up over runs in double (exact), then q8_round. */
#define Q8W_RUN 64

/* S_u of RR (1 or 2) rows over weight steps i0..i1 (i1 - i0 <= Q8W_RUN) of a block's weights u: d[m][0]
 * holds outputs 0..7, d[m][1] outputs 8..15. */
static inline TARGET __attribute__((always_inline))
void q8w_rows(const int16_t *xi, const int RR, int K, int i0, int i1, const uint8_t *u, size_t ahead,
              __m256i d[][2]) {
    __m256i a[2][4];
    for (int m = 0; m < 2; m++)
        for (int j = 0; j < 4; j++) a[m][j] = _mm256_setzero_si256();
    /* one row: its odd steps into the second set of sums (i1 - i0 is even: K is a multiple of 64), two
     * steps' loads in flight */
    const int S = RR == 1 ? 2 : 1;
    for (int i = i0; i < i1; i += S)
        for (int h = 0; h < S; h++) {
            const uint8_t *at = u + (size_t)(i + h) * 64;
            if (ahead) _mm_prefetch((const char *)at + ahead, Q_HINT);
            /* bytes 0..7 | 16..23 of each half (outputs 0, 1 | 4, 5 of the first), 8..15 | 24..31 next */
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)at), v1 = _mm256_loadu_si256((const __m256i *)at + 1);
            const __m256i z = _mm256_setzero_si256();
            const __m256i w[4] = {_mm256_unpacklo_epi8(v0, z), _mm256_unpackhi_epi8(v0, z),
                                  _mm256_unpacklo_epi8(v1, z), _mm256_unpackhi_epi8(v1, z)};
            for (int m = 0; m < RR; m++) {
                int64_t four;
                memcpy(&four, xi + (size_t)m * K + 4 * (size_t)(i + h), 8);
                const __m256i xb = _mm256_set1_epi64x(four);
                for (int j = 0; j < 4; j++) a[m + h][j] = _mm256_add_epi32(a[m + h][j], _mm256_madd_epi16(w[j], xb));
            }
        }
    if (RR == 1)
        for (int j = 0; j < 4; j++) a[0][j] = _mm256_add_epi32(a[0][j], a[1][j]);
    /* an output's two lanes side by side: a[m][0] holds outputs 0, 1 | 4, 5 and a[m][1] 2, 3 | 6, 7, so
     * hadd gives 0..3 | 4..7 (a[m][2], a[m][3]: 8..15) */
    for (int m = 0; m < RR; m++) {
        d[m][0] = _mm256_hadd_epi32(a[m][0], a[m][1]);
        d[m][1] = _mm256_hadd_epi32(a[m][2], a[m][3]);
    }
}

/* The same for MM rows, two at a time (what sixteen 256-bit registers hold): the run's weights, read
 * for the first pair, come from the first level cache for the others. */
static inline TARGET __attribute__((always_inline))
void q8w_run(const int16_t *xi, const int MM, int K, int i0, int i1, const uint8_t *u, size_t ahead,
             __m256i d[][2]) {
    for (int m = 0; m + 1 < MM; m += 2)
        q8w_rows(xi + (size_t)m * K, 2, K, i0, i1, u, m ? 0 : ahead, d + m);
    if (MM & 1) q8w_rows(xi + (size_t)(MM - 1) * K, 1, K, i0, i1, u, MM > 1 ? 0 : ahead, d + MM - 1);
}

static inline TARGET __attribute__((always_inline))
void q8_tile(const int8_t *xhl, const int32_t *cx, const float *sx, const int MM, const int PH,
             int K, const uint8_t *blk, size_t ahead, float *y, int N, __mmask16 keep) {
    (void)PH;
    if (ahead) q_prefetch_head(blk + ahead, 128);
    __m256d t[8][4];
    for (int m = 0; m < MM; m++)
        for (int j = 0; j < 4; j++) t[m][j] = _mm256_setzero_pd();
    for (int i = 0; i < K / 4; i += Q8W_RUN) {
        __m256i d[8][2];
        q8w_run((const int16_t *)xhl, MM, K, i, i + Q8W_RUN < K / 4 ? i + Q8W_RUN : K / 4, blk + 128, ahead, d);
        for (int m = 0; m < MM; m++)
            for (int j = 0; j < 4; j++)
                t[m][j] = _mm256_add_pd(t[m][j], _mm256_cvtepi32_pd(j & 1 ? _mm256_extracti128_si256(d[m][j / 2], 1)
                                                                         : _mm256_castsi256_si128(d[m][j / 2])));
    }
    const __m512 s = _mm512_loadu_ps((const float *)(blk + 64));
    for (int m = 0; m < MM; m++) {
        /* 128 sum xi = 128 (256 sum hi + sum (lo - 128) + 128 K), exact in double */
        const __m256d c = _mm256_set1_pd(256.0 * cx[2 * m] + cx[2 * m + 1] + 16384.0 * K);
        const __m512d lo = {_mm256_sub_pd(t[m][0], c), _mm256_sub_pd(t[m][1], c)};
        const __m512d hi = {_mm256_sub_pd(t[m][2], c), _mm256_sub_pd(t[m][3], c)};
        _mm512_mask_storeu_ps(y + (size_t)m * N, keep,
                              _mm512_mul_ps(q8_round(lo, hi), _mm512_mul_ps(_mm512_set1_ps(sx[m]), s)));
    }
}

static inline TARGET __attribute__((always_inline))
void q8g_tile(const int8_t *xhl, const int32_t *cx, const float *sx, const int MM, const int PH,
              int K, int G, const uint8_t *blk, size_t ahead, float *y, int N, __mmask16 keep) {
    (void)PH;
    const int groups = K / G;
    if (ahead) q_prefetch_head(blk + ahead, (size_t)128 * groups);
    const float *scale = (const float *)(blk + (size_t)64 * groups);
    __m512 acc[8];
    for (int m = 0; m < MM; m++) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256i d[8][2];
        q8w_run((const int16_t *)xhl, MM, K, g * G / 4, (g + 1) * G / 4, blk + (size_t)128 * groups, ahead, d);
        const __m512 s = _mm512_loadu_ps(scale + QB * g);
        for (int m = 0; m < MM; m++) {
            /* 128 sum xi over the group = cx + 128 128 G, below 2^31 */
            const __m256i c = _mm256_set1_epi32(cx[(size_t)m * groups + g] + 16384 * G);
            const __m512i e = {_mm256_sub_epi32(d[m][0], c), _mm256_sub_epi32(d[m][1], c)};
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), _mm512_mul_ps(_mm512_set1_ps(sx[m]), s), acc[m]);
        }
    }
    for (int m = 0; m < MM; m++) _mm512_mask_storeu_ps(y + (size_t)m * N, keep, acc[m]);
}
#endif

/* The exact integer sums d[m] = sum q xq of MM rows over weight steps i0..i1 (8 columns each) of an int4
 * block: PH sums per row and nibble taken in turn over the steps (independent chains), added at the end. */
#ifndef LLMD_AVX2
static inline TARGET __attribute__((always_inline))
void q4_run(const int8_t *xq, const int MM, const int PH, int K, int i0, int i1, const uint8_t *q, size_t ahead,
            __m512i d[]) {
    const __m512i nib = _mm512_set1_epi8(0x0F), zero = _mm512_setzero_si512();
    __m512i a[8][4], b[8][4];
    for (int m = 0; m < MM; m++)
        for (int p = 0; p < PH; p++) a[m][p] = b[m][p] = zero;
    for (int i = i0; i < i1; i += PH)
        for (int p = 0; p < PH; p++) {
            const __m512i v = _mm512_loadu_si512((const void *)(q + (size_t)(i + p) * 64));
            if (ahead) _mm_prefetch((const char *)q + (size_t)(i + p) * 64 + ahead, Q_HINT);
            const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            for (int m = 0; m < MM; m++) {
                const int8_t *xr = xq + (size_t)m * K + 8 * (size_t)(i + p);
                a[m][p] = dot4(a[m][p], lo, xr);
                b[m][p] = dot4(b[m][p], hi, xr + 4);
            }
        }
    for (int m = 0; m < MM; m++) {
        d[m] = _mm512_add_epi32(a[m][0], b[m][0]);
        for (int p = 1; p < PH; p++) d[m] = _mm512_add_epi32(d[m], _mm512_add_epi32(a[m][p], b[m][p]));
    }
}
#else
/* AVX2: both nibbles' vpmaddubsw pairs of a step added in 16 bits, over four steps (each pair at most
 * 2 * 15 * 127, so four steps of two stay below 2^15), then widened once by vpmaddwd: exact, as above. */
static inline TARGET __attribute__((always_inline)) __m256i q4_pairs(__m256i v, const __m256i x4lo, const __m256i x4hi) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    return _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v, nib), x4lo),
                            _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), x4hi));
}
static inline TARGET __attribute__((always_inline))
void q4_run(const int8_t *xq, const int MM, const int PH, int K, int i0, int i1, const uint8_t *q, size_t ahead,
            __m512i d[]) {
    (void)PH;
    const __m256i one = _mm256_set1_epi16(1);
    for (int m = 0; m < MM; m++) d[m] = _mm512_setzero_si512();
    for (int i4 = i0; i4 < i1; i4 += 4) {
        __m256i s[8][2];
        for (int m = 0; m < MM; m++) s[m][0] = s[m][1] = _mm256_setzero_si256();
        for (int i = i4; i < i4 + 4 && i < i1; i++) {
            const uint8_t *at = q + (size_t)i * 64;
            if (ahead) _mm_prefetch((const char *)at + ahead, Q_HINT);
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)at), v1 = _mm256_loadu_si256((const __m256i *)at + 1);
            for (int m = 0; m < MM; m++) {
                const int8_t *xr = xq + (size_t)m * K + 8 * (size_t)i;
                int32_t lo4, hi4;
                memcpy(&lo4, xr, 4);
                memcpy(&hi4, xr + 4, 4);
                const __m256i xl = _mm256_set1_epi32(lo4), xh = _mm256_set1_epi32(hi4);
                s[m][0] = _mm256_add_epi16(s[m][0], q4_pairs(v0, xl, xh));
                s[m][1] = _mm256_add_epi16(s[m][1], q4_pairs(v1, xl, xh));
            }
        }
        for (int m = 0; m < MM; m++)
            d[m] = (__m512i){_mm256_add_epi32(d[m].lo, _mm256_madd_epi16(s[m][0], one)),
                             _mm256_add_epi32(d[m].hi, _mm256_madd_epi16(s[m][1], one))};
    }
}
#endif

/* Sixteen head values at p: float32, or (H16) float16 widened exactly. */
static inline TARGET __attribute__((always_inline)) __m512 q4_head(const uint8_t *p, const int H16) {
    return H16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps((const float *)p);
}

/* Group g's offsets of a block whose scales for g are s: float32 blocks hold them (B), q4h blocks hold the
 * zeros z and the offsets are z - 8 s, formed in one rounding. part: the bytes of A (and of B). */
static inline TARGET __attribute__((always_inline))
__m512 q4_offsets(const uint8_t *blk, size_t part, int g, __m512 s, const int H16) {
    const __m512 b = q4_head(blk + part + (size_t)(H16 ? 2 : 4) * QB * g, H16);
    return H16 ? _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, b) : b;
}

/* H16: the block's head holds float16 scales and zeros (q4h), else float32 scales and offsets. */
static inline TARGET __attribute__((always_inline))
void q4_tile(const int8_t *xq, const float *sx, const float *xs, const int MM, const int PH, const int H16, int K,
             int G, const uint8_t *blk, size_t ahead, float *y, int N, __mmask16 keep) {
    const int groups = K / G, nb = (K + 127) / 128, run = G < 128 ? G : 128, es = H16 ? 2 : 4;
    const size_t part = (size_t)16 * es * groups;        /* bytes of A (and of B) */
    if (ahead) q_prefetch_head(blk + ahead, 2 * part);
    const uint8_t *q = blk + 2 * part;
    __m512 acc[8], oac[8];
    for (int m = 0; m < MM; m++) acc[m] = oac[m] = _mm512_setzero_ps();
    for (int c = 0; c < K; c += run) {
        __m512i d[8];
        q4_run(xq, MM, PH, K, c / 8, (c + run) / 8, q, ahead, d);
        const int g = c / G;
        const __m512 s = q4_head(blk + (size_t)es * QB * g, H16);
        for (int m = 0; m < MM; m++) {
            const __m512 bs = _mm512_set1_ps(sx[(size_t)m * nb + c / 128]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[m]), _mm512_mul_ps(s, bs), acc[m]);
        }
        if ((c + run) % G == 0) {
            const __m512 o = q4_offsets(blk, part, g, s, H16);
            for (int m = 0; m < MM; m++)
                oac[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[(size_t)m * groups + g]), oac[m]);
        }
    }
    for (int m = 0; m < MM; m++) _mm512_mask_storeu_ps(y + (size_t)m * N, keep, _mm512_add_ps(acc[m], oac[m]));
}

/* Every block against every row: rows Q_CHUNK at a time, each chunk's rows shared out over as few
 * tiles of at most MOST rows as there can be, of near-equal sizes; blocks split across threads.
 * TILE(MM, PH) computes rows m.. of the tile against block blk into yb. */
#define Q_ROWS(MOST, TILE) \
    for (int c0 = 0; c0 < M; c0 += Q_CHUNK) { \
        const int c1 = c0 + Q_CHUNK < M ? c0 + Q_CHUNK : M, tiles = (c1 - c0 + MOST - 1) / MOST; \
        _Pragma("omp parallel for num_threads(nt) schedule(static)") \
        for (int b = 0; b < (N + QB - 1) / QB; b++) { \
            const uint8_t *blk = w + (size_t)b * bytes; \
            const __mmask16 keep = q_keep(N, b); \
            for (int t = 0, m = c0; t < tiles; t++) { \
                const int rows = (c1 - c0) / tiles + (t < (c1 - c0) % tiles); \
                float *yb = y + (size_t)m * N + QB * b; \
                const size_t ahead = t == 0 && b + 1 < (N + QB - 1) / QB ? bytes : 0; \
                switch (rows) { \
                case 1: TILE(1, 4) break; \
                case 2: TILE(2, 2) break; \
                case 3: TILE(3, 2) break; \
                case 4: TILE(4, 1) break; \
                case 5: TILE(5, 1) break; \
                case 6: TILE(6, 1) break; \
                case 7: TILE(7, 1) break; \
                default: TILE(8, 1) break; \
                } \
                m += rows; \
            } \
        } \
    }

#define Q8_TILE(MM, PH) q8_tile(xhl + 2 * (size_t)m * K, cx + 2 * (size_t)m, sx + m, MM, PH, K, blk, \
                                ahead, yb, N, keep);
#define Q8G_TILE(MM, PH) q8g_tile(xhl + 2 * (size_t)m * K, cx + (size_t)m * (K / G), sx + m, MM, PH, \
                                  K, G, blk, ahead, yb, N, keep);
#define Q4_TILE(MM, PH) q4_tile(xq + (size_t)m * K, sx + (size_t)m * nb, xs + (size_t)m * (K / G), MM, PH, 0, K, \
                                G, blk, ahead, yb, N, keep);
#define Q4H_TILE(MM, PH) q4_tile(xq + (size_t)m * K, sx + (size_t)m * nb, xs + (size_t)m * (K / G), MM, PH, 1, K, \
                                 G, blk, ahead, yb, N, keep);

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

/* The most rows the entry points take (prompts included). */
#define MANY_MAX_ROWS 8192

/* ---- int8 prompt rows on AMX ---------------------------------------------------------------- */
/* Where the CPU has AMX (tiles, int8) and the kernel lets this process use its tile registers, int8
 * products of many rows (prompts) take the tile unit: an int8 block's weight steps (64 bytes: 16
 * outputs by 4 columns, w + 128) are already a tile of the unit's right-hand layout, sixteen steps a
 * 64-column tile; x's high bytes and its low bytes - 128 are the left-hand tiles, 16 rows by 64 columns.
 * tdpbsud forms the same exact integer sums H and L as the vpdpbusd loop (signed x bytes times unsigned
 * weights, summed in 32 bits), and the same q8_tile arithmetic turns them into y: the same bits from
 * either path, whatever the row count, so the choice changes nothing a row computes.
 * int4 and q4h products take it too (amx_q4), from twice as many rows and 512 columns: their float
 * arithmetic per group of columns stays as it was, so the tile unit gains less there, and nothing at 16
 * rows or on narrow inputs.
 * llmd_amx_min_rows sets the fewest rows that take it (0 keeps the vector loop; a negative value only
 * asks) and returns the setting in force, 0 where AMX is not available or llmd_set_amx turned it off. */
#ifdef LLMD_AMX
static int amx_on = 1;

int llmd_set_amx(int on) {
    amx_on = on != 0;
    return amx_usable();
}

int amx_usable(void) {
    static int ok = -1;
    if (!amx_on) return 0;            /* asked before the tiles are requested: off never requests them */
    if (ok < 0) {
        unsigned a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        const int has = llmd_cpu_ok() && (d >> 24 & 1) && (d >> 25 & 1);
        /* Linux hands out the tile state on request: ARCH_REQ_XCOMP_PERM (0x1023), XTILEDATA (18) */
        ok = has && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return ok;
}

static int amx_min_rows = 16;

int llmd_amx_min_rows(int rows) {
    if (!amx_usable()) return 0;
    if (rows >= 0) amx_min_rows = rows;
    return amx_min_rows;
}

/* y [M, N] for int8 (G 0) weight w from x's tiles xh, xl [MP, K]; cx, sx as q8_tile takes them. Blocks
 * two at a time against 16 rows: tiles 0-3 the sums (high, low) of each block, 4-5 x's, 6-7 the blocks'. */
static AMX_TARGET void amx_q8(const int8_t *xh, const int8_t *xl, const int32_t *cx, const float *sx, int M, int MP,
                              int K, const uint8_t *w, size_t bytes, float *y, int N, int nt) {
    const int nblocks = (N + QB - 1) / QB, pairs = (nblocks + 1) / 2;
    #pragma omp parallel num_threads(nt)
    {
        amx_tiles_16x64();
        int32_t c[4][16][16] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int p = 0; p < pairs; p++) {
            const int b = 2 * p, both = b + 1 < nblocks;
            const uint8_t *b0 = w + (size_t)b * bytes, *b1 = b0 + bytes;
            for (int m0 = 0; m0 < MP; m0 += 16) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int k = 0; k < K; k += 64) {
                    _tile_loadd(4, xh + (size_t)m0 * K + k, K);
                    _tile_loadd(5, xl + (size_t)m0 * K + k, K);
                    _tile_loadd(6, b0 + 128 + (size_t)k * 16, 64);
                    _tile_dpbsud(0, 4, 6);
                    _tile_dpbsud(1, 5, 6);
                    if (both) {
                        _tile_loadd(7, b1 + 128 + (size_t)k * 16, 64);
                        _tile_dpbsud(2, 4, 7);
                        _tile_dpbsud(3, 5, 7);
                    }
                }
                amx_sums_out(c);
                for (int j = 0; j < 1 + both; j++) {
                    const __mmask16 keep = q_keep(N, b + j);
                    for (int r = 0; r < 16 && m0 + r < M; r++)
                        q8_out(_mm512_load_si512((const void *)c[2 * j][r]), _mm512_load_si512((const void *)c[2 * j + 1][r]),
                               cx + 2 * (m0 + r), sx[m0 + r], b0 + j * bytes, y + (size_t)(m0 + r) * N + QB * (b + j), keep);
                }
            }
        }
        _tile_release();
    }
}
/* y [M, N] for an int4 (h16 0) or q4h (h16 1) weight from xq [MP, K] (rows past M zero), sx, xs as
 * q4_tile takes them. Each run's exact sums d come from the tile unit (tdpbsud: x's bytes times the
 * weights' nibbles, widened into bt once per block), and q4_tile's float arithmetic follows in its
 * order: acc over the runs for 16 rows at a time, then oac over the groups from the offsets o (formed
 * once per block), then acc + oac: the same bits as q4_tile. 0, or -2 where a thread's buffers could
 * not be had. */
static AMX_TARGET int amx_q4(const int8_t *xq, const float *sx, const float *xs, int M, int MP, int K, int G,
                             const uint8_t *w, size_t bytes, float *y, int N, int nt, const int h16) {
    const int groups = K / G, nb = (K + 127) / 128, run = G < 128 ? G : 128, kc = run < 64 ? run : 64;
    const int es = h16 ? 2 : 4, nblocks = (N + QB - 1) / QB;
    const size_t part = (size_t)16 * es * groups;
    int failed = 0;
    #pragma omp parallel num_threads(nt)
    {
        uint8_t *bt = aligned_alloc(64, (size_t)K * 16 + (size_t)groups * 64);
        float *ob = (float *)(bt + (size_t)K * 16);
        if (!bt) {
            #pragma omp atomic write
            failed = 1;
        }
        amx_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 2; t++) {               /* two runs in flight: sums 0-1, x 2-3, weights 4-5 */
            cfg.rows[t] = cfg.rows[2 + t] = 16;
            cfg.colsb[t] = 64;
            cfg.colsb[2 + t] = kc;                  /* x: 16 rows by kc columns */
            cfg.rows[4 + t] = kc / 4;               /* weights: kc columns, four to a row of 64 bytes */
            cfg.colsb[4 + t] = 64;
        }
        _tile_loadconfig(&cfg);
        int32_t c[2][16][16] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int b = 0; b < nblocks; b++) {
            if (!bt) continue;
            const uint8_t *blk = w + (size_t)b * bytes, *q = blk + 2 * part;
            const __m512i nib = _mm512_set1_epi8(0x0F);
            for (int i = 0; i < K / 8; i++) {       /* step i's low nibbles: row 2i; its high ones: 2i + 1 */
                const __m512i v = _mm512_loadu_si512((const void *)(q + (size_t)i * 64));
                _mm512_store_si512((void *)(bt + (size_t)i * 128), _mm512_and_si512(v, nib));
                _mm512_store_si512((void *)(bt + (size_t)i * 128 + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
            }
            for (int g = 0; g < groups; g++)
                _mm512_store_ps(ob + (size_t)g * 16, q4_offsets(blk, part, g, q4_head(blk + (size_t)es * QB * g, h16), h16));
            const __mmask16 keep = q_keep(N, b);
            for (int m0 = 0; m0 < MP; m0 += 16) {
                __m512 acc[16];
                for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
                for (int c0 = 0; c0 < K; c0 += 2 * run) {
                    const int two = c0 + run < K;
                    _tile_zero(0);
                    _tile_zero(1);
                    for (int k = 0; k < run; k += kc) {
                        _tile_loadd(2, xq + (size_t)m0 * K + c0 + k, K);
                        _tile_loadd(4, bt + (size_t)(c0 + k) * 16, 64);
                        _tile_dpbsud(0, 2, 4);
                        if (two) {
                            _tile_loadd(3, xq + (size_t)m0 * K + c0 + run + k, K);
                            _tile_loadd(5, bt + (size_t)(c0 + run + k) * 16, 64);
                            _tile_dpbsud(1, 3, 5);
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    for (int h = 0; h < 1 + two; h++) {
                        const int cc = c0 + h * run;
                        const __m512 sg = q4_head(blk + (size_t)es * QB * (cc / G), h16);
                        for (int r = 0; r < 16; r++) {
                            const int m = m0 + r < M ? m0 + r : M - 1;       /* padding rows: any scale */
                            const __m512 bs = _mm512_set1_ps(sx[(size_t)m * nb + cc / 128]);
                            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[h][r])),
                                                     _mm512_mul_ps(sg, bs), acc[r]);
                        }
                    }
                }
                for (int r = 0; r < 16 && m0 + r < M; r++) {
                    const float *xr = xs + (size_t)(m0 + r) * groups;
                    __m512 oac = _mm512_setzero_ps();
                    for (int g = 0; g < groups; g++)
                        oac = _mm512_fmadd_ps(_mm512_load_ps(ob + (size_t)g * 16), _mm512_set1_ps(xr[g]), oac);
                    _mm512_mask_storeu_ps(y + (size_t)(m0 + r) * N + QB * b, keep, _mm512_add_ps(acc[r], oac));
                }
            }
        }
        _tile_release();
        free(bt);
    }
    return failed ? -2 : 0;
}
#else
int llmd_set_amx(int on) {
    (void)on;
    return 0;
}

int llmd_amx_min_rows(int rows) {
    (void)rows;
    return 0;
}
#endif

/* x [M, K] times a packed int8 (G = 0) or int8g (G: 64, 128, 256) weight of N outputs -> y [M, N]. */
TARGET int llmd_q8_x(const float *x, int M, int K, int G, const uint8_t *w, float *y, int N, int nt) {
    const int groups = q8_groups(K, G);
    if (!llmd_cpu_ok() || !groups || M < 1 || M > MANY_MAX_ROWS || N < 1) return -1;
    const int per_row = G ? groups : 2;
#ifdef LLMD_AMX
    const int MP = !G && amx_min_rows && M >= amx_min_rows && amx_usable() ? (M + 15) / 16 * 16 : 0;
#else
    const int MP = 0;
#endif
    const size_t head = (size_t)M * K * 2 + (size_t)M * (K / 64) * 8 + (size_t)M * per_row * 4 + (size_t)M * 4;
    int8_t *xhl = scratch_for(0, (head + 63) / 64 * 64 + (size_t)MP * K * 2);
    if (!xhl) return -2;
    int32_t *sums = (int32_t *)(xhl + 2 * (size_t)M * K), *cx = sums + (size_t)M * (K / 64) * 2;
    float *sx = (float *)(cx + (size_t)M * per_row);
    /* AMX: x's tiles (high bytes [MP, K], then low bytes) after the rest, at a line boundary, rows past M zero */
    int8_t *xh = MP ? xhl + (head + 63) / 64 * 64 : 0, *xl = MP ? xh + (size_t)MP * K : 0;
    if (MP > M) {
        memset(xh + (size_t)M * K, 0, (size_t)(MP - M) * K);
        memset(xl + (size_t)M * K, 0, (size_t)(MP - M) * K);
    }
    x16_split(x, M, K, xhl, sums, sx, xh, xl, nt);
    x16_corrections(sums, M, K, G, cx);
    const size_t bytes = q_block_bytes(K, groups, 0, 4);
#ifdef LLMD_AMX
    if (MP) {
        amx_q8(xh, xl, cx, sx, M, MP, K, w, bytes, y, N, nt);
        return 0;
    }
#endif
    if (G) {
        Q_ROWS(8, Q8G_TILE);
    } else {
        Q_ROWS(8, Q8_TILE);
    }
    return 0;
}

/* x [M, K] times a packed int4 (h16 0) or q4h (h16 1) weight (groups of G: 32, 64, 128, 256) of N outputs
 * -> y [M, N]. */
static TARGET int q4_x(const float *x, int M, int K, int G, const uint8_t *w, float *y, int N, int nt, int h16) {
    const int groups = q4_groups(K, G);
    if (!llmd_cpu_ok() || !groups || M < 1 || M > MANY_MAX_ROWS || N < 1) return -1;
    const int nb = (K + 127) / 128;
#ifdef LLMD_AMX
    const int tiles = amx_min_rows && M >= 2 * amx_min_rows && K >= 512 && amx_usable();
#else
    const int tiles = 0;
#endif
    const int MP = tiles ? (M + 15) / 16 * 16 : M;
    float *sx = scratch_for(0, (size_t)M * nb * 4 + (size_t)M * groups * 4 + (size_t)MP * K + 64);
    if (!sx) return -2;
    float *xs = sx + (size_t)M * nb;
    int8_t *xq = (int8_t *)(xs + (size_t)M * groups);
    x8_blocks(x, M, K, G, xq, sx, xs);
    const size_t bytes = q_block_bytes(K, groups, 1, h16 ? 2 : 4);
#ifdef LLMD_AMX
    if (tiles) {
        memset(xq + (size_t)M * K, 0, (size_t)(MP - M) * K);         /* rows past M as zeros */
        return amx_q4(xq, sx, xs, M, MP, K, G, w, bytes, y, N, nt, h16);
    }
#endif
    if (h16) {
        Q_ROWS(6, Q4H_TILE);
    } else {
        Q_ROWS(6, Q4_TILE);
    }
    return 0;
}

TARGET int llmd_q4_x(const float *x, int M, int K, int G, const uint8_t *w, float *y, int N, int nt) {
    return q4_x(x, M, K, G, w, y, N, nt, 0);
}

TARGET int llmd_q4h_x(const float *x, int M, int K, int G, const uint8_t *w, float *y, int N, int nt) {
    return q4_x(x, M, K, G, w, y, N, nt, 1);
}

/* ---- int8 weights, int8 activations (w8a8), one output row at a time ------------------------ */
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


/* The shapes the w8a8 product takes: 1..MANY_MAX_ROWS rows of x, K a multiple of 64 below 2^16. */
static int takes(int M, int K) {
    return llmd_cpu_ok() && M >= 1 && M <= MANY_MAX_ROWS && K % 64 == 0 && K > 0 && K < 65536;
}

TARGET int llmd_w8a8_x(const float *x, int M, int K, const int8_t *w, const float *s, const float *bias, float *y,
                       int N, int nt) {
    if (!takes(M, K)) return -1;
    uint8_t *xa = scratch_for(0, (size_t)M * K + (size_t)M * (K / 64) * 8 + (size_t)M * 4 + 64);
    if (!xa) return -2;
    uint64_t *neg = (uint64_t *)(xa + (size_t)M * K);
    float *sx = (float *)(neg + (size_t)M * (K / 64));
    w8a8_quantize(x, M, K, xa, neg, sx);
    w8a8_rows(xa, neg, sx, M, K, w, s, bias, y, N, nt);
    return 0;
}

/* ---- chosen outputs of an int8 / int8g product --------------------------------------------- */
/* y[m, c] = the value llmd_q8_x gives output idx[c] of row m, computed from the weight as stored (int8
 * w [N, K] with s [N], G = 0, or s [N, K/G]) rather than from its blocks: x as the same 16-bit integers
 * (x16_split's), each group's integer sum exactly, then the float32 steps of q8_tile / q8g_tile in
 * their order (int8g: y = fma(D_g, sx s_g, y) group by group; int8: (float)(256 H + L) sx s, q8_round's). The head
 * screen (llmd.runtime.formats.head_screen) scores the few outputs it cannot rule out with it. */
TARGET int llmd_q8_pick(const float *x, int M, int K, int G, const int8_t *w, const float *s, const int64_t *idx,
                        int C, float *y, int nt) {
    const int groups = q8_groups(K, G);
    if (!llmd_cpu_ok() || !groups || M < 1 || M > MANY_MAX_ROWS || C < 1) return -1;
    int16_t *xi = scratch_for(0, (size_t)M * K * 2 + (size_t)M * 4 + 64);
    if (!xi) return -2;
    float *sx = (float *)(xi + (size_t)M * K);
    for (int m = 0; m < M; m++) {
        const float *r = x + (size_t)m * K;
        const float scale = sx[m] = row_scale(r, K, 32767.f);
        const __m512 inv = _mm512_set1_ps(1.f / scale);
        for (int k = 0; k < K; k += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + k), inv));
            q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(32767)), _mm512_set1_epi32(-32767));
            _mm256_storeu_si256((__m256i *)(xi + (size_t)m * K + k), _mm512_cvtepi32_epi16(q));
        }
    }
    const int width = K / groups;
    const __m512i byte = _mm512_set1_epi16(255);
    #pragma omp parallel for num_threads(nt) schedule(static) if ((size_t)C * M * K > (1u << 18))
    for (int c = 0; c < C; c++) {
        const int8_t *wr = w + (size_t)idx[c] * K;
        const float *sr = s + (size_t)idx[c] * (G ? groups : 1);
        for (int m = 0; m < M; m++) {
            const int16_t *xr = xi + (size_t)m * K;
            float acc = 0.f;
            for (int g = 0; g < groups; g++) {
                __m512i d = _mm512_setzero_si512(), h = d, l = d;
                for (int k = g * width; k < (g + 1) * width; k += 32) {
                    const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(wr + k)));
                    const __m512i xv = _mm512_loadu_si512((const void *)(xr + k));
                    if (G) {
                        d = _mm512_add_epi32(d, _mm512_madd_epi16(wv, xv));
                    } else {         /* hi = xi >> 8 and lo = xi & 255, as the int8 kernel sums them */
                        h = _mm512_add_epi32(h, _mm512_madd_epi16(wv, _mm512_srai_epi16(xv, 8)));
                        l = _mm512_add_epi32(l, _mm512_madd_epi16(wv, _mm512_and_si512(xv, byte)));
                    }
                }
                if (G) {
                    acc = fmaf((float)_mm512_reduce_add_epi32(d), sx[m] * sr[g], acc);
                } else {
                    const float v = (float)(256.0 * _mm512_reduce_add_epi32(h) + _mm512_reduce_add_epi32(l));
                    acc = v * (sx[m] * sr[0]);
                }
            }
            y[(size_t)m * C + c] = acc;
        }
    }
    return 0;
}

/* The head screen's candidates (llmd.runtime.formats.head_screen). xp [M, K]: the rows of x with the
 * screen's int4 columns first (KM of them), then its int8 ones; s [M, V] the screen's scores; norms [4, V]
 * each output's bound norms (E_M, E_O, F_M, G). Row m's factors c = (|x_M|, |x_O|, e4, d), so that
 * R[m, n] = sum_j norms[j, n] c[j] bounds |exact - s| (head_screen.py says why):
 *   e4 = 0.505 / 127 sqrt(sum over x_M's blocks of 128 columns (64 at a ragged end) of width max|x|^2)
 *   d  = 2 0.505 / 32767 sqrt(K) max|x| + margin (|x| + 1)
 * summed in double and rounded up. Row m's floor is the lower bound s - R of its highest score (the
 * first, on a tie); out receives every n (ascending) whose s + R reaches some row's floor. Returns their
 * count, or -3 where a score is not finite (the caller reads the whole head). */
TARGET int llmd_screen_select(const float *xp, int M, int K, int KM, float margin, const float *s, int V,
                              const float *norms, int64_t *out) {
    if (!llmd_cpu_ok() || M < 1 || M > 64 || V < 16 || KM < 64 || KM % 64 || KM >= K) return -1;
    float floor[64], coef[64][4];
    for (int m = 0; m < M; m++) {
        const float *x = xp + (size_t)m * K;
        double a = 0, b = 0, e = 0, top = 0;
        for (int c = 0; c < KM; c += 128) {
            const int width = KM - c < 128 ? 64 : 128;
            double peak = 0;
            for (int k = c; k < c + width; k++) {
                const double v = fabs((double)x[k]);
                a += v * v;
                peak = v > peak ? v : peak;
            }
            e += width * peak * peak;
            top = peak > top ? peak : top;
        }
        for (int k = KM; k < K; k++) {
            const double v = fabs((double)x[k]);
            b += v * v;
            top = v > top ? v : top;
        }
        const double c4[4] = {sqrt(a), sqrt(b), 0.505 / 127 * sqrt(e),
                              2 * 0.505 / 32767 * sqrt((double)K) * top + margin * (sqrt(a + b) + 1)};
        for (int j = 0; j < 4; j++) coef[m][j] = nextafterf((float)(c4[j] * (1 + 1e-6)), INFINITY);
    }
    for (int m = 0; m < M; m++) {
        int64_t at;
        float top, lowest;
        if (row_first_max(s + (size_t)m * V, V, &at, &top, &lowest) || !isfinite(top) || !isfinite(lowest))
            return -3;
        const float *c = coef[m];
        const float reach = fmaf(norms[3 * (size_t)V + at], c[3], fmaf(norms[2 * (size_t)V + at], c[2],
                                 fmaf(norms[(size_t)V + at], c[1], norms[at] * c[0])));
        floor[m] = top - reach;
    }
    int count = 0, n = 0;
    for (; n + 16 <= V; n += 16) {
        __mmask16 hit = 0;
        const __m512 n0 = _mm512_loadu_ps(norms + n), n1 = _mm512_loadu_ps(norms + V + n);
        const __m512 n2 = _mm512_loadu_ps(norms + 2 * (size_t)V + n), n3 = _mm512_loadu_ps(norms + 3 * (size_t)V + n);
        for (int m = 0; m < M; m++) {
            const float *c = coef[m];
            __m512 r = _mm512_mul_ps(n0, _mm512_set1_ps(c[0]));
            r = _mm512_fmadd_ps(n1, _mm512_set1_ps(c[1]), r);
            r = _mm512_fmadd_ps(n2, _mm512_set1_ps(c[2]), r);
            r = _mm512_fmadd_ps(n3, _mm512_set1_ps(c[3]), r);
            const __m512 up = _mm512_add_ps(_mm512_loadu_ps(s + (size_t)m * V + n), r);
            hit |= _mm512_cmp_ps_mask(up, _mm512_set1_ps(floor[m]), _CMP_GE_OQ);
        }
        while (hit) {
            const int j = __builtin_ctz(hit);
            out[count++] = n + j;
            hit &= hit - 1;
        }
    }
    for (; n < V; n++)
        for (int m = 0; m < M; m++) {
            const float *c = coef[m];
            const float r = fmaf(norms[3 * (size_t)V + n], c[3], fmaf(norms[2 * (size_t)V + n], c[2],
                                 fmaf(norms[(size_t)V + n], c[1], norms[n] * c[0])));
            if (s[(size_t)m * V + n] + r >= floor[m]) {
                out[count++] = n;
                break;
            }
        }
    return count;
}
