// The engine's CPU kernels (AVX-512; AVX2 through avx2_isa.h): exact GEMMs over the default target's own 4- and
// 8-bit weights, the lean forward's row operations and decode-time attention, a decoder layer's rows in two calls,
// int8 drafting GEMMs and the greedy head. Raw-pointer functions: every caller goes through bindings.cpp, which
// checks dtype, shape and contiguity at the boundary. Threads: `threads` OpenMP threads of the runtime torch itself
// loaded (the library links libgomp.so.1, the soname torch's bundled copy carries, so one pool serves both).
#pragma once
#ifdef SPECDISTILL_AVX2
#include "avx2_isa.h"  // the AVX2 build: these AVX-512 sources on SIMDe, with exact AVX2 integer dot products
#else
#include <immintrin.h>
#define ISA_TARGET(features) __attribute__((target(features)))
// vpdpbusd where every unsigned byte is below 128 (a K-quant block's codes; the AVX2 build's form is cheaper there)
#define dpbusd_below_128 _mm512_dpbusd_epi32
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {  // a Q4_1 matrix in the FMA form: packed [N][K/2], d and m [N][K/32]
    const uint8_t *packed;
    const float *d, *m;
    int N;
} q41_matrix;

typedef struct {  // an int8 matrix (Q8Int8Weight): codes [N/16][K/32][8][16][4], d and bias [N/16][K/32][16]
    const int8_t *codes;
    const float *d;
    const int32_t *bias;
    int N;
} int8_matrix;

typedef struct {  // rows of x rounded to int8 per block of 256 (quantize_rows_q8k): q [R][K], d [R][K/256], sums [R][K/16]
    const int8_t *q;
    const float *d;
    const int32_t *sums;
    int R, K;
} q8k_rows;

typedef struct {  // a Q4_K matrix in kquant.cpp's layout: codes [N/16][K/256][8][4][64], sc [..][8][16], m [..][4][16][2]
    const uint8_t *codes, *sc, *m;
    const float *d, *dmin;  // [N/16][K/256][16]
    int N;
} q4k_matrix;

typedef struct {  // a Q6_K matrix in kquant.cpp's layout: low [N/16][K/256][8][4][64], high [..][8][2][64]
    const uint8_t *low, *high;
    const int8_t *sc;  // [N/16][K/256][16][16]
    const float *d;    // [N/16][K/256][16]
    int N;
} q6k_matrix;

typedef struct {  // rows of x rounded to int8 per group of 32 (quantize_rows_q8_0): q [R][K], d and sums [R][K/32]
    const int8_t *q;
    const float *d;
    const int32_t *sums;
    int R, K;
} q8_0_rows;

typedef struct {  // a Q5_0 matrix in kquant.cpp's layout: low [N/16][K/32][4][64], high [..][64], d fp16 [..][16]
    const uint8_t *low, *high;
    const uint16_t *d;
    int N;
} q50_matrix;

typedef struct {  // a GGUF's Q8_0 matrix in kquant.cpp's layout: codes [N/16][K/32][8][64] (code + 128), d fp16 [..][16]
    const uint8_t *codes;
    const uint16_t *d;
    int N;
} q80_matrix;

typedef enum { KQ_Q4K, KQ_Q6K, KQ_Q50, KQ_Q80 } kq_kind;

typedef struct {  // one part of a projection over a GGUF's own blocks: outputs [column, column + N) of the whole
    kq_kind kind;
    q4k_matrix q4k;    // kind KQ_Q4K
    q6k_matrix q6k;    // kind KQ_Q6K
    q50_matrix q50;    // kind KQ_Q50
    q80_matrix q80;    // kind KQ_Q80
    int column, N;
} kq_segment;

typedef struct {  // a projection over a K-quant GGUF's blocks: its parts side by side (a fused q/k/v, gate/up), a bias
    const kq_segment *segments;
    int count, N, K;
    const float *bias;  // [N], or NULL
    int tile_rows;      // calls of at least this many rows run their Q4_K/Q6_K parts on AMX-INT8 tiles (0: never)
} kq_linear;

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

// gemm_fma.cpp
void q41_gemm(const float *x, int R, int K, const uint8_t *packed, const float *d, const float *m, int N, float *y,
              int threads);
void q80_gemm(const float *x, int R, int K, const int8_t *codes, const float *d, int N, float *y, int threads);

// row_ops.cpp
void rms_norm_rows(const float *x, int R, int D, const float *w, float eps, float *y);
void rope_qk(const float *qkv, int N, int H, int Hkv, int hd, const float *cos, const float *sin, float *q,
             float *k);
// query heads of a key/value head that one pass over its keys takes together: 3 x 8 fp32 vectors of a 128-wide head
// in registers
constexpr int MOST_HEADS = 3;
int attention_rows(const float *q, int H, int Hkv, int N, int hd, const float *k, const float *v, long head_stride,
                   int T, const uint8_t *visible, float scale, float *out, int threads,
                   int most_heads = MOST_HEADS);
int attention_spans(const float *q, int H, int Hkv, int N, int hd, const float *k, const float *v, long head_stride,
                    const int64_t *spans, float scale, float *out, int threads);
void append_keys_values(const float *k, const float *qkv, int N, int H, int Hkv, int hd, float *keys,
                        float *values, long head_stride, int start);
int layer_rows_attention(const float *x, int N, int D, const float *norm_in, float eps_in, q41_matrix qkv, int H,
                         int Hkv, int hd, const float *cos, const float *sin, float *keys, float *values,
                         long head_stride, int start, int T, const uint8_t *visible, float scale, q41_matrix o,
                         const float *norm_post, float eps_post, q41_matrix gate_up, float *y, float *gate_up_out,
                         float *work, int threads);
int layer_rows_down(float *y, int N, int D, const float *activated, int I, q41_matrix down, float *work,
                    int threads);
// the same two calls over a K-quant GGUF's projections (kq_linear_rows; 0, or -1 without memory)
int layer_rows_attention(const float *x, int N, int D, const float *norm_in, float eps_in, const kq_linear &qkv,
                         int H, int Hkv, int hd, const float *cos, const float *sin, float *keys, float *values,
                         long head_stride, int start, int T, const uint8_t *visible, float scale, const kq_linear &o,
                         const float *norm_post, float eps_post, const kq_linear &gate_up, float *y,
                         float *gate_up_out, float *work, int threads);
int layer_rows_down(float *y, int N, int D, const float *activated, int I, const kq_linear &down, float *work,
                    int threads);

// kquant.cpp (AVX512-VNNI): y[r][0..N) at row stride ldy; with R >= tile_rows > 0 its rows in sixteens on AMX-INT8
// tiles (kquant_amx.cpp; the caller checked the CPU and the process's tile permission), the same numbers
void quantize_rows_q8k(const float *x, int R, int K, int8_t *xq, float *dx, int32_t *xs);
int q4k_gemm(const q8k_rows &x, q4k_matrix w, float *y, int ldy, int threads, int tile_rows);  // 0, or -1 (memory)
void q6k_gemm(const q8k_rows &x, q6k_matrix w, float *y, int ldy, int threads, int tile_rows);
void quantize_rows_q8_0(const float *x, int R, int K, int8_t *xq, float *dx, int32_t *xs);
void q50_gemm(const q8_0_rows &x, q50_matrix w, float *y, int ldy, int threads);
void gguf_q80_gemm(const q8_0_rows &x, q80_matrix w, float *y, int ldy, int threads);
// y [R][w.N] = x [R][w.K] W^T (+ bias): x rounded once for every K-quant part; 0, or -1 (no memory)
int kq_linear_rows(const float *x, int R, const kq_linear &w, float *y, int threads);

// kquant_amx.cpp: the first `rows` (a multiple of 16) rows of x; pairs as q4k_gemm makes them
void q4k_tiles(const q8k_rows &x, const int32_t *pairs, int rows, q4k_matrix w, float *y, int ldy, int threads);
void q6k_tiles(const q8k_rows &x, int rows, q6k_matrix w, float *y, int ldy, int threads);

// gemm_amx.cpp
int amx_request(void);
int q41_amx(const float *x, int R, int K, const uint8_t *packed, const uint16_t *d, const uint16_t *m, int N,
            float *y, int threads);
int q80_amx(const float *x, int R, int K, const int8_t *codes, const uint16_t *d, int N, float *y, int threads);

// int8.cpp
int q8_int8_gemm(const float *x, int R, int K, const int8_t *codes, const float *d, const int32_t *bias, int N,
                 float *y, int threads);
int eagle3_rows(const float *embeds, const float *states, int N, int D, const float *norm_embed, float eps_embed,
                const float *norm_state, float eps_state, int8_matrix qkv, int H, int Hkv, int hd,
                const float *cos_table, const float *sin_table, const int64_t *positions, float *keys, float *values,
                long head_stride, int start, const uint8_t *visible, float scale, int8_matrix o,
                const float *norm_post, float eps_post, int8_matrix gate_up, int I, int8_matrix down, float *out,
                int threads);
int eagle3_top(const float *out, int N, int D, const float *norm_out, float eps_out, int8_matrix head, int topk,
               float *values, int64_t *indices, int threads);
int q8_argmax(const float *x, int R, int K, const int8_t *codes, const float *d, const int32_t *bias,
              const float *slack, int N, int64_t *tokens, int32_t *candidates, int threads);

// A Q6_K high vector h's top 2 bits of chunk t = 4h + u's codes at bits 4..5: ((h >> 2u) & 3) << 4 (kquant.cpp's
// loop and kquant_amx.cpp's rebuilt weights).
ISA_TARGET("avx512f,avx512bw") static inline __m512i q6k_high_bits(__m512i h, int u) {
    const __m512i mask = _mm512_set1_epi8(0x30);
    switch (u) {
        case 0: return _mm512_and_si512(_mm512_slli_epi16(h, 4), mask);
        case 1: return _mm512_and_si512(_mm512_slli_epi16(h, 2), mask);
        case 2: return _mm512_and_si512(h, mask);
        default: return _mm512_and_si512(_mm512_srli_epi16(h, 2), mask);
    }
}

// exp's constants (Cephes' expf): below EXP_FLOOR the result is flushed to 0; ln 2 in two parts; the polynomial's
// coefficients, highest degree first
static constexpr float EXP_FLOOR = -87.33654f, EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f,
                       EXP_LN2_LO = -2.12194440e-4f;
static constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                      4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline __m512 exp_nonpositive(__m512 x) {  // x <= 0
    __mmask16 alive = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(alive, _mm512_scalef_ps(p, n));
}

static inline __m512 sums_of_16(__m512 a[16]) {  // lane j: the sum of a[j]'s 16 lanes (a fixed order)
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of a = a[2i], b = a[2i+1]
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per 128-bit lane: that lane's sum of a[4i], ..., a[4i + 3]
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}

