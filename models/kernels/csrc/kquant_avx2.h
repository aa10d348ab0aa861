// The Q4_K and Q6_K row loops of the library's AVX2 build (kquant.cpp includes this in place of its AVX512-VNNI
// loops): the same packed layouts, the same integers and the same fp32 operations in the same order, so every output
// is bit for bit what the AVX-512 build computes. SIMDe's 512-bit emulation keeps its vectors in memory and costs
// 3-4x here; these loops are written for AVX2's 16 registers instead.
//
// A 16-output block is two halves of 8 outputs (bytes 0..31 and 32..63 of each code vector: outputs 0-7 and 8-15).
// vpmaddubsw multiplies the weights' codes (unsigned) with x's int8 codes and adds pairs into int16; vpmaddwd adds
// pairs of those into int32 lanes, one an output, as vpdpbusd would. Exact without saturation because the codes are
// small: Q4_K's 0..15 (a sub-block's 8 vpmaddubsw, each |.| <= 15 * 128 * 2, summed in int16: at most 30,720);
// Q6_K's 0..63 (two summed: at most 32,256).
#pragma once

static inline __m256i q6k_high_bits_256(__m256i h, int u) {  // q6k_high_bits on 8 outputs
    const __m256i mask = _mm256_set1_epi8(0x30);
    switch (u) {
        case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), mask);
        case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 2), mask);
        case 2: return _mm256_and_si256(h, mask);
        default: return _mm256_and_si256(_mm256_srli_epi16(h, 2), mask);
    }
}

static inline __m256i scale_pairs(const uint8_t *sc) {  // 8 unsigned scales, each in both int16 halves of its lane
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc));
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

// Rows r0 .. r0 + RB - 1 of output block nb: the AVX-512 loop's numbers. Each half's accumulators side by side, so
// each of x's 4-byte groups is broadcast once for both halves.
template <int RB>
static void q4k_block(const q8k_rows &x, const int32_t *pairs, int r0, q4k_matrix w, int nb, float *y, int ldy) {
    const int K = x.K, KB = K / 256;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const bool ahead = prefetching(r0, RB, K);
    __m256 out[RB][2];
    for (int r = 0; r < RB; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        size_t block = (size_t)nb * KB + kb;
        const uint8_t *codes = w.codes + block * 2048, *sc = w.sc + block * 128, *mn = w.m + block * 128;
        __m256i total[RB][2];
        for (int r = 0; r < RB; r++) total[r][0] = total[r][1] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            __m256i acc[RB][2];  // int16: a sub-block's products of each output, in pairs
            for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {
                const uint8_t *vp = codes + (s * 4 + p) * 64;
                if (ahead) _mm_prefetch((const char *)(vp + 2048), _MM_HINT_T0);
                __m256i v0 = _mm256_loadu_si256((const __m256i *)vp);
                __m256i v1 = _mm256_loadu_si256((const __m256i *)(vp + 32));
                __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
                __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
                for (int r = 0; r < RB; r++) {
                    const int8_t *xr = x.q + (size_t)(r0 + r) * K + kb * 256 + 32 * s + 8 * p;
                    __m256i first = broadcast4_256(xr), second = broadcast4_256(xr + 4);
                    acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(lo0, first));
                    acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(lo1, first));
                    acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(hi0, second));
                    acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(hi1, second));
                }
            }
            for (int h = 0; h < 2; h++) {  // sc * (a + b) = the AVX-512 loop's sc * (its int32 sum)
                __m256i scale = scale_pairs(sc + 16 * s + 8 * h);
                for (int r = 0; r < RB; r++)
                    total[r][h] = _mm256_add_epi32(total[r][h], _mm256_madd_epi16(acc[r][h], scale));
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256i mins[RB];
            for (int r = 0; r < RB; r++) mins[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {  // the mins' share: sum over sub-blocks of m times x's code sum
                __m256i minimum = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(mn + 32 * j + 16 * h)));
                for (int r = 0; r < RB; r++)
                    mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(minimum, _mm256_set1_epi32(
                                                            pairs[(size_t)(r0 + r) * (K / 64) + kb * 4 + j])));
            }
            __m256 d = _mm256_loadu_ps(w.d + block * 16 + 8 * h);
            __m256 dmin = _mm256_loadu_ps(w.dmin + block * 16 + 8 * h);
            for (int r = 0; r < RB; r++) {
                __m256 step = _mm256_set1_ps(x.d[(size_t)(r0 + r) * KB + kb]);
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r][h]), _mm256_mul_ps(d, step), out[r][h]);
                out[r][h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(dmin, step), out[r][h]);
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (size_t)(r0 + r) * ldy + nb * 16 + 8 * h, out[r][h]);
}

template <int RB>
static void q6k_block(const q8k_rows &x, const int32_t *, int r0, q6k_matrix w, int nb, float *y, int ldy) {
    const int K = x.K, KB = K / 256;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const bool ahead = prefetching(r0, RB, K);
    __m256 out[RB][2];
    for (int r = 0; r < RB; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        size_t block = (size_t)nb * KB + kb;
        const uint8_t *low = w.low + block * 2048, *high = w.high + block * 1024;
        const int8_t *sc = w.sc + block * 256;
        __m256i total[RB][2];
        for (int r = 0; r < RB; r++) total[r][0] = total[r][1] = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++)
            for (int part = 0; part < 2; part++) {  // sub-block of 16: chunks t = 4 part .. 4 part + 3
                const uint8_t *hp = high + (s * 2 + part) * 64;
                if (ahead) _mm_prefetch((const char *)(hp + 1024), _MM_HINT_T0);
                __m256i h0 = _mm256_loadu_si256((const __m256i *)hp);
                __m256i h1 = _mm256_loadu_si256((const __m256i *)(hp + 32));
                __m256i acc[RB][2];
                for (int r = 0; r < RB; r++)  // the codes' offset of 32, taken off once: -32 times x's sum
                    acc[r][0] = acc[r][1] =
                        _mm256_set1_epi32(-32 * x.sums[(size_t)(r0 + r) * (K / 16) + kb * 16 + 2 * s + part]);
                for (int pp = 0; pp < 2; pp++) {
                    const uint8_t *vp = low + (s * 4 + 2 * part + pp) * 64;
                    if (ahead) _mm_prefetch((const char *)(vp + 2048), _MM_HINT_T0);
                    __m256i v0 = _mm256_loadu_si256((const __m256i *)vp);
                    __m256i v1 = _mm256_loadu_si256((const __m256i *)(vp + 32));
                    __m256i lo0 = _mm256_or_si256(_mm256_and_si256(v0, low4), q6k_high_bits_256(h0, 2 * pp));
                    __m256i lo1 = _mm256_or_si256(_mm256_and_si256(v1, low4), q6k_high_bits_256(h1, 2 * pp));
                    __m256i hi0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low4),
                                                  q6k_high_bits_256(h0, 2 * pp + 1));
                    __m256i hi1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low4),
                                                  q6k_high_bits_256(h1, 2 * pp + 1));
                    for (int r = 0; r < RB; r++) {
                        const int8_t *xr = x.q + (size_t)(r0 + r) * K + kb * 256 + 32 * s + 8 * (2 * part + pp);
                        __m256i first = broadcast4_256(xr), second = broadcast4_256(xr + 4);
                        __m256i both0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, first),
                                                         _mm256_maddubs_epi16(hi0, second));
                        __m256i both1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, first),
                                                         _mm256_maddubs_epi16(hi1, second));
                        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(both0, ones));
                        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(both1, ones));
                    }
                }
                for (int h = 0; h < 2; h++) {
                    const int8_t *scales = sc + 16 * (2 * s + part) + 8 * h;
                    __m256i scale = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)scales));
                    for (int r = 0; r < RB; r++)
                        total[r][h] = _mm256_add_epi32(total[r][h], _mm256_mullo_epi32(acc[r][h], scale));
                }
            }
        for (int h = 0; h < 2; h++) {
            __m256 d = _mm256_loadu_ps(w.d + block * 16 + 8 * h);
            for (int r = 0; r < RB; r++) {
                __m256 step = _mm256_set1_ps(x.d[(size_t)(r0 + r) * KB + kb]);
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r][h]), _mm256_mul_ps(d, step), out[r][h]);
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (size_t)(r0 + r) * ldy + nb * 16 + 8 * h, out[r][h]);
}
