// The Q5_0 and Q8_0 row loops of the library's AVX2 build (kquant.cpp includes this in place of its AVX512-VNNI
// q8_0_block): a GGUF's Q5_0 / Q8_0 layers (the 0.5B draft model's), the same packed layouts and the same integers and
// fp32 operations per output, so every output is bit for bit the AVX-512 build's. A 16-output group is two halves of
// 8 outputs (bytes 0..31 and 32..63 of each code vector), each half's int32 lanes one output, as in kquant_avx2.h.
// Q5_0's codes (0..31) take one vpmaddubsw a product pair; Q8_0's (0..255) are split into low 7 bits and top bit
// (avx2_isa.h's dot4_any_u8s8_256) so no int16 pair sum saturates.
#pragma once

static inline __m256i fifth_bit_256(__m256i h, int t) {  // fifth_bit on 8 outputs
    const __m256i mask = _mm256_set1_epi8(0x10);
    switch (t) {
        case 0: return _mm256_and_si256(_mm256_slli_epi16(h, 4), mask);
        case 1: return _mm256_and_si256(_mm256_slli_epi16(h, 3), mask);
        case 2: return _mm256_and_si256(_mm256_slli_epi16(h, 2), mask);
        case 3: return _mm256_and_si256(_mm256_slli_epi16(h, 1), mask);
        case 4: return _mm256_and_si256(h, mask);
        case 5: return _mm256_and_si256(_mm256_srli_epi16(h, 1), mask);
        case 6: return _mm256_and_si256(_mm256_srli_epi16(h, 2), mask);
        default: return _mm256_and_si256(_mm256_srli_epi16(h, 3), mask);
    }
}

// A group's codes of 16 outputs as unsigned bytes, chunk pair by chunk pair (chunk t: k = 4t + i at byte 4o + i),
// half h of each: first[h], second[h]. Q5_0: q = code + 16 from a low-nibble vector and the group's fifth bits;
// Q8_0: q = code + 128 stored as is.
struct q50_codes {
    static constexpr int offset = 16;
    static __m256i dot(__m256i acc, __m256i q, __m256i x) { return dot4_u8s8_256(acc, q, x); }
    const uint8_t *low, *next_high;
    __m256i high[2];
    q50_codes(q50_matrix w, size_t group) : low(w.low + group * 256), next_high(w.high + group * 64 + 64) {
        high[0] = _mm256_loadu_si256((const __m256i *)(w.high + group * 64));
        high[1] = _mm256_loadu_si256((const __m256i *)(w.high + group * 64 + 32));
    }
    void pair(int p, __m256i first[2], __m256i second[2]) const {  // chunks 2p and 2p + 1
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        for (int h = 0; h < 2; h++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(low + 64 * p + 32 * h));
            first[h] = _mm256_or_si256(_mm256_and_si256(v, low4), fifth_bit_256(high[h], 2 * p));
            second[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                        fifth_bit_256(high[h], 2 * p + 1));
        }
    }
    void prefetch_next() const {  // the next group's 320 bytes
        for (int p = 0; p < 4; p++) _mm_prefetch((const char *)(low + 256 + 64 * p), _MM_HINT_T0);
        _mm_prefetch((const char *)next_high, _MM_HINT_T0);
    }
};

struct q80_codes {
    static constexpr int offset = 128;
    static __m256i dot(__m256i acc, __m256i q, __m256i x) { return dot4_any_u8s8_256(acc, q, x); }
    const uint8_t *codes;
    q80_codes(q80_matrix w, size_t group) : codes(w.codes + group * 512) {}
    void pair(int p, __m256i first[2], __m256i second[2]) const {
        for (int h = 0; h < 2; h++) {
            first[h] = _mm256_loadu_si256((const __m256i *)(codes + 128 * p + 32 * h));
            second[h] = _mm256_loadu_si256((const __m256i *)(codes + 128 * p + 64 + 32 * h));
        }
    }
    void prefetch_next() const {  // the next group's 512 bytes
        for (int v = 0; v < 8; v++) _mm_prefetch((const char *)(codes + 512 + 64 * v), _MM_HINT_T0);
    }
};

// kquant.cpp's q8_0_block: each group's dot starts from -offset times x's code sum and adds q times x's codes, then
// out += dot * (d_w * d_x).
template <int RB, typename Matrix, typename Codes>
static void q8_0_block(const q8_0_rows &x, const int32_t *, int r0, Matrix w, int nb, float *y, int ldy) {
    const int K = x.K, G = K / 32;
    const bool ahead = prefetching(r0, RB, K);
    __m256 out[RB][2];
    for (int r = 0; r < RB; r++) out[r][0] = out[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        size_t group = (size_t)nb * G + g;
        const Codes codes(w, group);
        if (ahead) codes.prefetch_next();
        __m256i acc[RB][2];
        for (int r = 0; r < RB; r++)
            acc[r][0] = acc[r][1] = _mm256_set1_epi32(-Codes::offset * x.sums[(size_t)(r0 + r) * G + g]);
        for (int p = 0; p < 4; p++) {
            __m256i first[2], second[2];
            codes.pair(p, first, second);
            for (int r = 0; r < RB; r++) {
                const int8_t *xr = x.q + (size_t)(r0 + r) * K + 32 * g + 8 * p;
                __m256i one = broadcast4_256(xr), other = broadcast4_256(xr + 4);
                for (int h = 0; h < 2; h++)
                    acc[r][h] = Codes::dot(Codes::dot(acc[r][h], first[h], one), second[h], other);
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w.d + group * 16 + 8 * h)));
            for (int r = 0; r < RB; r++) {
                __m256 both = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[(size_t)(r0 + r) * G + g]));
                out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), both, out[r][h]);
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (size_t)(r0 + r) * ldy + nb * 16 + 8 * h, out[r][h]);
}
