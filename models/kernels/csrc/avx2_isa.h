// The library's AVX2 build (build.py's "avx2" flavour, for CPUs without AVX-512): the same sources, their AVX-512
// intrinsics taken from SIMDe (SIMD Everywhere, the `simde-py` package's headers), each 512-bit vector two 256-bit
// halves. Here: the few intrinsics SIMDe 0.8.2 lacks, and the integer dot products every int8 kernel runs on
// AVX2's vpmaddubsw / vpmaddwd instead of SIMDe's generic widening form (6x slower on the 1.5B's forward).
//
// Exactness: every replacement computes what the AVX-512 instruction computes, bit for bit, for every input.
// vpmaddubsw sums two u8 x s8 products into int16 with saturation, so `dpbusd` splits the unsigned operand into its
// low 7 bits and its top bit (each pair sum then fits: 127 * 128 * 2 and 128 * 128 * 2 - 256), and the callers that
// know their unsigned bytes are below 128 (a K-quant block's codes) call `dpbusd_below_128`, one vpmaddubsw.
#pragma once
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <cstring>

#define ISA_TARGET(features)  // one instruction set for the whole build

// 256-bit halves of a 512-bit vector (SIMDe keeps them side by side; these compile to no instruction)
static inline __m256i low_half(__m512i a) { return _mm512_castsi512_si256(a); }
static inline __m256i high_half(__m512i a) { return _mm512_extracti64x4_epi64(a, 1); }
static inline __m512i join_halves(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline __m256i broadcast4_256(const int8_t *p) {  // 4 bytes of x to every 32-bit lane
    int32_t four;
    memcpy(&four, p, 4);
    return _mm256_set1_epi32(four);
}

static inline __m256i dot4_u8s8_256(__m256i acc, __m256i u, __m256i s) {  // u < 128: pair sums fit int16
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// vpdpbusd where every unsigned byte of u is below 128
static inline __m512i dpbusd_below_128(__m512i acc, __m512i u, __m512i s) {
    return join_halves(dot4_u8s8_256(low_half(acc), low_half(u), low_half(s)),
                       dot4_u8s8_256(high_half(acc), high_half(u), high_half(s)));
}

static inline __m256i dot4_any_u8s8_256(__m256i acc, __m256i u, __m256i s) {  // u = low 7 bits + top bit
    const __m256i top = _mm256_set1_epi8((char)0x80);
    acc = dot4_u8s8_256(acc, _mm256_andnot_si256(top, u), s);
    return dot4_u8s8_256(acc, _mm256_and_si256(top, u), s);
}

static inline __m512i specdistill_dpbusd(__m512i acc, __m512i u, __m512i s) {
    return join_halves(dot4_any_u8s8_256(low_half(acc), low_half(u), low_half(s)),
                       dot4_any_u8s8_256(high_half(acc), high_half(u), high_half(s)));
}
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 specdistill_dpbusd

static inline __m512i specdistill_dpwssd(__m512i acc, __m512i a, __m512i b) {
    return join_halves(_mm256_add_epi32(low_half(acc), _mm256_madd_epi16(low_half(a), low_half(b))),
                       _mm256_add_epi32(high_half(acc), _mm256_madd_epi16(high_half(a), high_half(b))));
}
#undef _mm512_dpwssd_epi32
#define _mm512_dpwssd_epi32 specdistill_dpwssd

// ---- AVX-512 intrinsics SIMDe 0.8.2 does not provide ----
static inline __m512i specdistill_cvtepu8_epi32(__m128i a) { return _mm512_cvtepu16_epi32(_mm256_cvtepu8_epi16(a)); }
#define _mm512_cvtepu8_epi32 specdistill_cvtepu8_epi32

static inline __m512i specdistill_cvtepi8_epi32(__m128i a) { return _mm512_cvtepi16_epi32(_mm256_cvtepi8_epi16(a)); }
#define _mm512_cvtepi8_epi32 specdistill_cvtepi8_epi32

static inline __m512i specdistill_cvtepu8_epi16(__m256i a) {
    return join_halves(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(a)),
                       _mm256_cvtepu8_epi16(_mm256_extracti128_si256(a, 1)));
}
#define _mm512_cvtepu8_epi16 specdistill_cvtepu8_epi16

static inline __m128i specdistill_cvtepi32_epi8(__m512i a) {  // each lane's low byte, as vpmovdb truncates
    const __m256i byte = _mm256_set1_epi32(0xFF);
    __m256i packed = _mm256_packus_epi32(_mm256_and_si256(low_half(a), byte), _mm256_and_si256(high_half(a), byte));
    packed = _mm256_permute4x64_epi64(packed, 0xD8);  // 16-bit lanes 0..15 in order
    return _mm_packus_epi16(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
}
#define _mm512_cvtepi32_epi8 specdistill_cvtepi32_epi8

static inline float specdistill_reduce_add_ps(__m512 a) {  // a fixed order: halves, quarters, pairs, lanes
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#define _mm512_reduce_add_ps specdistill_reduce_add_ps

static inline int specdistill_reduce_add_epi32(__m512i a) {
    __m256i h = _mm256_add_epi32(low_half(a), high_half(a));
    __m128i q = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
}
#define _mm512_reduce_add_epi32 specdistill_reduce_add_epi32

static inline __mmask16 specdistill_mask_cmpneq_epi32_mask(__mmask16 k, __m512i a, __m512i b) {
    return (__mmask16)(k & ~_mm512_cmpeq_epi32_mask(a, b));
}
#define _mm512_mask_cmpneq_epi32_mask specdistill_mask_cmpneq_epi32_mask

static inline __m512 specdistill_mask3_fmadd_ps(__m512 a, __m512 b, __m512 c, __mmask16 k) {
    return _mm512_mask_mov_ps(c, k, _mm512_fmadd_ps(a, b, c));
}
#define _mm512_mask3_fmadd_ps specdistill_mask3_fmadd_ps
