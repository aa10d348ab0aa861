// The default target's exact GEMMs (Q4_1 layers, the Q8_0 head) in the library's AVX2 build: gemm_fma.cpp includes
// this in place of its AVX-512 forms, whose 16-entry vpermps lookups and 32 accumulators SIMDe emulated through
// memory (the 135M's forward 3.3x slower than oneDNN's fp32 GEMMs on a 2-core AVX2 EPYC).
//
// The same numbers as the AVX-512 form's order: each (row, output) keeps its 16-lane fp32 accumulator as two 8-lane
// halves (weights 0-7 and 8-15 of each half-group), each weight rebuilt as q * d rounded, + m rounded (the table
// the AVX-512 form looks up holds exactly these), and the 16 lanes summed in the order of avx2_isa.h's
// _mm512_reduce_add_ps. Groups of ROWS rows share each rebuilt weight vector; a row is computed alike whatever R is.
#pragma once

namespace avx2_gemm {

constexpr int ROWS = 6;  // 12 accumulators, 2 weight vectors (x read by the FMAs): 14 of AVX2's 16 registers

static inline float sum16(__m256 low, __m256 high) {  // lanes 0-7 and 8-15 of one accumulator
    __m256 h = _mm256_add_ps(low, high);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

struct q41_weights {  // output n's group g: packed byte j = q_j | q_{j+16} << 4
    const uint8_t *packed;
    const float *d, *m;
    int G;
    void half(int n, int g, int h, __m256 w[2]) const {  // weights 16h .. 16h + 15
        size_t i = (size_t)n * G + g;
        __m128i bytes = _mm_loadu_si128((const __m128i *)(packed + 16 * i));
        if (h) bytes = _mm_srli_epi16(bytes, 4);
        const __m256i low4 = _mm256_set1_epi32(0x0F);
        __m256 dv = _mm256_set1_ps(d[i]), mv = _mm256_set1_ps(m[i]);
        __m256i q0 = _mm256_and_si256(_mm256_cvtepu8_epi32(bytes), low4);
        __m256i q1 = _mm256_and_si256(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)), low4);
        w[0] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q0), dv), mv);
        w[1] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q1), dv), mv);
    }
};

struct q80_weights {  // W[n, 32g + j] = codes[n, 32g + j] * d[n, g], exact in fp32
    const int8_t *codes;
    const float *d;
    int G;
    void half(int n, int g, int h, __m256 w[2]) const {
        size_t i = (size_t)n * G + g;
        __m128i q = _mm_loadu_si128((const __m128i *)(codes + 32 * i + 16 * h));
        __m256 dv = _mm256_set1_ps(d[i]);
        w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), dv);
        w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), dv);
    }
};

// Rows r0 .. r0 + RB - 1 of output n: y[r][n].
template <int RB, typename Weights>
static void rows_of_output(const float *x, int r0, int K, const Weights &W, int n, float *y, int N) {
    __m256 acc[RB][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < K / 32; g++)
        for (int h = 0; h < 2; h++) {
            __m256 w[2];
            W.half(n, g, h, w);
            for (int r = 0; r < RB; r++) {
                const float *xr = x + (size_t)(r0 + r) * K + g * 32 + h * 16;
                acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][1]);
            }
        }
    for (int r = 0; r < RB; r++) y[(size_t)(r0 + r) * N + n] = sum16(acc[r][0], acc[r][1]);
}

template <typename Weights>
static void gemm(const float *x, int R, int K, const Weights &W, int N, float *y, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++)
        for (int r0 = 0; r0 < R; r0 += ROWS) {
            switch (R - r0 < ROWS ? R - r0 : ROWS) {
                case 1: rows_of_output<1>(x, r0, K, W, n, y, N); break;
                case 2: rows_of_output<2>(x, r0, K, W, n, y, N); break;
                case 3: rows_of_output<3>(x, r0, K, W, n, y, N); break;
                case 4: rows_of_output<4>(x, r0, K, W, n, y, N); break;
                case 5: rows_of_output<5>(x, r0, K, W, n, y, N); break;
                default: rows_of_output<6>(x, r0, K, W, n, y, N); break;
            }
        }
}

}  // namespace avx2_gemm

void q41_gemm(const float *x, int R, int K, const uint8_t *packed, const float *d, const float *m, int N, float *y,
              int threads) {
    avx2_gemm::gemm(x, R, K, avx2_gemm::q41_weights{packed, d, m, K / 32}, N, y, threads);
}

void q80_gemm(const float *x, int R, int K, const int8_t *codes, const float *d, int N, float *y, int threads) {
    avx2_gemm::gemm(x, R, K, avx2_gemm::q80_weights{codes, d, K / 32}, N, y, threads);
}
