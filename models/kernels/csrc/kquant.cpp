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
// ------------------------------------------------------------------------------------------------------------------
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

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
// (docs/design/kquant-kernels.md).
static inline bool prefetching(int r0, int RB, int K) { return r0 % rows_per_pass(K) == 0 && RB >= 3; }

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
                    acc[r] = _mm512_dpbusd_epi32(acc[r], lo, broadcast4(xr));
                    acc[r] = _mm512_dpbusd_epi32(acc[r], hi, broadcast4(xr + 4));
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

// The top 2 bits of chunk t's codes (t = 4h + u of high vector h) at bits 4..5: ((h >> 2u) & 3) << 4.
VNNI_TARGET static inline __m512i high_bits(__m512i h, int u) {
    const __m512i mask = _mm512_set1_epi8(0x30);
    switch (u) {
        case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), mask);
        case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 2), mask);
        case 2: return _mm512_and_si512(h, mask);
        default: return _mm512_and_si512(_mm512_srli_epi16(h, 2), mask);
    }
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
                    __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low4), high_bits(h, 2 * pp));
                    __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                                                 high_bits(h, 2 * pp + 1));
                    for (int r = 0; r < RB; r++) {
                        const int8_t *xr = x.q + (size_t)(r0 + r) * K + kb * 256 + 32 * s + 8 * p;
                        acc[r] = _mm512_dpbusd_epi32(acc[r], lo, broadcast4(xr));
                        acc[r] = _mm512_dpbusd_epi32(acc[r], hi, broadcast4(xr + 4));
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

// Every row of x through `block`, pass by pass (rows_per_pass), in groups of 4 rows (a pass's last group 1..3),
// output blocks split among threads.
// `extra`: what the matrix's blocks read beside x (Q4_K: the sub-block sum pairs), or nullptr.
template <typename Matrix, void (*B1)(const q8k_rows &, const int32_t *, int, Matrix, int, float *, int),
          void (*B2)(const q8k_rows &, const int32_t *, int, Matrix, int, float *, int),
          void (*B3)(const q8k_rows &, const int32_t *, int, Matrix, int, float *, int),
          void (*B4)(const q8k_rows &, const int32_t *, int, Matrix, int, float *, int)>
static void kquant_gemm(const q8k_rows &x, const int32_t *extra, Matrix w, float *y, int ldy, int threads) {
    const int pass = rows_per_pass(x.K);
    for (int first = 0; first < x.R; first += pass) {
        const int end = x.R - first < pass ? x.R : first + pass;
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int nb = 0; nb < w.N / 16; nb++) {
            int r0 = first;
            for (; r0 + 4 <= end; r0 += 4) B4(x, extra, r0, w, nb, y, ldy);
            switch (end - r0) {
                case 3: B3(x, extra, r0, w, nb, y, ldy); break;
                case 2: B2(x, extra, r0, w, nb, y, ldy); break;
                case 1: B1(x, extra, r0, w, nb, y, ldy); break;
                default: break;
            }
        }
    }
}

int q4k_gemm(const q8k_rows &x, q4k_matrix w, float *y, int ldy, int threads) {
    int32_t *pairs = (int32_t *)malloc(sizeof(int32_t) * (size_t)x.R * (x.K / 64));
    if (pairs == NULL) return -1;
    sub_block_sum_pairs(x, pairs);
    kquant_gemm<q4k_matrix, q4k_block<1>, q4k_block<2>, q4k_block<3>, q4k_block<4>>(x, pairs, w, y, ldy, threads);
    free(pairs);
    return 0;
}

void q6k_gemm(const q8k_rows &x, q6k_matrix w, float *y, int ldy, int threads) {
    kquant_gemm<q6k_matrix, q6k_block<1>, q6k_block<2>, q6k_block<3>, q6k_block<4>>(x, nullptr, w, y, ldy, threads);
}

// ---- A projection's parts in one call (decode.lean_decoder's fused layers, models.kernel_linear.KQuantLinear) ----

// An int8 part (Q5_0 / Q8_0 codes) rounds x per group of 32 itself and writes [R][N] contiguous: its columns of y
// go through a scratch copy.
static int int8_part_rows(const float *x, int R, int K, const kq_segment &part, float *y, int ldy, int threads) {
    float *out = (float *)malloc(sizeof(float) * (size_t)R * part.N);
    if (out == NULL) return -1;
    int status = q8_int8_gemm(x, R, K, part.int8.codes, part.int8.d, part.int8.bias, part.N, out, threads);
    for (int r = 0; status == 0 && r < R; r++)
        memcpy(y + (size_t)r * ldy + part.column, out + (size_t)r * part.N, sizeof(float) * part.N);
    free(out);
    return status;
}

static bool has_kquant_part(const kq_linear &w) {
    for (int i = 0; i < w.count; i++)
        if (w.segments[i].kind != KQ_INT8) return true;
    return false;
}

// x rounded per 256 once (llama.cpp's Q8_K), then every part writes its columns; the bias added last, as torch adds
// it to the whole output (the same fp32 additions).
int kq_linear_rows(const float *x, int R, const kq_linear &w, float *y, int threads) {
    const int K = w.K;
    int8_t *xq = NULL;
    float *dx = NULL;
    int32_t *xs = NULL;
    int status = 0;
    if (has_kquant_part(w)) {
        xq = (int8_t *)malloc((size_t)R * K);
        dx = (float *)malloc(sizeof(float) * (size_t)R * (K / 256));
        xs = (int32_t *)malloc(sizeof(int32_t) * (size_t)R * (K / 16));
        if (xq == NULL || dx == NULL || xs == NULL) status = -1;
        else quantize_rows_q8k(x, R, K, xq, dx, xs);
    }
    const q8k_rows rounded = {xq, dx, xs, R, K};
    for (int i = 0; status == 0 && i < w.count; i++) {
        const kq_segment &part = w.segments[i];
        switch (part.kind) {
            case KQ_Q4K: status = q4k_gemm(rounded, part.q4k, y + part.column, w.N, threads); break;
            case KQ_Q6K: q6k_gemm(rounded, part.q6k, y + part.column, w.N, threads); break;
            default: status = int8_part_rows(x, R, K, part, y, w.N, threads);
        }
    }
    free(xq);
    free(dx);
    free(xs);
    if (status == 0 && w.bias != NULL)
        for (int r = 0; r < R; r++)
            for (int n = 0; n < w.N; n++) y[(size_t)r * w.N + n] += w.bias[n];
    return status;
}
