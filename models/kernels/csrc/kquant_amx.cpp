#include "cpu_kernels.h"
#ifndef SPECDISTILL_AVX2  // the AVX2 build has no AMX forms (its stand-ins at the end; bindings.cpp refuses calls)

// ---- The K-quant GEMMs (kquant.cpp) on AMX-INT8 tiles, for calls of many rows (a prefill, a batch of sequences
// generating side by side, a hidden-state pass): the same integers and the same fp32 operations, so every row is
// bit for bit what the VNNI loop computes for it (tests compare the two at every row count).
//
// Why the weights are rebuilt per block: a K-quant block's integer sum is sum_s sc_s (sum_k q_k x_k) over its
// sub-blocks s, each sub-block's scale a per-output integer. A tile product sums over 64 k at once and cannot scale
// its sub-blocks apart, so each block of 16 outputs x 256 k is rebuilt as w' = sc q (Q4_K: 0..945) or sc (q - 32)
// (Q6_K: -4064..4096), split into two byte planes w' = lo + 256 hi (lo unsigned, hi 0..3 or signed -16..16); the
// tile unit then forms sum lo x and sum hi x exactly in int32, and sum w' x = (sum lo x) + 256 (sum hi x) is the
// VNNI loop's integer for the block. The rebuild (about a thousand vector instructions a block of 16 outputs) is
// shared by every row of the call, which is why tiles pay only for many rows (`tile_rows`, chosen by the caller).
//
// Planes are B tiles: for K-step t (k = 64 t .. 64 t + 63 of the block), row j holds k = 64 t + 4 j .. + 3 of the
// 16 outputs, byte 4 o + i: the packed codes' own layout (kquant.cpp), so each code vector rebuilds one row.
// x's rows are A tiles read straight from the int8 rows (16 rows x 64 k, stride K).
// ------------------------------------------------------------------------------------------------------------------
#define TILE_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")))

#define TA0 0  // tiles (the intrinsics paste literal numbers): two of x's row sixteens, the two planes, products
#define TA1 1
#define TLO 2
#define THI 3
#define TCL0 4
#define TCH0 5
#define TCL1 6
#define TCH1 7

TILE_TARGET static void configure_16x64(void) {  // every tile 16 rows of 64 bytes
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    asm volatile("" : : "r"(&c) : "memory");  // GCC 12 may drop the stores otherwise (gemm_amx.cpp)
    _tile_loadconfig(&c);
}

typedef struct {
    alignas(64) uint8_t lo[4][16][64];  // [K-step][row][16 outputs x 4 k]
    alignas(64) uint8_t hi[4][16][64];
} byte_planes;

// Word lane l of half h (outputs 8 h .. 8 h + 7, 4 k each) -> that output's scale, from 16 scales as words.
TILE_TARGET static inline void scales_by_lane(__m256i scales16, __m512i &half0, __m512i &half1) {
    alignas(64) int16_t idx[64];
    for (int l = 0; l < 32; l++) idx[l] = (int16_t)(l / 4), idx[32 + l] = (int16_t)(8 + l / 4);
    __m512i all = _mm512_castsi256_si512(scales16);
    half0 = _mm512_permutexvar_epi16(_mm512_load_si512(idx), all);
    half1 = _mm512_permutexvar_epi16(_mm512_load_si512(idx + 32), all);
}

// One B-tile row of each plane from 64 code bytes q (byte 4 o + i): w' = (q - offset) * scale in 16 bits.
template <bool SIGNED>
TILE_TARGET static inline void rebuild_row(__m512i q, int offset, __m512i scale0, __m512i scale1, uint8_t *lo,
                                           uint8_t *hi) {
    const __m512i off = _mm512_set1_epi16((int16_t)offset);
    __m512i w0 = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(q)), off), scale0);
    __m512i w1 = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(q, 1)), off),
                                    scale1);
    __m512i h0 = SIGNED ? _mm512_srai_epi16(w0, 8) : _mm512_srli_epi16(w0, 8);
    __m512i h1 = SIGNED ? _mm512_srai_epi16(w1, 8) : _mm512_srli_epi16(w1, 8);
    _mm512_store_si512(lo, _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(w0)),
                                              _mm512_cvtepi16_epi8(w1), 1));
    _mm512_store_si512(hi, _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(h0)),
                                              _mm512_cvtepi16_epi8(h1), 1));
}

// k-group g = 8 s + 2 p (+ 1) of a block (4 k each) is row g % 16 of K-step g / 16.
static inline uint8_t *plane_row(uint8_t (*plane)[16][64], int g) { return plane[g / 16][g % 16]; }

TILE_TARGET static void rebuild_q4k(const uint8_t *codes, const uint8_t *sc, byte_planes &pl) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < 8; s++) {
        __m512i scale0, scale1;
        scales_by_lane(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sc + 16 * s))), scale0, scale1);
        for (int p = 0; p < 4; p++) {
            __m512i v = _mm512_loadu_si512(codes + (s * 4 + p) * 64);
            int g = 8 * s + 2 * p;
            rebuild_row<false>(_mm512_and_si512(v, low4), 0, scale0, scale1, plane_row(pl.lo, g), plane_row(pl.hi, g));
            rebuild_row<false>(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), 0, scale0, scale1,
                               plane_row(pl.lo, g + 1), plane_row(pl.hi, g + 1));
        }
    }
}

TILE_TARGET static void rebuild_q6k(const uint8_t *low, const uint8_t *high, const int8_t *sc, byte_planes &pl) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < 8; s++)
        for (int half = 0; half < 2; half++) {  // sub-block 2 s + half: k-groups 8 s + 4 half .. + 3
            __m512i scale0, scale1;
            scales_by_lane(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(sc + 16 * (2 * s + half)))),
                           scale0, scale1);
            __m512i h = _mm512_loadu_si512(high + (s * 2 + half) * 64);
            for (int pp = 0; pp < 2; pp++) {
                int p = 2 * half + pp, g = 8 * s + 2 * p;
                __m512i v = _mm512_loadu_si512(low + (s * 4 + p) * 64);
                __m512i first = _mm512_or_si512(_mm512_and_si512(v, low4), q6k_high_bits(h, 2 * pp));
                __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4),
                                                 q6k_high_bits(h, 2 * pp + 1));
                rebuild_row<true>(first, 32, scale0, scale1, plane_row(pl.lo, g), plane_row(pl.hi, g));
                rebuild_row<true>(second, 32, scale0, scale1, plane_row(pl.lo, g + 1), plane_row(pl.hi, g + 1));
            }
        }
}

// Products of 16 or 32 rows of x (from `row`) with one block's planes: c[0..1] the lo and hi sums of rows
// row .. row + 15, c[2..3] of the next 16. The hi plane is signed for Q6_K.
template <bool SIGNED_HI, bool TWO>
TILE_TARGET static void tile_products(const int8_t *x, int K, const byte_planes &pl, int32_t (*c)[16][16]) {
    _tile_zero(TCL0);
    _tile_zero(TCH0);
    if (TWO) {
        _tile_zero(TCL1);
        _tile_zero(TCH1);
    }
    for (int t = 0; t < 4; t++) {
        _tile_loadd(TA0, x + 64 * t, K);
        _tile_loadd(TLO, pl.lo[t], 64);
        _tile_loadd(THI, pl.hi[t], 64);
        _tile_dpbsud(TCL0, TA0, TLO);
        if (SIGNED_HI) _tile_dpbssd(TCH0, TA0, THI);
        else _tile_dpbsud(TCH0, TA0, THI);
        if (TWO) {
            _tile_loadd(TA1, x + (size_t)16 * K + 64 * t, K);
            _tile_dpbsud(TCL1, TA1, TLO);
            if (SIGNED_HI) _tile_dpbssd(TCH1, TA1, THI);
            else _tile_dpbsud(TCH1, TA1, THI);
        }
    }
    _tile_stored(TCL0, c[0], 64);
    _tile_stored(TCH0, c[1], 64);
    if (TWO) {
        _tile_stored(TCL1, c[2], 64);
        _tile_stored(TCH1, c[3], 64);
    }
}

// Row i of a product pair: the block's integer sum per output, lo + 256 hi.
TILE_TARGET static inline __m512i block_sum(const int32_t (*c)[16][16], int pair, int i) {
    return _mm512_add_epi32(_mm512_load_si512(c[2 * pair][i]),
                            _mm512_slli_epi32(_mm512_load_si512(c[2 * pair + 1][i]), 8));
}

// Rows r0 .. r0 + rows - 1 (a multiple of 16) of output block nb of a Q4_K matrix, as q4k_block computes them.
TILE_TARGET static void q4k_tile_block(const q8k_rows &x, const int32_t *pairs, int r0, int rows, q4k_matrix w,
                                       int nb, float *y, int ldy) {
    const int K = x.K, KB = K / 256;
    byte_planes pl;
    alignas(64) int32_t c[4][16][16];
    for (int r = r0; r < r0 + rows; r++) _mm512_storeu_ps(y + (size_t)r * ldy + nb * 16, _mm512_setzero_ps());
    for (int kb = 0; kb < KB; kb++) {
        size_t block = (size_t)nb * KB + kb;
        rebuild_q4k(w.codes + block * 2048, w.sc + block * 128, pl);
        const uint8_t *mn = w.m + block * 128;
        __m512i minimum[4];
        for (int j = 0; j < 4; j++)
            minimum[j] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(mn + 32 * j)));
        __m512 d = _mm512_loadu_ps(w.d + block * 16), dmin = _mm512_loadu_ps(w.dmin + block * 16);
        for (int r = r0; r < r0 + rows; r += 32) {
            const bool two = r + 32 <= r0 + rows;
            const int8_t *xr = x.q + (size_t)r * K + kb * 256;
            if (two) tile_products<false, true>(xr, K, pl, c);
            else tile_products<false, false>(xr, K, pl, c);
            for (int i = 0; i < (two ? 32 : 16); i++) {
                const int row = r + i;
                __m512i total = block_sum(c, i / 16, i % 16), mins = _mm512_setzero_si512();
                for (int j = 0; j < 4; j++)
                    mins = _mm512_dpwssd_epi32(mins, minimum[j],
                                               _mm512_set1_epi32(pairs[(size_t)row * (K / 64) + kb * 4 + j]));
                __m512 step = _mm512_set1_ps(x.d[(size_t)row * KB + kb]);
                float *out = y + (size_t)row * ldy + nb * 16;
                __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, step), _mm512_loadu_ps(out));
                _mm512_storeu_ps(out, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dmin, step), acc));
            }
        }
    }
}

TILE_TARGET static void q6k_tile_block(const q8k_rows &x, const int32_t *, int r0, int rows, q6k_matrix w, int nb,
                                       float *y, int ldy) {
    const int K = x.K, KB = K / 256;
    byte_planes pl;
    alignas(64) int32_t c[4][16][16];
    for (int r = r0; r < r0 + rows; r++) _mm512_storeu_ps(y + (size_t)r * ldy + nb * 16, _mm512_setzero_ps());
    for (int kb = 0; kb < KB; kb++) {
        size_t block = (size_t)nb * KB + kb;
        rebuild_q6k(w.low + block * 2048, w.high + block * 1024, w.sc + block * 256, pl);
        __m512 d = _mm512_loadu_ps(w.d + block * 16);
        for (int r = r0; r < r0 + rows; r += 32) {
            const bool two = r + 32 <= r0 + rows;
            const int8_t *xr = x.q + (size_t)r * K + kb * 256;
            if (two) tile_products<true, true>(xr, K, pl, c);
            else tile_products<true, false>(xr, K, pl, c);
            for (int i = 0; i < (two ? 32 : 16); i++) {
                const int row = r + i;
                __m512 step = _mm512_set1_ps(x.d[(size_t)row * KB + kb]);
                float *out = y + (size_t)row * ldy + nb * 16;
                _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_sum(c, i / 16, i % 16)),
                                                      _mm512_mul_ps(d, step), _mm512_loadu_ps(out)));
            }
        }
    }
}

// The first `rows` rows (a multiple of 16) of x through `Block`, in passes whose int8 rows stay in L2 (kquant.cpp's
// rows_per_pass, rounded down to 16), output blocks split among threads; each thread configures its own tiles.
template <typename Matrix, void (*Block)(const q8k_rows &, const int32_t *, int, int, Matrix, int, float *, int)>
TILE_TARGET static void tiled_gemm(const q8k_rows &x, const int32_t *extra, int rows, Matrix w, float *y, int ldy,
                                   int threads) {
    int pass = (512 * 1024 / x.K) / 16 * 16;
    if (pass < 16) pass = 16;
    #pragma omp parallel num_threads(threads)
    {
        configure_16x64();
        for (int first = 0; first < rows; first += pass) {
            const int count = rows - first < pass ? rows - first : pass;
            #pragma omp for schedule(static)
            for (int nb = 0; nb < w.N / 16; nb++) Block(x, extra, first, count, w, nb, y, ldy);
        }
        _tile_release();
    }
}

void q4k_tiles(const q8k_rows &x, const int32_t *pairs, int rows, q4k_matrix w, float *y, int ldy, int threads) {
    tiled_gemm<q4k_matrix, q4k_tile_block>(x, pairs, rows, w, y, ldy, threads);
}

void q6k_tiles(const q8k_rows &x, int rows, q6k_matrix w, float *y, int ldy, int threads) {
    tiled_gemm<q6k_matrix, q6k_tile_block>(x, nullptr, rows, w, y, ldy, threads);
}

#else
void q4k_tiles(const q8k_rows &, const int32_t *, int, q4k_matrix, float *, int, int) { abort(); }
void q6k_tiles(const q8k_rows &, int, q6k_matrix, float *, int, int) { abort(); }
#endif
