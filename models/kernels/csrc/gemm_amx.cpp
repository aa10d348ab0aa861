#include "cpu_kernels.h"
#ifndef SPECDISTILL_AVX2  // the AVX2 build has no AMX forms (its stand-ins at the end; bindings.cpp refuses calls)

// ---- The AMX form (Intel AMX-BF16): a tree's rows at a fraction of the FMA form's cost. ----
// y[r, n] = sum_g d[n, g] * sum_j x[r, 32g + j] q[n, 32g + j] + m[n, g] * sum_j x[r, 32g + j]. x is split
// exactly into three bf16 parts (x = x1 + x2 + x3: 8 + 8 + 8 significant bits), q (0..15) is exact in bf16, so
// each tile product x_p . q is exact per term and summed in fp32 by the tile unit; the group's dot product
// (x1.q + x2.q + x3.q), times d, plus m times the group's sum of x, is accumulated per (row, output) in fp32,
// group after group. A row's numbers depend on that row only: alike whatever the number of rows.
// packed: [N/16][G][8][32] bytes, byte i of pair row p = B-tile row 2p's element i (low nibble) and row 2p+1's
// (high nibble), B row kk holding (q[n, 2kk], q[n, 2kk + 1]) for the block's 16 outputs n (the tile unit's pairs).
// d, m: [N/16][G][16] fp16 (a GGUF's own values, half fp32's bytes). N % 32 == 0 (two blocks of 16 outputs share
// each x tile), K % 32 == 0.
// The Q8_0 form (the head) is the same with q in -127..127 (exact in bf16 too) and no m: codes [N/16][G][16][32]
// int8, each B-tile row as it is stored.
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))
#include <unistd.h>
#include <sys/syscall.h>

int amx_request(void) {  // the process asks Linux for the tile data state: arch_prctl(ARCH_REQ_XCOMP_PERM, 18)
    return (int)syscall(SYS_arch_prctl, 0x1023, 18);
}

#define X1 0  // tiles (the intrinsics take literal numbers): x's three parts, the weights of two blocks, products
#define X2 1
#define X3 2
#define B0 3
#define C0 4
#define C1 5
#define B1 7

AMX_TARGET static void configure_tiles(int rows) {  // x parts and products: `rows` rows; weights: 16 pairs
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    int tiles[7] = {X1, X2, X3, B0, C0, C1, B1};
    for (int t = 0; t < 7; t++) {
        c.colsb[tiles[t]] = 64;
        c.rows[tiles[t]] = (tiles[t] == B0 || tiles[t] == B1) ? 16 : rows;
    }
    // GCC's _tile_loadconfig tells the compiler it reads a pointer's 8 bytes of `c` (an "m" operand of type void *),
    // so the stores to colsb and rows may be dropped as dead and ldtilecfg faults on what the stack held: this
    // barrier makes every store to `c` land first (seen with GCC 12 when the function is not inlined).
    asm volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

AMX_TARGET static void split_rows(const float *x, int R, int K, uint16_t *parts, float *sums) {
    // parts [3][R][K] bf16 with x = x1 + x2 + x3 exactly; sums [R][K/32]: each group's sum of x (fixed order)
    size_t plane = (size_t)R * K;
    for (int r = 0; r < R; r++) {
        for (int k = 0; k < K; k += 16) {
            size_t i = (size_t)r * K + k;
            __m512 v = _mm512_loadu_ps(x + i);
            __m256bh p1 = _mm512_cvtneps_pbh(v);
            __m512 rest = _mm512_sub_ps(v, _mm512_cvtpbh_ps(p1));
            __m256bh p2 = _mm512_cvtneps_pbh(rest);
            __m256bh p3 = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, _mm512_cvtpbh_ps(p2)));
            _mm256_storeu_si256((__m256i *)(parts + i), (__m256i)p1);
            _mm256_storeu_si256((__m256i *)(parts + plane + i), (__m256i)p2);
            _mm256_storeu_si256((__m256i *)(parts + 2 * plane + i), (__m256i)p3);
        }
        for (int g = 0; g < K / 32; g++) {
            const float *group = x + (size_t)r * K + 32 * g;
            sums[r * (K / 32) + g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(group),
                                                                        _mm512_loadu_ps(group + 16)));
        }
    }
}

AMX_TARGET static inline void decode_codes(const uint8_t *p, uint16_t *tile, __m512i bf16_of, __m512i low) {
    // one block's group: 256 bytes of nibbles -> the B tile, 16 rows x 32 bf16 (the codes 0..15 looked up)
    for (int pr = 0; pr < 8; pr++) {
        __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * pr)));
        _mm512_store_si512(tile + 64 * pr, _mm512_permutexvar_epi16(_mm512_and_si512(w, low), bf16_of));
        _mm512_store_si512(tile + 64 * pr + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), bf16_of));
    }
}

AMX_TARGET static inline void decode_int8_codes(const uint8_t *p, uint16_t *tile) {
    // one block's group: 512 int8 codes, already in B-tile order -> 16 rows x 32 bf16 (int8 -> fp32 -> bf16, exact)
    for (int row = 0; row < 16; row++) {
        __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 32 * row))));
        __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 32 * row + 16))));
        _mm512_store_si512(tile + 32 * row, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

AMX_TARGET static void amx_rows(const uint16_t *parts, size_t plane, const float *sums, int rows, int K,
                                const uint8_t *packed, const uint16_t *d, const uint16_t *m, int N, float *y) {
    // up to 16 rows (parts and sums already at the first of them), inside a parallel region: blocks of 32 outputs
    // shared out; per group: decode the next group's codes while the tile unit multiplies this one's, and scale
    // the previous group's products (two buffers each, so no step waits on the one before). m == NULL: Q8_0 codes
    int G = K / 32, tile_bytes = m ? 256 : 512;
    uint16_t bf16_table[32] = {0};
    for (int i = 0; i < 16; i++) {
        float f = (float)i;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        bf16_table[i] = (uint16_t)(bits >> 16);
    }
    __m512i bf16_of = _mm512_loadu_si512(bf16_table), low = _mm512_set1_epi16(15);
    uint16_t tiles[2][2][16 * 32] __attribute__((aligned(64)));
    float products[2][2][16 * 16] __attribute__((aligned(64)));
    configure_tiles(rows);
    #pragma omp for schedule(static)
    for (int nb = 0; nb < N / 16; nb += 2) {
        __m512 acc[16][2];
        for (int r = 0; r < 16; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        const uint8_t *codes[2] = {packed + (size_t)nb * G * tile_bytes, packed + (size_t)(nb + 1) * G * tile_bytes};
        for (int b = 0; b < 2; b++) {
            if (m) decode_codes(codes[b], tiles[0][b], bf16_of, low);
            else decode_int8_codes(codes[b], tiles[0][b]);
        }
        for (int g = 0; g <= G; g++) {
            int s = g & 1;
            if (g < G) {
                _tile_zero(C0);
                _tile_zero(C1);
                _tile_loadd(B0, tiles[s][0], 64);
                _tile_loadd(B1, tiles[s][1], 64);
                _tile_loadd(X1, parts + 32 * g, K * 2);
                _tile_loadd(X2, parts + plane + 32 * g, K * 2);
                _tile_loadd(X3, parts + 2 * plane + 32 * g, K * 2);
                _tile_dpbf16ps(C0, X1, B0);
                _tile_dpbf16ps(C1, X1, B1);
                _tile_dpbf16ps(C0, X2, B0);
                _tile_dpbf16ps(C1, X2, B1);
                _tile_dpbf16ps(C0, X3, B0);
                _tile_dpbf16ps(C1, X3, B1);
                _tile_stored(C0, products[s][0], 64);
                _tile_stored(C1, products[s][1], 64);
                for (int b = 0; b < 2 && g + 1 < G; b++) {
                    const uint8_t *next = codes[b] + (size_t)tile_bytes * (g + 1);
                    if (m) decode_codes(next, tiles[s ^ 1][b], bf16_of, low);
                    else decode_int8_codes(next, tiles[s ^ 1][b]);
                }
            }
            if (g > 0) {
                int e = g - 1;
                for (int b = 0; b < 2; b++) {
                    size_t i = ((size_t)(nb + b) * G + e) * 16;
                    __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + i)));
                    for (int r = 0; r < rows; r++)
                        acc[r][b] = _mm512_fmadd_ps(_mm512_load_ps(products[s ^ 1][b] + 16 * r), step, acc[r][b]);
                    if (m) {
                        __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m + i)));
                        for (int r = 0; r < rows; r++)
                            acc[r][b] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[r * G + e]), acc[r][b]);
                    }
                }
            }
        }
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < 2; b++) _mm512_storeu_ps(y + (size_t)r * N + (nb + b) * 16, acc[r][b]);
    }
    _tile_release();
}

AMX_TARGET static int amx_gemm(const float *x, int R, int K, const uint8_t *packed, const uint16_t *d,
                               const uint16_t *m, int N, float *y, int threads) {
    // 0, or -1 when the scratch for x's parts cannot be allocated (nothing written to y)
    size_t plane = (size_t)R * K;
    uint16_t *parts = (uint16_t *)aligned_alloc(64, ((3 * plane * 2 + 63) / 64) * 64);
    float *sums = (float *)malloc(sizeof(float) * (size_t)R * (K / 32));
    if (parts == NULL || sums == NULL) {
        free(parts);
        free(sums);
        return -1;
    }
    split_rows(x, R, K, parts, sums);
    #pragma omp parallel num_threads(threads)
    for (int r0 = 0; r0 < R; r0 += 16)
        amx_rows(parts + (size_t)r0 * K, plane, sums + (size_t)r0 * (K / 32), R - r0 < 16 ? R - r0 : 16, K,
                 packed, d, m, N, y + (size_t)r0 * N);
    free(parts);
    free(sums);
    return 0;
}

int q41_amx(const float *x, int R, int K, const uint8_t *packed, const uint16_t *d, const uint16_t *m, int N,
            float *y, int threads) {
    return amx_gemm(x, R, K, packed, d, m, N, y, threads);
}

int q80_amx(const float *x, int R, int K, const int8_t *codes, const uint16_t *d, int N, float *y, int threads) {
    return amx_gemm(x, R, K, (const uint8_t *)codes, d, NULL, N, y, threads);
}

#else
int amx_request(void) { return -1; }
int q41_amx(const float *, int, int, const uint8_t *, const uint16_t *, const uint16_t *, int, float *, int) { abort(); }
int q80_amx(const float *, int, int, const int8_t *, const uint16_t *, int, float *, int) { abort(); }
#endif
