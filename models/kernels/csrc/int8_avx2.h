// The int8 kernel's loop in the library's AVX2 build (int8.cpp includes this in place of its AVX512-VNNI
// int8_gemm_rounded): the same layout and, for every output and group, the same int32 dot and the same fp32 operations
// in the same order, so the same numbers. vpdpbusd multiplies x's unsigned codes (x + 128) with the weights' signed
// ones and the bias takes 128 times the weights' sum off again; here x's signed codes (the stored byte with its top
// bit flipped, -127..127) go into vpmaddubsw against |w| with w's sign moved onto x (vpsignb). Each int16 pair sum is
// at most 2 * 127 * 127, so nothing saturates, and the group's dot, the sum of w x, is the integer bias + sum of
// w (x + 128). One vpmaddubsw a product pair where SIMDe's vpdpbusd takes two (x's top bit apart).
#pragma once

// Rows r0 .. r0 + RB - 1 of output block nb (16 outputs: two halves of 8, bytes 0..31 and 32..63 of each code vector).
template <int RB>
static void int8_block(const uint8_t *xq, const float *dx, int r0, int K, const int8_t *codes, const float *d,
                       int nb, float *y, int N) {
    const int G = K / 32;
    const __m256i ones = _mm256_set1_epi16(1), top = _mm256_set1_epi8((char)0x80);
    __m256 out[RB][2];
    for (int r = 0; r < RB; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const size_t at = (size_t)nb * G + g;
        __m256i acc[RB][2];
        for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {  // k = 32 g + 4 t + i at byte 4 o + i
            __m256i w[2], magnitude[2];
            for (int h = 0; h < 2; h++) {
                w[h] = _mm256_loadu_si256((const __m256i *)(codes + 512 * at + 64 * t + 32 * h));
                magnitude[h] = _mm256_abs_epi8(w[h]);
            }
            for (int r = 0; r < RB; r++) {
                const uint8_t *xr = xq + (size_t)(r0 + r) * K + 32 * g + 4 * t;
                __m256i signed_x = _mm256_xor_si256(broadcast4_256((const int8_t *)xr), top);
                for (int h = 0; h < 2; h++) {
                    __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(signed_x, w[h]));
                    acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 dw = _mm256_loadu_ps(d + 16 * at + 8 * h);
            for (int r = 0; r < RB; r++) {
                __m256 both = _mm256_mul_ps(dw, _mm256_set1_ps(dx[(size_t)(r0 + r) * G + g]));
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), both, out[r][h]);
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (size_t)(r0 + r) * N + nb * 16 + 8 * h, out[r][h]);
}

// y [R][N] from rows already rounded by quantize_rows (xq, dx); the bias is not read (see above).
static void int8_gemm_rounded(const uint8_t *xq, const float *dx, int R, int K, const int8_t *codes, const float *d,
                              const int32_t *, int N, float *y, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int nb = 0; nb < N / 16; nb++)
        for (int r0 = 0; r0 < R; r0 += 4) {
            switch (R - r0 < 4 ? R - r0 : 4) {
                case 1: int8_block<1>(xq, dx, r0, K, codes, d, nb, y, N); break;
                case 2: int8_block<2>(xq, dx, r0, K, codes, d, nb, y, N); break;
                case 3: int8_block<3>(xq, dx, r0, K, codes, d, nb, y, N); break;
                default: int8_block<4>(xq, dx, r0, K, codes, d, nb, y, N); break;
            }
        }
}
