#include "cpu_kernels.h"

// ---- GEMMs over a GGUF's own K-quant blocks (Q4_K, Q6_K) with int8 activations on AVX512-VNNI: a real-size
// target's matrices (models.kquant) as llama.cpp computes them. Each row of x is rounded once per block of 256 to
// int8 with step max |x| / 127 (`quantize_rows_q8k`, llama.cpp's Q8_K), the weights' integer codes are multiplied
// with x's by vpdpbusd (64 products an instruction, the weights the unsigned operand), each block's integer sums are
// exact, and each output sums its blocks in fp32 in a fixed order. A row is computed alike whatever R is: its
// integers are exact and its fp32 operations do not depend on the rows beside it (tests check both).
//
// Layouts (models/kquant.py packs them): 16 outputs side by side, 4 consecutive k of each in 4 bytes, so one
// vpdpbusd adds 4 products to each of 16 outputs. For output block nb and block kb of 256:
//   Q4_K: codes [NB][KB][8 sub][4 pair][64]: byte 4o + i of pair p of sub-block s holds the code of output o at
//         k = 32s + 8p + i (low nibble) and 32s + 8p + 4 + i (high); sc [NB][KB][8][16] the 6-bit scale of each
//         sub-block of 32, m [NB][KB][4][16][2] its 6-bit min, sub-blocks 2j and 2j + 1 side by side (one
//         vpdpwssd takes both, against x's sums over them); d, dmin [NB][KB][16] fp32. w = d sc q - dmin m.
//   Q6_K: low [NB][KB][8][4][64] the codes' low 4 bits as Q4_K's codes; high [NB][KB][8][2][64] their top 2 bits,
//         byte 4o + i of vector h of sub-block s holding those of chunk t = 4h + u (k = 32s + 4t + i) at bits 2u;
//         sc [NB][KB][16 sub-blocks of 16][16] int8; d [NB][KB][16] fp32. w = d sc (q - 32).
//
// Q5_0 and Q8_0 (a small model's blocks of 32: the 0.5B draft model's attention, gate/up and head) have their own
// rows: x rounded per group of 32 (`quantize_rows_q8_0`, llama.cpp's Q8_0 activations, the int8 kernel's rounding),
// and per group g of 16 outputs:
//   Q5_0: low [NB][G][4][64] the 5-bit codes' low 4 bits, byte 4o + i of vector p holding k = 8p + i (low nibble)
//         and 8p + 4 + i (high); high [NB][G][64] their 5th bits, byte 4o + i holding that of k = 4t + i at bit t.
//         q = code + 16.
//   Q8_0: codes [NB][G][8][64], byte 4o + i of vector t holding q = code + 128 at k = 4t + i.
//   d [NB][G][16]: the file's fp16 steps. w = d (q - offset).
// Their integer dots are the int8 kernel's (int8.cpp) over the same codes and their fp32 operations the same in the
// same order, so they compute what Int8Matrix computes bit for bit, reading 5.5 / 8.5 bits a weight instead of 10
// (int8 codes, an fp32 step and an int32 offset per 32).
// ------------------------------------------------------------------------------------------------------------------
#define VNNI_TARGET ISA_TARGET("avx512f,avx512bw,avx512vnni")

// x fp32 [R][K] -> xq int8 [R][K], step dx [R][K/256], sums of codes xs [R][K/16]. K % 256 == 0.
VNNI_TARGET void quantize_rows_q8k(const float *x, int R, int K, int8_t *xq, float *dx, int32_t *xs) {
    int KB = K / 256;
    for (int r = 0; r < R; r++)
        for (int kb = 0; kb < KB; kb++) {
            const float *v = x + (size_t)r * K + kb * 256;
            __m512 top = _mm512_setzero_ps();
            for (int c = 0; c < 16; c++) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(v + 16 * c)));
            float amax = _mm512_reduce_max_ps(top);
            __m512 inverse = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            for (int c = 0; c < 16; c++) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * c), inverse));  // nearest
                _mm_storeu_si128((__m128i *)(xq + (size_t)r * K + kb * 256 + 16 * c), _mm512_cvtepi32_epi8(q));
                xs[(size_t)r * (K / 16) + kb * 16 + c] = _mm512_reduce_add_epi32(q);
            }
            dx[(size_t)r * KB + kb] = amax / 127.0f;
        }
}

// x fp32 [R][K] -> xq int8 [R][K], step dx [R][K/32], sums of codes xs [R][K/32]. K % 32 == 0. The rounding of
// int8.cpp's quantize_rows (the same operations) without its offset to unsigned bytes.
VNNI_TARGET void quantize_rows_q8_0(const float *x, int R, int K, int8_t *xq, float *dx, int32_t *xs) {
    const int G = K / 32;
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const float *v = x + (size_t)r * K + g * 32;
            __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
            float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            __m512 scale = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
            __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, scale));
            _mm_storeu_si128((__m128i *)(xq + (size_t)r * K + g * 32), _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(xq + (size_t)r * K + g * 32 + 16), _mm512_cvtepi32_epi8(qb));
            xs[(size_t)r * G + g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
            dx[(size_t)r * G + g] = top / 127.0f;
        }
}

static inline __m512i broadcast4(const int8_t *p) {  // 4 bytes of x to every 32-bit lane
    int32_t four;
    memcpy(&four, p, 4);
    return _mm512_set1_epi32(four);
}

// Rows r0 .. r0 + RB - 1 of one output block nb of a Q4_K matrix: y[r][16 nb ..] for the block's 16 outputs.
// x's code sums over sub-blocks of 32 in pairs, as vpdpwssd reads them: pairs [R][K/64], sub-block 2j's sum in the
// low 16 bits and 2j + 1's in the high (|sum| <= 32 * 127 fits 16 bits).
static void sub_block_sum_pairs(const q8k_rows &x, int32_t *pairs) {
    for (int r = 0; r < x.R; r++)
        for (int j = 0; j < x.K / 64; j++) {
            const int32_t *sums = x.sums + (size_t)r * (x.K / 16) + 4 * j;
            uint32_t low = (uint16_t)(int16_t)(sums[0] + sums[1]), high = (uint16_t)(int16_t)(sums[2] + sums[3]);
            pairs[(size_t)r * (x.K / 64) + j] = (int32_t)(low | high << 16);
        }
}

// Rows per pass over a matrix: a pass's int8 rows of x (512 KiB of them at most) stay in each core's L2 while every
// output block reads them. In one pass over all R rows, a long prefill (past 340 rows at K = 1536) read its whole x
// once per output block (1,120 times for the 1.5B's gate/up); in passes, the weights are read once a pass instead.
// A row's numbers do not depend on the pass it is in. Speed not measured: the hidden-state pass it was meant for now
// runs these kernels (decode.target_states), but a record's prompt there (at most 288 rows) fits in one pass.
static inline int rows_per_pass(int K) {
    int rows = (512 * 1024 / K) / 4 * 4;
    return rows < 4 ? 4 : rows;
}

// Software prefetch of the next block's codes, in the first group of a pass over an output block of 3 or more rows:
// there each 64 bytes of codes carry 6+ vpdpbusd, too much work for the out-of-order window to keep enough loads in
// flight, and the next block comes late (forwards of 4 / 8 / 12 rows 10-16% faster on the 1.5B). A single row's
// loop is light enough that the hardware prefetcher keeps up: there the extra instruction costs
// (docs/design/kquant-kernels.md). The AVX2 build prefetches from one row: its loop does two vpmaddubsw and two
// vpaddw where AVX-512 does one vpdpbusd, too much for the hardware prefetcher alone even at one row (Zen 3: the
// 1.5B's forward of one / two rows 1.18x / 1.15x faster so, the 0.5B's 1.03x / 1.06x; 4 and 8 rows unchanged).
#ifdef SPECDISTILL_AVX2
constexpr int PREFETCH_FROM_ROWS = 1;
#else
constexpr int PREFETCH_FROM_ROWS = 3;
#endif
static inline bool prefetching(int r0, int RB, int K) {
    return r0 % rows_per_pass(K) == 0 && RB >= PREFETCH_FROM_ROWS;
}

#ifdef SPECDISTILL_AVX2
#include "kquant_avx2.h"  // the AVX2 build's Q4_K and Q6_K loops, the same numbers
#else
template <int RB>
VNNI_TARGET static void q4k_block(const q8k_rows &x, const int32_t *pairs, int r0, q4k_matrix w, int nb, float *y,
                                  int ldy) {
    const int K = x.K, KB = K / 256;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const bool ahead = prefetching(r0, RB, K);
    __m512 out[RB];
    for (int r = 0; r < RB; r++) out[r] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        size_t block = (size_t)nb * KB + kb;
        const uint8_t *codes = w.codes + block * 2048, *sc = w.sc + block * 128, *mn = w.m + block * 128;
        __m512i total[RB], mins[RB];
        for (int r = 0; r < RB; r++) total[r] = mins[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            __m512i acc[RB];
            for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++) {
                __m512i v = _mm512_loadu_si512(codes + (s * 4 + p) * 64);
                if (ahead) _mm_prefetch((const char *)(codes + 2048 + (s * 4 + p) * 64), _MM_HINT_T0);
                __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int r = 0; r < RB; r++) {
                    const int8_t *xr = x.q + (size_t)(r0 + r) * K + kb * 256 + 32 * s + 8 * p;
                    acc[r] = dpbusd_below_128(acc[r], lo, broadcast4(xr));
                    acc[r] = dpbusd_below_128(acc[r], hi, broadcast4(xr + 4));
                }
            }
            __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16 * s)));
            for (int r = 0; r < RB; r++) total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(acc[r], scale));
        }
        for (int j = 0; j < 4; j++) {  // the mins' share: sum over sub-blocks of m times x's code sum
            __m512i minimum = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(mn + 32 * j)));
            for (int r = 0; r < RB; r++)
                mins[r] = _mm512_dpwssd_epi32(mins[r], minimum,
                                              _mm512_set1_epi32(pairs[(size_t)(r0 + r) * (K / 64) + kb * 4 + j]));
        }
        __m512 d = _mm512_loadu_ps(w.d + block * 16), dmin = _mm512_loadu_ps(w.dmin + block * 16);
        for (int r = 0; r < RB; r++) {
            __m512 step = _mm512_set1_ps(x.d[(size_t)(r0 + r) * KB + kb]);
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, step), out[r]);
            out[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(dmin, step), out[r]);
        }
    }
    for (int r = 0; r < RB; r++) _mm512_storeu_ps(y + (size_t)(r0 + r) * ldy + nb * 16, out[r]);
}

template <int RB>
VNNI_TARGET static void q6k_block(const q8k_rows &x, const int32_t *, int r0, q6k_matrix w, int nb, float *y,
                                  int ldy) {
    const int K = x.K, KB = K / 256;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const bool ahead = prefetching(r0, RB, K);
    __m512 out[RB];
    for (int r = 0; r < RB; r++) out[r] = _mm512_setzero_ps();
    for (int kb = 0; kb < KB; kb++) {
        size_t block = (size_t)nb * KB + kb;
        const uint8_t *low = w.low + block * 2048, *high = w.high + block * 1024;
        const int8_t *sc = w.sc + block * 256;
        __m512i total[RB];
        for (int r = 0; r < RB; r++) total[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            for (int half = 0; half < 2; half++) {  // sub-block of 16: chunks t = 4 half .. 4 half + 3
                __m512i h = _mm512_loadu_si512(high + (s * 2 + half) * 64), acc[RB];
                if (ahead) _mm_prefetch((const char *)(high + 1024 + (s * 2 + half) * 64), _MM_HINT_T0);
                for (int r = 0; r < RB; r++)  // the codes' offset of 32, taken off once: -32 times x's sum
                    acc[r] = _mm512_set1_epi32(-32 * x.sums[(size_t)(r0 + r) * (K / 16) + kb * 16 + 2 * s + half]);
                for (int pp = 0; pp < 2; pp++) {
                    int p = 2 * half + pp;
                    __m512i v = _mm512_loadu_si512(low + (s * 4 + p) * 64);
                    if (ahead) _mm_prefetch((const char *)(low + 2048 + (s * 4 + p) * 64), _MM_HINT_T0);
                    __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low4), q6k_high_bits(h, 2 * pp));
                    __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                                                 q6k_high_bits(h, 2 * pp + 1));
                    for (int r = 0; r < RB; r++) {
                        const int8_t *xr = x.q + (size_t)(r0 + r) * K + kb * 256 + 32 * s + 8 * p;
                        acc[r] = dpbusd_below_128(acc[r], lo, broadcast4(xr));
                        acc[r] = dpbusd_below_128(acc[r], hi, broadcast4(xr + 4));
                    }
                }
                __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16 * (2 * s + half))));
                for (int r = 0; r < RB; r++) total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(acc[r], scale));
            }
        }
        __m512 d = _mm512_loadu_ps(w.d + block * 16);
        for (int r = 0; r < RB; r++) {
            __m512 step = _mm512_set1_ps(x.d[(size_t)(r0 + r) * KB + kb]);
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, step), out[r]);
        }
    }
    for (int r = 0; r < RB; r++) _mm512_storeu_ps(y + (size_t)(r0 + r) * ldy + nb * 16, out[r]);
}

#endif  // SPECDISTILL_AVX2

#ifdef SPECDISTILL_AVX2
#include "q8_0_avx2.h"  // the AVX2 build's Q5_0 and Q8_0 loops, the same numbers
#else
// The 5th bit of chunk t's codes (bit t of each byte of h) at bit 4. 16-bit shifts: what crosses a byte lands
// below bit 4 (left, by 4 - t <= 4) or above it (right, by t - 4 <= 3), so the mask keeps the byte's own bit.
VNNI_TARGET static inline __m512i fifth_bit(__m512i h, int t) {
    const __m512i mask = _mm512_set1_epi8(0x10);
    switch (t) {
        case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), mask);
        case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 3), mask);
        case 2: return _mm512_and_si512(_mm512_slli_epi16(h, 2), mask);
        case 3: return _mm512_and_si512(_mm512_slli_epi16(h, 1), mask);
        case 4: return _mm512_and_si512(h, mask);
        case 5: return _mm512_and_si512(_mm512_srli_epi16(h, 1), mask);
        case 6: return _mm512_and_si512(_mm512_srli_epi16(h, 2), mask);
        default: return _mm512_and_si512(_mm512_srli_epi16(h, 3), mask);
    }
}

// A group's codes of 16 outputs as the unsigned bytes vpdpbusd reads, chunk pair by chunk pair (chunk t: k = 4t + i
// at byte 4o + i). Q5_0: q = code + 16 from a low-nibble vector and the group's fifth bits; Q8_0: q = code + 128
// stored as is.
struct q50_codes {
    static constexpr int offset = 16;
    VNNI_TARGET static __m512i dot(__m512i acc, __m512i q, __m512i x) { return dpbusd_below_128(acc, q, x); }
    const uint8_t *low, *next_high;
    __m512i high;
    VNNI_TARGET q50_codes(q50_matrix w, size_t group)
        : low(w.low + group * 256), next_high(w.high + group * 64 + 64),
          high(_mm512_loadu_si512(w.high + group * 64)) {}
    VNNI_TARGET void pair(int p, __m512i &first, __m512i &second) const {  // chunks 2p and 2p + 1
        const __m512i low4 = _mm512_set1_epi8(0x0F);
        __m512i v = _mm512_loadu_si512(low + 64 * p);
        first = _mm512_or_si512(_mm512_and_si512(v, low4), fifth_bit(high, 2 * p));
        second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), fifth_bit(high, 2 * p + 1));
    }
    void prefetch_next() const {  // the next group's 320 bytes
        for (int p = 0; p < 4; p++) _mm_prefetch((const char *)(low + 256 + 64 * p), _MM_HINT_T0);
        _mm_prefetch((const char *)next_high, _MM_HINT_T0);
    }
};

struct q80_codes {
    static constexpr int offset = 128;
    VNNI_TARGET static __m512i dot(__m512i acc, __m512i q, __m512i x) { return _mm512_dpbusd_epi32(acc, q, x); }
    const uint8_t *codes;
    q80_codes(q80_matrix w, size_t group) : codes(w.codes + group * 512) {}
    VNNI_TARGET void pair(int p, __m512i &first, __m512i &second) const {
        first = _mm512_loadu_si512(codes + 128 * p);
        second = _mm512_loadu_si512(codes + 128 * p + 64);
    }
    void prefetch_next() const {  // the next group's 512 bytes
        for (int v = 0; v < 8; v++) _mm_prefetch((const char *)(codes + 512 + 64 * v), _MM_HINT_T0);
    }
};

// Each group's dot starts from -offset times x's code sum and adds q times x's codes (vpdpbusd, q the unsigned
// operand): sum x (q - offset), the int8 kernel's integer; then out += dot * (d_w * d_x) as it does.
template <int RB, typename Matrix, typename Codes>
VNNI_TARGET static void q8_0_block(const q8_0_rows &x, const int32_t *, int r0, Matrix w, int nb, float *y,
                                   int ldy) {
    const int K = x.K, G = K / 32;
    const bool ahead = prefetching(r0, RB, K);
    __m512 out[RB];
    for (int r = 0; r < RB; r++) out[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        size_t group = (size_t)nb * G + g;
        const Codes codes(w, group);
        if (ahead) codes.prefetch_next();
        __m512i acc[RB];
        for (int r = 0; r < RB; r++) acc[r] = _mm512_set1_epi32(-Codes::offset * x.sums[(size_t)(r0 + r) * G + g]);
        for (int p = 0; p < 4; p++) {
            __m512i first, second;
            codes.pair(p, first, second);
            for (int r = 0; r < RB; r++) {
                const int8_t *xr = x.q + (size_t)(r0 + r) * K + 32 * g + 8 * p;
                acc[r] = Codes::dot(acc[r], first, broadcast4(xr));
                acc[r] = Codes::dot(acc[r], second, broadcast4(xr + 4));
            }
        }
        __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w.d + group * 16)));
        for (int r = 0; r < RB; r++) {
            __m512 both = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[(size_t)(r0 + r) * G + g]));
            out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), both, out[r]);
        }
    }
    for (int r = 0; r < RB; r++) _mm512_storeu_ps(y + (size_t)(r0 + r) * ldy + nb * 16, out[r]);
}
#endif  // SPECDISTILL_AVX2

// A kind of block's row groups: Kernel::block<RB> computes rows r0 .. r0 + RB - 1 of one output block, for RB up to
// Kernel::most_rows. Q4_K and Q6_K take up to 8 rows a group: each 64 bytes of codes unpacked once for 8 rows, and a
// verification of 5-8 rows one pass over the weights instead of two, the weights' stream from memory overlapping all
// its rows' products (Zen 4, 2 threads: the 1.5B's forward of 8 rows 1.18x faster than in groups of 4, the same
// numbers; docs/design/kquant-kernels.md "Groups of 8 rows"). Q5_0 and Q8_0 keep groups of 4 (not measured). The
// AVX2 build's loops keep a group's accumulators in 16 registers: groups of KQ_GROUP_ROWS there.
#ifdef SPECDISTILL_AVX2
#define KQ_GROUP_ROWS 4
#else
#define KQ_GROUP_ROWS 8
#endif
struct q4k_kernel {
    static constexpr int most_rows = KQ_GROUP_ROWS;
    template <int RB>
    static void block(const q8k_rows &x, const int32_t *pairs, int r0, q4k_matrix w, int nb, float *y, int ldy) {
        q4k_block<RB>(x, pairs, r0, w, nb, y, ldy);
    }
};

struct q6k_kernel {
    static constexpr int most_rows = KQ_GROUP_ROWS;
    template <int RB>
    static void block(const q8k_rows &x, const int32_t *extra, int r0, q6k_matrix w, int nb, float *y, int ldy) {
        q6k_block<RB>(x, extra, r0, w, nb, y, ldy);
    }
};

template <typename Matrix, typename Codes>
struct q8_0_kernel {
    static constexpr int most_rows = 4;
    template <int RB>
    static void block(const q8_0_rows &x, const int32_t *extra, int r0, Matrix w, int nb, float *y, int ldy) {
        q8_0_block<RB, Matrix, Codes>(x, extra, r0, w, nb, y, ldy);
    }
};

// Kernel::block<n> for a group of n rows (1 <= n <= Kernel::most_rows), the template chosen at run time.
template <typename Kernel, int RB = 1, typename Rows, typename Matrix>
static void group_of_rows(int n, const Rows &x, const int32_t *extra, int r0, Matrix w, int nb, float *y, int ldy) {
    if constexpr (RB <= Kernel::most_rows) {
        if (n == RB)
            Kernel::template block<RB>(x, extra, r0, w, nb, y, ldy);
        else
            group_of_rows<Kernel, RB + 1>(n, x, extra, r0, w, nb, y, ldy);
    }
}

// Every row of x through Kernel's blocks, pass by pass (rows_per_pass), in groups of Kernel::most_rows rows (a pass's
// last group fewer), output blocks split among threads.
// `extra`: what the matrix's blocks read beside x (Q4_K: the sub-block sum pairs), or nullptr.
template <typename Kernel, typename Rows, typename Matrix>
static void kquant_gemm(const Rows &x, const int32_t *extra, Matrix w, float *y, int ldy, int threads) {
    const int pass = rows_per_pass(x.K);
    for (int first = 0; first < x.R; first += pass) {
        const int end = x.R - first < pass ? x.R : first + pass;
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int nb = 0; nb < w.N / 16; nb++)
            for (int r0 = first; r0 < end; r0 += Kernel::most_rows) {
                const int n = end - r0 < Kernel::most_rows ? end - r0 : Kernel::most_rows;
                group_of_rows<Kernel>(n, x, extra, r0, w, nb, y, ldy);
            }
    }
}

// Rows from `first` on of x, as a call of their own (a row's numbers do not depend on the rows beside it).
static q8k_rows rows_from(const q8k_rows &x, int first) {
    return {x.q + (size_t)first * x.K, x.d + (size_t)first * (x.K / 256), x.sums + (size_t)first * (x.K / 16),
            x.R - first, x.K};
}

// How many of a call's rows go to the tiles: all its sixteens where there are at least tile_rows rows.
static int tiled_rows(int R, int tile_rows) { return tile_rows > 0 && R >= tile_rows ? R / 16 * 16 : 0; }

int q4k_gemm(const q8k_rows &x, q4k_matrix w, float *y, int ldy, int threads, int tile_rows) {
    int32_t *pairs = (int32_t *)malloc(sizeof(int32_t) * (size_t)x.R * (x.K / 64));
    if (pairs == NULL) return -1;
    sub_block_sum_pairs(x, pairs);
    const int tiled = tiled_rows(x.R, tile_rows);
    if (tiled > 0) q4k_tiles(x, pairs, tiled, w, y, ldy, threads);
    if (tiled < x.R)
        kquant_gemm<q4k_kernel>(rows_from(x, tiled), pairs + (size_t)tiled * (x.K / 64), w, y + (size_t)tiled * ldy,
                                ldy, threads);
    free(pairs);
    return 0;
}

void q6k_gemm(const q8k_rows &x, q6k_matrix w, float *y, int ldy, int threads, int tile_rows) {
    const int tiled = tiled_rows(x.R, tile_rows);
    if (tiled > 0) q6k_tiles(x, tiled, w, y, ldy, threads);
    if (tiled < x.R)
        kquant_gemm<q6k_kernel>(rows_from(x, tiled), nullptr, w, y + (size_t)tiled * ldy, ldy, threads);
}

template <typename Matrix, typename Codes>
static void q8_0_gemm(const q8_0_rows &x, Matrix w, float *y, int ldy, int threads) {
    kquant_gemm<q8_0_kernel<Matrix, Codes>>(x, nullptr, w, y, ldy, threads);
}

void q50_gemm(const q8_0_rows &x, q50_matrix w, float *y, int ldy, int threads) {
    q8_0_gemm<q50_matrix, q50_codes>(x, w, y, ldy, threads);
}

void gguf_q80_gemm(const q8_0_rows &x, q80_matrix w, float *y, int ldy, int threads) {
    q8_0_gemm<q80_matrix, q80_codes>(x, w, y, ldy, threads);
}

// ---- A projection's parts in one call (decode.lean_decoder's fused layers, models.kernel_linear.KQuantLinear) ----

static bool has_part(const kq_linear &w, bool (*wanted)(kq_kind)) {
    for (int i = 0; i < w.count; i++)
        if (wanted(w.segments[i].kind)) return true;
    return false;
}

static bool per_256(kq_kind kind) { return kind == KQ_Q4K || kind == KQ_Q6K; }
static bool per_32(kq_kind kind) { return kind == KQ_Q50 || kind == KQ_Q80; }

// x's int8 codes, steps and code sums for rows of K in groups of `group` (256: Q8_K, 32: Q8_0), or NULLs where the
// projection has no part that reads them. `status` -1 when memory ran out.
struct rounded_rows {
    int8_t *q = NULL;
    float *d = NULL;
    int32_t *sums = NULL;

    int round(const float *x, int R, int K, int group, int sum_group) {
        q = (int8_t *)malloc((size_t)R * K);
        d = (float *)malloc(sizeof(float) * (size_t)R * (K / group));
        sums = (int32_t *)malloc(sizeof(int32_t) * (size_t)R * (K / sum_group));
        if (q == NULL || d == NULL || sums == NULL) return -1;
        if (group == 256) quantize_rows_q8k(x, R, K, q, d, sums);
        else quantize_rows_q8_0(x, R, K, q, d, sums);
        return 0;
    }

    ~rounded_rows() {
        free(q);
        free(d);
        free(sums);
    }
};

// x rounded once per kind of rows its parts read (per 256 for the K-quants, llama.cpp's Q8_K; per 32 for Q5_0 and
// Q8_0, llama.cpp's Q8_0), then every part writes its columns; the bias added last, as torch adds it to the whole
// output (the same fp32 additions).
int kq_linear_rows(const float *x, int R, const kq_linear &w, float *y, int threads) {
    const int K = w.K;
    rounded_rows by256, by32;
    int status = 0;
    if (has_part(w, per_256)) status |= by256.round(x, R, K, 256, 16);
    if (has_part(w, per_32)) status |= by32.round(x, R, K, 32, 32);
    const q8k_rows rows256 = {by256.q, by256.d, by256.sums, R, K};
    const q8_0_rows rows32 = {by32.q, by32.d, by32.sums, R, K};
    for (int i = 0; status == 0 && i < w.count; i++) {
        const kq_segment &part = w.segments[i];
        switch (part.kind) {
            case KQ_Q4K: status = q4k_gemm(rows256, part.q4k, y + part.column, w.N, threads, w.tile_rows); break;
            case KQ_Q6K: q6k_gemm(rows256, part.q6k, y + part.column, w.N, threads, w.tile_rows); break;
            case KQ_Q50: q50_gemm(rows32, part.q50, y + part.column, w.N, threads); break;
            case KQ_Q80: gguf_q80_gemm(rows32, part.q80, y + part.column, w.N, threads); break;
        }
    }
    if (status == 0 && w.bias != NULL)
        for (int r = 0; r < R; r++)
            for (int n = 0; n < w.N; n++) y[(size_t)r * w.N + n] += w.bias[n];
    return status;
}
