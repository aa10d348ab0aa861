#include "cpu_kernels.h"
#ifdef SPECDISTILL_AVX2
#include "gemm_fma_avx2.h"  // the AVX2 build's forms of both, the same numbers
#else

// y[R, N] = x[R, K] @ W^T, W[n, 32g + j] = q * d[n, g] + m[n, g]; packed[n, 16g + j] = q_j | q_{j+16} << 4.
// K % 32 == 0, N % NB == 0. The weights are rebuilt exactly as they were dequantized (q * d rounded, then + m
// rounded), so this is x @ W^T with the fp32 W, in another summation order: per (row, output) one 16-lane
// accumulator over the groups, then its lanes' sum. That order does not depend on R: a row is computed alike
// whatever the number of rows. Blocks of RB rows x NB outputs share each x load and each decoded weight vector
// (a tree's rows are bound by FMA throughput; the blocking keeps loads and decoding off that path). A group's 16
// possible weights are computed once (0..15 times d, plus m: the same roundings) and each weight looked up by its
// code (vpermps reads an index's low 4 bits), in place of a conversion, a product and a sum per weight: the same
// bits, one-row GEMMs 1.18x faster (docs/journal.md, stop 49).
#define RB 8
#define NB 2
void q41_gemm(const float *x, int R, int K, const uint8_t *packed, const float *d, const float *m, int N, float *y,
              int threads) {
    int G = K / 32;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n0 = 0; n0 < N; n0 += NB) {
        const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? R - r0 : RB;
            __m512 acc[RB][NB];
            for (int r = 0; r < RB; r++)
                for (int a = 0; a < NB; a++) acc[r][a] = _mm512_setzero_ps();
            for (int g = 0; g < G; g++) {
                __m512i codes[NB];
                __m512 table[NB], w[NB];
                for (int a = 0; a < NB; a++) {
                    size_t i = (size_t)(n0 + a) * G + g;
                    codes[a] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(packed + 16 * i)));
                    table[a] = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(d[i])), _mm512_set1_ps(m[i]));
                }
                for (int half = 0; half < 2; half++) {  // weights 0..15 of the group (low nibbles), then 16..31
                    for (int a = 0; a < NB; a++) {
                        __m512i q = half ? _mm512_srli_epi32(codes[a], 4) : codes[a];  // the index's low 4 bits
                        w[a] = _mm512_permutexvar_ps(q, table[a]);
                    }
                    for (int r = 0; r < rb; r++) {
                        __m512 xv = _mm512_loadu_ps(x + (size_t)(r0 + r) * K + g * 32 + half * 16);
                        for (int a = 0; a < NB; a++) acc[r][a] = _mm512_fmadd_ps(w[a], xv, acc[r][a]);
                    }
                }
            }
            for (int r = 0; r < rb; r++)
                for (int a = 0; a < NB; a++) y[(size_t)(r0 + r) * N + n0 + a] = _mm512_reduce_add_ps(acc[r][a]);
        }
    }
}

// The Q8_0 form (the default target's tied head): W[n, 32g + j] = q * d[n, g], q int8; codes[n, 32g + j] = q.
// q * d is exact in fp32 (8-bit q, fp16-born d), so this too is x @ W^T with the fp32 W in another order, each
// row alike whatever R is, in the same blocks.
void q80_gemm(const float *x, int R, int K, const int8_t *codes, const float *d, int N, float *y, int threads) {
    int G = K / 32;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n0 = 0; n0 < N; n0 += NB) {
        for (int r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? R - r0 : RB;
            __m512 acc[RB][NB];
            for (int r = 0; r < RB; r++)
                for (int a = 0; a < NB; a++) acc[r][a] = _mm512_setzero_ps();
            for (int g = 0; g < G; g++) {
                for (int half = 0; half < 2; half++) {  // weights 0..15 of the group, then 16..31
                    __m512 w[NB];
                    for (int a = 0; a < NB; a++) {
                        size_t i = (size_t)(n0 + a) * G + g;
                        __m128i q = _mm_loadu_si128((const __m128i *)(codes + 32 * i + 16 * half));
                        w[a] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d[i]));
                    }
                    for (int r = 0; r < rb; r++) {
                        __m512 xv = _mm512_loadu_ps(x + (size_t)(r0 + r) * K + g * 32 + half * 16);
                        for (int a = 0; a < NB; a++) acc[r][a] = _mm512_fmadd_ps(w[a], xv, acc[r][a]);
                    }
                }
            }
            for (int r = 0; r < rb; r++)
                for (int a = 0; a < NB; a++) y[(size_t)(r0 + r) * N + n0 + a] = _mm512_reduce_add_ps(acc[r][a]);
        }
    }
}
#endif  // SPECDISTILL_AVX2
