/* Shared by llmd's CPU kernels (quant.c, f32.c, attention.c, rows.c): built together into one
 * library by llmd.runtime.kernels, x86-64 with AVX-512 (VNNI). Each file's entry points return 0,
 * or -1 when the CPU or the shape is not one they take (the caller then uses torch's kernels). */
#ifndef LLMD_KERNELS_H
#define LLMD_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAXM 4
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

int llmd_cpu_ok(void);      /* quant.c: AVX-512 F/BW/VL/DQ and VNNI present */

/* max|r| / qmax over a row of K floats (never 0, so that dividing by it is safe). */
static inline TARGET float row_scale(const float *r, int K, float qmax) {
    __m512 mx = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(r + k)));
    float scale = _mm512_reduce_max_ps(mx) / qmax;
    return scale < 1e-30f ? 1e-30f : scale;
}

/* The body of each product: rows of the output split across nt threads, M fixed per case so the
 * compiler unrolls the loops over rows of x. */
#define BY_ROWS(CASE) do { \
    switch (M) { \
    case 1: CASE(1) break; \
    case 2: CASE(2) break; \
    case 3: CASE(3) break; \
    default: CASE(4) break; \
    } } while (0)

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
