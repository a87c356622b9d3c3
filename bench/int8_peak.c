/* The int8 multiply-add peak of this host's cores, the ceiling llmd.bench.block_rows sets its
 * products' rates against.
 *
 *   int8-peak THREADS SECONDS
 *
 * Each thread runs independent chains of the instruction llmd's block products do their arithmetic
 * with, on registers only: vpdpbusd on 512 bits (64 byte products a lane group, added into 32 bits)
 * where AVX-512 VNNI is present, else vpmaddubsw and vpmaddwd on 256 bits, the AVX2 library's pair.
 * Prints one line: the form, then billions of operations a second over all threads (a multiply and
 * an add are two operations). Built by block_rows with the C compiler at run time. */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 16
#define BATCH 100000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Byte products run for ``seconds``; returns the operations done. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni(double seconds, int *sink) {
    __m512i acc[CHAINS];
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_epi32(i);
    long rounds = 0;
    const double end = now() + seconds;
    do {
        for (long i = 0; i < BATCH; i++) {
#pragma GCC unroll 16     /* the chains in registers */
            for (int j = 0; j < CHAINS; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], w, x);
            __asm__ volatile("" : "+v"(w), "+v"(x));
        }
        rounds++;
    } while (now() < end);
    for (int i = 0; i < CHAINS; i++) *sink += _mm512_reduce_add_epi32(acc[i]);
    return (double)rounds * BATCH * CHAINS * 64 * 2;
}

__attribute__((target("avx2"))) static double pairs(double seconds, int *sink) {
    __m256i acc[CHAINS];
    __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm256_set1_epi32(i);
    long rounds = 0;
    const double end = now() + seconds;
    do {
        for (long i = 0; i < BATCH; i++) {
#pragma GCC unroll 16
            for (int j = 0; j < CHAINS; j++)
                acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
            __asm__ volatile("" : "+v"(w), "+v"(x));
        }
        rounds++;
    } while (now() < end);
    int32_t out[8];
    for (int i = 0; i < CHAINS; i++) {
        _mm256_storeu_si256((__m256i *)out, acc[i]);
        for (int k = 0; k < 8; k++) *sink += out[k];
    }
    return (double)rounds * BATCH * CHAINS * 32 * 2;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s THREADS SECONDS\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[1]);
    const double seconds = atof(argv[2]);
    if (threads < 1 || threads > 1024 || !(seconds > 0 && seconds <= 60)) {
        fprintf(stderr, "THREADS must be 1-1024 and SECONDS in (0, 60]\n");
        return 2;
    }
    __builtin_cpu_init();
    const int has_vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    if (!has_vnni && !__builtin_cpu_supports("avx2")) {
        fprintf(stderr, "this host has neither AVX-512 VNNI nor AVX2\n");
        return 3;
    }
    double ops = 0;
    int sink = 0;
    const double t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : ops, sink)
    ops += has_vnni ? vnni(seconds, &sink) : pairs(seconds, &sink);
    const double elapsed = now() - t0;
    volatile int keep = sink;    /* the sums are used, so the chains are computed */
    (void)keep;
    printf("%s %.1f\n", has_vnni ? "vpdpbusd" : "vpmaddubsw", ops / elapsed * 1e-9);
    return 0;
}
