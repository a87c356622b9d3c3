/* The AVX-512 operations llmd's kernels use, for CPUs with AVX2, FMA and F16C only.
 *
 * Built when kernels.h is compiled with LLMD_AVX2 defined (llmd.runtime.kernels builds that second
 * library where the CPU lacks AVX-512 with VNNI). Each 512-bit vector is a pair of 256-bit halves, a
 * 16-bit mask a plain integer, and every operation the same lane-wise arithmetic as the instruction
 * it stands for: float lanes round alike, horizontal sums add in the order GCC's AVX-512 reductions
 * do, and vpdpbusd's byte products are summed exactly. So the kernels give the same numbers from
 * either library; only their speed differs. (int8's products have their own AVX2 loop in quant.c,
 * whose different exact sums give the same numbers.) Only the forms the kernels use are here: a new
 * use of an AVX-512 operation needs its pair below before the AVX2 library compiles. */
#ifndef LLMD_AVX2_H
#define LLMD_AVX2_H

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define V_INLINE static inline __attribute__((target("avx2,fma,f16c"), always_inline))

typedef struct { __m256 lo, hi; } llmd_v16f;
typedef struct { __m256i lo, hi; } llmd_v16i;
typedef struct { __m256d lo, hi; } llmd_v8d;

#define __m512 llmd_v16f
#define __m512i llmd_v16i
#define __m512d llmd_v8d

/* ---- masks: bit i of a 16-bit mask is lane i ----------------------------------------------- */

V_INLINE __m256i v_lanes8(unsigned bits) {           /* eight 32-bit lanes, all ones where bit set */
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}

V_INLINE __m256i v_bytes32(uint32_t bits) {          /* thirty-two byte lanes, all ones where bit set */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}

V_INLINE unsigned v_mask_ps(__m256 lo, __m256 hi) {
    return (unsigned)_mm256_movemask_ps(lo) | (unsigned)_mm256_movemask_ps(hi) << 8;
}

/* ---- float32 -------------------------------------------------------------------------------- */

#define V_F(a, b) ((__m512){a, b})

V_INLINE __m512 _llmd_setzero_ps(void) { return V_F(_mm256_setzero_ps(), _mm256_setzero_ps()); }
V_INLINE __m512 _llmd_set1_ps(float v) { return V_F(_mm256_set1_ps(v), _mm256_set1_ps(v)); }
V_INLINE __m512 _llmd_loadu_ps(const void *p) {
    return V_F(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}
V_INLINE void _llmd_storeu_ps(void *p, __m512 v) {
    _mm256_storeu_ps((float *)p, v.lo);
    _mm256_storeu_ps((float *)p + 8, v.hi);
}
V_INLINE void _llmd_mask_storeu_ps(void *p, __mmask16 k, __m512 v) {
    _mm256_maskstore_ps((float *)p, v_lanes8(k & 0xFF), v.lo);
    _mm256_maskstore_ps((float *)p + 8, v_lanes8((k >> 8) & 0xFF), v.hi);
}
/* a lane-wise operation of two vectors, half by half */
#define V_PAIRWISE(T, NAME, OP) V_INLINE T NAME(T a, T b) { return (T){OP(a.lo, b.lo), OP(a.hi, b.hi)}; }
V_PAIRWISE(__m512, _llmd_add_ps, _mm256_add_ps)
V_PAIRWISE(__m512, _llmd_sub_ps, _mm256_sub_ps)
V_PAIRWISE(__m512, _llmd_mul_ps, _mm256_mul_ps)
V_PAIRWISE(__m512, _llmd_div_ps, _mm256_div_ps)
V_PAIRWISE(__m512, _llmd_max_ps, _mm256_max_ps)
V_PAIRWISE(__m512, _llmd_min_ps, _mm256_min_ps)
V_INLINE __m512 _llmd_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    return V_F(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
V_INLINE __m512 _llmd_fnmadd_ps(__m512 a, __m512 b, __m512 c) {
    return V_F(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
V_INLINE __m512 _llmd_abs_ps(__m512 a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return V_F(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m));
}
/* the exponents exp_ps passes (integers in [-126, 127]): 2^n built exactly, one rounding in the product */
V_INLINE __m512 _llmd_scalef_ps(__m512 p, __m512 n) {
    const __m256i lo = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(n.lo), _mm256_set1_epi32(127)),
                                        _mm256_set1_epi32(-126));
    const __m256i hi = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(n.hi), _mm256_set1_epi32(127)),
                                        _mm256_set1_epi32(-126));
    const __m256i bias = _mm256_set1_epi32(127);
    return V_F(_mm256_mul_ps(p.lo, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(lo, bias), 23))),
               _mm256_mul_ps(p.hi, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(hi, bias), 23))));
}
#define _llmd_roundscale_ps(v, imm) \
    ({ const __m512 _v = (v); V_F(_mm256_round_ps(_v.lo, (imm)), _mm256_round_ps(_v.hi, (imm))); })
#define _llmd_cmp_ps_mask(a, b, imm) \
    ({ const __m512 _a = (a), _b = (b); \
       (__mmask16)v_mask_ps(_mm256_cmp_ps(_a.lo, _b.lo, (imm)), _mm256_cmp_ps(_a.hi, _b.hi, (imm))); })
V_INLINE __m512 _llmd_mask_blend_ps(__mmask16 k, __m512 a, __m512 b) {
    return V_F(_mm256_blendv_ps(a.lo, b.lo, _mm256_castsi256_ps(v_lanes8(k & 0xFF))),
               _mm256_blendv_ps(a.hi, b.hi, _mm256_castsi256_ps(v_lanes8((k >> 8) & 0xFF))));
}
V_INLINE __m512 _llmd_maskz_mov_ps(__mmask16 k, __m512 a) {
    return V_F(_mm256_and_ps(a.lo, _mm256_castsi256_ps(v_lanes8(k & 0xFF))),
               _mm256_and_ps(a.hi, _mm256_castsi256_ps(v_lanes8((k >> 8) & 0xFF))));
}

/* horizontal, in the order of GCC's AVX-512 reductions: the upper 256 bits onto the lower, then the
 * upper 128 onto the lower, then lanes {2, 3} onto {0, 1}, then lane 1 onto lane 0 */
V_INLINE __m128 v_fold4(__m512 a, const int op) {
    const __m256 t = op == 0 ? _mm256_add_ps(a.hi, a.lo) : op == 1 ? _mm256_max_ps(a.hi, a.lo) : _mm256_min_ps(a.hi, a.lo);
    const __m128 h = _mm256_extractf128_ps(t, 1), l = _mm256_castps256_ps128(t);
    const __m128 u = op == 0 ? _mm_add_ps(h, l) : op == 1 ? _mm_max_ps(h, l) : _mm_min_ps(h, l);
    const __m128 s = _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2));
    return op == 0 ? _mm_add_ps(u, s) : op == 1 ? _mm_max_ps(u, s) : _mm_min_ps(u, s);
}
V_INLINE float _llmd_reduce_add_ps(__m512 a) { const __m128 w = v_fold4(a, 0); return w[0] + w[1]; }
V_INLINE float _llmd_reduce_max_ps(__m512 a) {
    const __m128 w = v_fold4(a, 1);
    return _mm_max_ps(w, _mm_shuffle_ps(w, w, _MM_SHUFFLE(0, 1, 0, 1)))[0];
}
V_INLINE float _llmd_reduce_min_ps(__m512 a) {
    const __m128 w = v_fold4(a, 2);
    return _mm_min_ps(w, _mm_shuffle_ps(w, w, _MM_SHUFFLE(0, 1, 0, 1)))[0];
}

/* per 128-bit lane, as the 512-bit forms */
V_PAIRWISE(__m512, _llmd_unpacklo_ps, _mm256_unpacklo_ps)
V_PAIRWISE(__m512, _llmd_unpackhi_ps, _mm256_unpackhi_ps)
V_PAIRWISE(__m512d, _llmd_unpacklo_pd, _mm256_unpacklo_pd)
V_PAIRWISE(__m512d, _llmd_unpackhi_pd, _mm256_unpackhi_pd)
V_INLINE __m512d _llmd_castps_pd(__m512 a) { return (__m512d){_mm256_castps_pd(a.lo), _mm256_castps_pd(a.hi)}; }
V_INLINE __m512 _llmd_castpd_ps(__m512d a) { return V_F(_mm256_castpd_ps(a.lo), _mm256_castpd_ps(a.hi)); }
V_INLINE __m512 _llmd_castsi512_ps(__m512i a) { return V_F(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)); }

/* 128-bit lane i (0..3) of a */
V_INLINE __m128 v_lane(__m512 a, int i) {
    switch (i & 3) {
    case 0: return _mm256_castps256_ps128(a.lo);
    case 1: return _mm256_extractf128_ps(a.lo, 1);
    case 2: return _mm256_castps256_ps128(a.hi);
    default: return _mm256_extractf128_ps(a.hi, 1);
    }
}
/* lanes 0, 1 from a and 2, 3 from b, each picked by two bits of imm */
V_INLINE __m512 _llmd_shuffle_f32x4(__m512 a, __m512 b, const int imm) {
    return V_F(_mm256_set_m128(v_lane(a, imm >> 2), v_lane(a, imm)),
               _mm256_set_m128(v_lane(b, imm >> 6), v_lane(b, imm >> 4)));
}

V_INLINE __m512 _llmd_cvtepi32_ps(__m512i a) { return V_F(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
V_INLINE __m512i _llmd_cvtps_epi32(__m512 a) {
    return (__m512i){_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)};
}
/* eight doubles to float32 each half, rounded as vcvtpd2ps; the halves of a vector put together */
V_INLINE __m256 _llmd_cvtpd_ps(__m512d a) { return _mm256_set_m128(_mm256_cvtpd_ps(a.hi), _mm256_cvtpd_ps(a.lo)); }
V_INLINE __m512 _llmd_castps256_ps512(__m256 a) { return V_F(a, _mm256_setzero_ps()); }
V_INLINE __m512 _llmd_insertf32x8(__m512 a, __m256 b, const int upper) { return upper ? V_F(a.lo, b) : V_F(b, a.hi); }
V_INLINE __m512 _llmd_cvtph_ps(__m256i h) {
    return V_F(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}

/* ---- integers ------------------------------------------------------------------------------- */

#define V_I(a, b) ((__m512i){a, b})

V_INLINE __m512i _llmd_setzero_si512(void) { return V_I(_mm256_setzero_si256(), _mm256_setzero_si256()); }
V_INLINE __m512i _llmd_set1_epi32(int v) { return V_I(_mm256_set1_epi32(v), _mm256_set1_epi32(v)); }
V_INLINE __m512i _llmd_set1_epi16(short v) { return V_I(_mm256_set1_epi16(v), _mm256_set1_epi16(v)); }
V_INLINE __m512i _llmd_set1_epi8(char v) { return V_I(_mm256_set1_epi8(v), _mm256_set1_epi8(v)); }
V_INLINE __m512i _llmd_loadu_si512(const void *p) {
    return V_I(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
V_PAIRWISE(__m512i, _llmd_add_epi32, _mm256_add_epi32)
V_PAIRWISE(__m512i, _llmd_sub_epi32, _mm256_sub_epi32)
V_PAIRWISE(__m512i, _llmd_min_epi32, _mm256_min_epi32)
V_PAIRWISE(__m512i, _llmd_max_epi32, _mm256_max_epi32)
V_PAIRWISE(__m512i, _llmd_and_si512, _mm256_and_si256)
V_PAIRWISE(__m512i, _llmd_madd_epi16, _mm256_madd_epi16)
V_INLINE __m512i _llmd_abs_epi32(__m512i a) { return V_I(_mm256_abs_epi32(a.lo), _mm256_abs_epi32(a.hi)); }
V_INLINE __m512i _llmd_slli_epi32(__m512i a, int n) { return V_I(_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)); }
V_INLINE __m512i _llmd_srai_epi32(__m512i a, int n) { return V_I(_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)); }
V_INLINE __m512i _llmd_srai_epi16(__m512i a, int n) { return V_I(_mm256_srai_epi16(a.lo, n), _mm256_srai_epi16(a.hi, n)); }
V_INLINE __m512i _llmd_srli_epi16(__m512i a, int n) { return V_I(_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)); }
V_INLINE __mmask16 _llmd_cmplt_epi32_mask(__m512i a, __m512i b) {
    return (__mmask16)v_mask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b.lo, a.lo)),
                                _mm256_castsi256_ps(_mm256_cmpgt_epi32(b.hi, a.hi)));
}
/* lanes of k: a - b (bytes), else src's */
V_INLINE __m512i _llmd_mask_sub_epi8(__m512i src, __mmask64 k, __m512i a, __m512i b) {
    return V_I(_mm256_blendv_epi8(src.lo, _mm256_sub_epi8(a.lo, b.lo), v_bytes32((uint32_t)k)),
               _mm256_blendv_epi8(src.hi, _mm256_sub_epi8(a.hi, b.hi), v_bytes32((uint32_t)(k >> 32))));
}
V_INLINE int _llmd_reduce_add_epi32(__m512i a) {
    const __m256i t = _mm256_add_epi32(a.hi, a.lo);
    __m128i u = _mm_add_epi32(_mm256_extracti128_si256(t, 1), _mm256_castsi256_si128(t));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(u);
}
V_INLINE __m512i _llmd_cvtepu16_epi32(__m256i h) {
    return V_I(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)));
}
V_INLINE __m512i _llmd_cvtepi8_epi16(__m256i b) {
    return V_I(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(b)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1)));
}
/* sixteen int32 -> their low bytes (truncation, as vpmovdb) */
V_INLINE __m128i _llmd_cvtepi32_epi8(__m512i a) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i l = _mm256_shuffle_epi8(a.lo, pick), h = _mm256_shuffle_epi8(a.hi, pick);
    const __m128i l2 = _mm_unpacklo_epi32(_mm256_castsi256_si128(l), _mm256_extracti128_si256(l, 1));
    const __m128i h2 = _mm_unpacklo_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    return _mm_unpacklo_epi64(l2, h2);
}
/* sixteen int32 -> their low halves (truncation, as vpmovdw) */
V_INLINE __m256i _llmd_cvtepi32_epi16(__m512i a) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i l = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a.lo, pick), 0x08);
    const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a.hi, pick), 0x08);
    return _mm256_set_m128i(_mm256_castsi256_si128(h), _mm256_castsi256_si128(l));
}

/* acc + per 32-bit lane the four products of unsigned bytes of a and signed bytes of b, exactly
 * (vpdpbusd): even and odd bytes widened to 16 bits, each pair of products summed in 32 bits. */
V_INLINE __m256i v_dpbusd(__m256i acc, __m256i a, __m256i b) {
    const __m256i ae = _mm256_and_si256(a, _mm256_set1_epi16(0x00FF)), ao = _mm256_srli_epi16(a, 8);
    const __m256i be = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8), bo = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ae, be), _mm256_madd_epi16(ao, bo)));
}
V_INLINE __m512i _llmd_dpbusd_epi32(__m512i acc, __m512i a, __m512i b) {
    return V_I(v_dpbusd(acc.lo, a.lo, b.lo), v_dpbusd(acc.hi, a.hi, b.hi));
}

#define _mm512_setzero_ps _llmd_setzero_ps
#define _mm512_set1_ps _llmd_set1_ps
#define _mm512_loadu_ps _llmd_loadu_ps
#define _mm512_storeu_ps _llmd_storeu_ps
#define _mm512_mask_storeu_ps _llmd_mask_storeu_ps
#define _mm512_add_ps _llmd_add_ps
#define _mm512_sub_ps _llmd_sub_ps
#define _mm512_mul_ps _llmd_mul_ps
#define _mm512_div_ps _llmd_div_ps
#define _mm512_max_ps _llmd_max_ps
#define _mm512_min_ps _llmd_min_ps
#define _mm512_fmadd_ps _llmd_fmadd_ps
#define _mm512_fnmadd_ps _llmd_fnmadd_ps
#define _mm512_abs_ps _llmd_abs_ps
#define _mm512_scalef_ps _llmd_scalef_ps
#define _mm512_roundscale_ps _llmd_roundscale_ps
#define _mm512_cmp_ps_mask _llmd_cmp_ps_mask
#define _mm512_mask_blend_ps _llmd_mask_blend_ps
#define _mm512_maskz_mov_ps _llmd_maskz_mov_ps
#define _mm512_reduce_add_ps _llmd_reduce_add_ps
#define _mm512_reduce_max_ps _llmd_reduce_max_ps
#define _mm512_reduce_min_ps _llmd_reduce_min_ps
#define _mm512_unpacklo_ps _llmd_unpacklo_ps
#define _mm512_unpackhi_ps _llmd_unpackhi_ps
#define _mm512_unpacklo_pd _llmd_unpacklo_pd
#define _mm512_unpackhi_pd _llmd_unpackhi_pd
#define _mm512_castps_pd _llmd_castps_pd
#define _mm512_castpd_ps _llmd_castpd_ps
#define _mm512_castsi512_ps _llmd_castsi512_ps
#define _mm512_shuffle_f32x4 _llmd_shuffle_f32x4
#define _mm512_cvtepi32_ps _llmd_cvtepi32_ps
#define _mm512_cvtps_epi32 _llmd_cvtps_epi32
#define _mm512_cvtph_ps _llmd_cvtph_ps
#define _mm512_cvtpd_ps _llmd_cvtpd_ps
#define _mm512_castps256_ps512 _llmd_castps256_ps512
#define _mm512_insertf32x8 _llmd_insertf32x8
#define _mm512_setzero_si512 _llmd_setzero_si512
#define _mm512_set1_epi32 _llmd_set1_epi32
#define _mm512_set1_epi16 _llmd_set1_epi16
#define _mm512_set1_epi8 _llmd_set1_epi8
#define _mm512_loadu_si512 _llmd_loadu_si512
#define _mm512_add_epi32 _llmd_add_epi32
#define _mm512_sub_epi32 _llmd_sub_epi32
#define _mm512_min_epi32 _llmd_min_epi32
#define _mm512_max_epi32 _llmd_max_epi32
#define _mm512_and_si512 _llmd_and_si512
#define _mm512_madd_epi16 _llmd_madd_epi16
#define _mm512_abs_epi32 _llmd_abs_epi32
#define _mm512_slli_epi32 _llmd_slli_epi32
#define _mm512_srai_epi32 _llmd_srai_epi32
#define _mm512_srai_epi16 _llmd_srai_epi16
#define _mm512_srli_epi16 _llmd_srli_epi16
#define _mm512_cmplt_epi32_mask _llmd_cmplt_epi32_mask
#define _mm512_mask_sub_epi8 _llmd_mask_sub_epi8
#define _mm512_reduce_add_epi32 _llmd_reduce_add_epi32
#define _mm512_cvtepu16_epi32 _llmd_cvtepu16_epi32
#define _mm512_cvtepi8_epi16 _llmd_cvtepi8_epi16
#define _mm512_cvtepi32_epi8 _llmd_cvtepi32_epi8
#define _mm512_cvtepi32_epi16 _llmd_cvtepi32_epi16
#define _mm512_dpbusd_epi32 _llmd_dpbusd_epi32

#endif
