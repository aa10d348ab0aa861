"""The target's layer GEMMs computed in their own 4-bit form (Q4_1), for the engine's decode-time rows.

Why: the default target ships as a Q4_1 GGUF, so every matrix of its 30 layers holds, per group of 32 weights,
q * d + m with q in 0..15 (checked here matrix by matrix: `grid_deviation` is exactly 0). The engine streams
them as 425 MB of fp32 a forward; packed two codes a byte they are 53 MB (plus 13 MB of steps and minima). A
small AVX-512 kernel (compiled once with the system's gcc into the cache, loaded with ctypes) computes
x @ W^T from the codes with fp32 activations and fp32 accumulation: the same weights, only the summation order
differs from oneDNN's, and each row is computed alike whatever the number of rows, so plain decoding and every
speculative verification see the same numbers. BENCHMARKS.md, "A Q4_1 kernel of our own".

Where it runs: `q41_or_packed` gives a `Q41Linear` for a bias-free fp32 matrix on its grid (K a multiple
of 32, N even) when the kernel is available (an AVX-512 CPU, gcc on PATH, not switched off by
$SPECDISTILL_NO_Q41); calls of at most `MAX_ROWS` rows go to the kernel, longer ones (prefill) to oneDNN's packed
GEMM. Anything else keeps models.packed_linear's PackedLinear, and the reason is logged once.

The head: the default target's tied embedding is Q8_0 in the GGUF (int8 codes, one fp16-born step per group of
32, so every weight is q * d exactly). `head_for_inference` gives it a `Q80Linear` on the library's second
function, `q80_gemm` (the same blocking and row-alike order): 113 MB of fp32 become 28 MB of codes, the head of a
one-row forward about 1.9x faster (BENCHMARKS.md, stop 46).

The library also holds the lean forwards' row operations (`rms_norm_rows`, `rope_qk`) and their decode-time
attention (`attention_rows`: a few query rows over the cache, grouped-query, each (head, row) computed alone), and
a decoder layer's decode-time rows strung from those functions in two calls (`layer_rows_attention`,
`layer_rows_down`: decode.lean_decoder.FusedLayer).

On AVX512-VNNI two more things use int8 dot products. Drafters: Q8_0 weights times decode-time rows rounded to int8
per group of 32 (`q8_int8_gemm`, `Q8Int8Linear`; an approximation, so never the target's numbers), and an EAGLE-3
drafter's depth in two calls (`eagle3_rows`, `eagle3_top`: decode.lean_eagle3.FusedRows). The target's greedy steps:
`GreedyHead` takes each row's argmax of the Q8_0 head's logits from an int8 pass with a rigorous bound plus the few
candidates it cannot rule out, computed exactly as `q80_gemm` computes them: the same token as the full logits'
argmax, the head 1.65-2.2x cheaper (BENCHMARKS.md, stop 50).

Two forms of each: "fma" (AVX-512 FMAs over weights rebuilt exactly) and, where the CPU has AMX-BF16 and Linux
grants this process the tile state (`amx_unavailable`), "amx": x split exactly into three bf16 parts, the codes
exact in bf16, each group's products summed in fp32 by the tile unit, then scaled by d (and m times the group's
sum of x) in fp32. A tree's 14 rows of layer GEMMs cost half the FMA form's, the head's a third, one row no more
(BENCHMARKS.md, "The kernels on AMX tiles"). A matrix is packed in one form (AMX where N is whole blocks of 32
outputs and its steps and minima are fp16 values, as a GGUF stores them) and every call over it uses that form,
so rows stay alike; $SPECDISTILL_NO_AMX keeps the FMA form everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from models.cache import cache_root
from models.packed_linear import (PackedLinear, cached_copy, clone_with_packed_linears, packed_for_inference,
                                  packing_supported, weights_signature)

log = logging.getLogger("specdistill.q41")
_copies: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.nn.Module]]" = weakref.WeakKeyDictionary()
_head_checks: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, bool]]" = weakref.WeakKeyDictionary()

DISABLE_ENV = "SPECDISTILL_NO_Q41"
NO_AMX_ENV = "SPECDISTILL_NO_AMX"
GROUP = 32
GRID_TOLERANCE = 1e-6  # a matrix within this of its grid (relative to its largest weight) is Q4_1 up to rounding
MAX_ROWS = 64  # decode-time calls (trees, chains, single rows); longer calls are prefill, left to oneDNN

KERNEL_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
// y[R, N] = x[R, K] @ W^T, W[n, 32g + j] = q * d[n, g] + m[n, g]; packed[n, 16g + j] = q_j | q_{j+16} << 4.
// K % 32 == 0, N % NB == 0. The weights are rebuilt exactly as they were dequantized (q * d rounded, then + m
// rounded), so this is x @ W^T with the fp32 W, in another summation order: per (row, output) one 16-lane
// accumulator over the groups, then its lanes' sum. That order does not depend on R: a row is computed alike
// whatever the number of rows. Blocks of RB rows x NB outputs share each x load and each decoded weight vector
// (a tree's rows are bound by FMA throughput; the blocking keeps loads and decoding off that path). A group's 16
// possible weights are computed once (0..15 times d, plus m: the same roundings) and each weight looked up by its
// code (vpermps reads an index's low 4 bits), in place of a conversion, a product and a sum per weight: the same
// bits, one-row GEMMs 1.18x faster (BENCHMARKS.md, stop 49).
#define RB 8
#define NB 2
void q41_gemm(const float *x, int R, int K, const uint8_t *packed, const float *d, const float *m, int N, float *y,
              int threads) {
    int G = K / 32;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n0 = 0; n0 < N; n0 += NB) {
        const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? R - r0 : RB;
            __m512 acc[RB][NB];
            for (int r = 0; r < RB; r++)
                for (int a = 0; a < NB; a++) acc[r][a] = _mm512_setzero_ps();
            for (int g = 0; g < G; g++) {
                __m512i codes[NB];
                __m512 table[NB], w[NB];
                for (int a = 0; a < NB; a++) {
                    size_t i = (size_t)(n0 + a) * G + g;
                    codes[a] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(packed + 16 * i)));
                    table[a] = _mm512_add_ps(_mm512_mul_ps(levels, _mm512_set1_ps(d[i])), _mm512_set1_ps(m[i]));
                }
                for (int half = 0; half < 2; half++) {  // weights 0..15 of the group (low nibbles), then 16..31
                    for (int a = 0; a < NB; a++) {
                        __m512i q = half ? _mm512_srli_epi32(codes[a], 4) : codes[a];  // the index's low 4 bits
                        w[a] = _mm512_permutexvar_ps(q, table[a]);
                    }
                    for (int r = 0; r < rb; r++) {
                        __m512 xv = _mm512_loadu_ps(x + (size_t)(r0 + r) * K + g * 32 + half * 16);
                        for (int a = 0; a < NB; a++) acc[r][a] = _mm512_fmadd_ps(w[a], xv, acc[r][a]);
                    }
                }
            }
            for (int r = 0; r < rb; r++)
                for (int a = 0; a < NB; a++) y[(size_t)(r0 + r) * N + n0 + a] = _mm512_reduce_add_ps(acc[r][a]);
        }
    }
}

// The Q8_0 form (the default target's tied head): W[n, 32g + j] = q * d[n, g], q int8; codes[n, 32g + j] = q.
// q * d is exact in fp32 (8-bit q, fp16-born d), so this too is x @ W^T with the fp32 W in another order, each
// row alike whatever R is, in the same blocks.
void q80_gemm(const float *x, int R, int K, const int8_t *codes, const float *d, int N, float *y, int threads) {
    int G = K / 32;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int n0 = 0; n0 < N; n0 += NB) {
        for (int r0 = 0; r0 < R; r0 += RB) {
            int rb = R - r0 < RB ? R - r0 : RB;
            __m512 acc[RB][NB];
            for (int r = 0; r < RB; r++)
                for (int a = 0; a < NB; a++) acc[r][a] = _mm512_setzero_ps();
            for (int g = 0; g < G; g++) {
                for (int half = 0; half < 2; half++) {  // weights 0..15 of the group, then 16..31
                    __m512 w[NB];
                    for (int a = 0; a < NB; a++) {
                        size_t i = (size_t)(n0 + a) * G + g;
                        __m128i q = _mm_loadu_si128((const __m128i *)(codes + 32 * i + 16 * half));
                        w[a] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(d[i]));
                    }
                    for (int r = 0; r < rb; r++) {
                        __m512 xv = _mm512_loadu_ps(x + (size_t)(r0 + r) * K + g * 32 + half * 16);
                        for (int a = 0; a < NB; a++) acc[r][a] = _mm512_fmadd_ps(w[a], xv, acc[r][a]);
                    }
                }
            }
            for (int r = 0; r < rb; r++)
                for (int a = 0; a < NB; a++) y[(size_t)(r0 + r) * N + n0 + a] = _mm512_reduce_add_ps(acc[r][a]);
        }
    }
}

// ---- Row-wise operations of the engine's lean forward (decode.lean_decoder): one call each instead of the 5-8
// tensor operations (and their dispatch) that RMSNorm and the rotary embedding take in torch. Each row alone. ----
// y[r] = (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) * w, as transformers' LlamaRMSNorm orders it. D % 16 == 0.
void rms_norm_rows(const float *x, int R, int D, const float *w, float eps, float *y) {
    for (int r = 0; r < R; r++) {
        const float *row = x + (size_t)r * D;
        __m512 squares = _mm512_setzero_ps();
        for (int k = 0; k < D; k += 16) {
            __m512 v = _mm512_loadu_ps(row + k);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)D + eps));
        for (int k = 0; k < D; k += 16)
            _mm512_storeu_ps(y + (size_t)r * D + k,
                             _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(row + k), scale), _mm512_loadu_ps(w + k)));
    }
}

// The rotary embedding of q and k straight from the fused projection's rows: qkv [N][(H + Hkv + Hkv) hd] (q heads,
// k heads, v heads), cos and sin [N][hd] -> q [H][N][hd], k [Hkv][N][hd], each x * cos + rotate_half(x) * sin with
// rotate_half(x) = (-x2, x1): the same products and sum, each rounded, as transformers' apply_rotary_pos_emb.
// hd % 32 == 0.
static inline __m512 negated(__m512 x, __m512i sign) {  // -x (its sign bit flipped)
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign));
}

void rope_qk(const float *qkv, int N, int H, int Hkv, int hd, const float *cos, const float *sin, float *q,
             float *k) {
    int half = hd / 2, width = (H + 2 * Hkv) * hd;
    __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int n = 0; n < N; n++) {
        const float *c = cos + (size_t)n * hd, *s = sin + (size_t)n * hd;
        for (int h = 0; h < H + Hkv; h++) {
            const float *x = qkv + (size_t)n * width + (size_t)h * hd;
            float *out = h < H ? q + ((size_t)h * N + n) * hd : k + ((size_t)(h - H) * N + n) * hd;
            for (int i = 0; i < half; i += 16) {
                __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + half + i);
                __m512 first = _mm512_add_ps(_mm512_mul_ps(x1, _mm512_loadu_ps(c + i)),
                                             _mm512_mul_ps(negated(x2, sign), _mm512_loadu_ps(s + i)));
                __m512 second = _mm512_add_ps(_mm512_mul_ps(x2, _mm512_loadu_ps(c + half + i)),
                                              _mm512_mul_ps(x1, _mm512_loadu_ps(s + half + i)));
                _mm512_storeu_ps(out + i, first);
                _mm512_storeu_ps(out + half + i, second);
            }
        }
    }
}

// ---- Decode-time attention (decode.lean_decoder, decode.lean_eagle3): a few query rows over the cache. ----
// torch's CPU flash attention costs about 75 us a layer for one row over 300 keys on 2 cores (SDPA's setup and
// blocking, made for long queries), about 2 ms of a 16 ms forward; this is a few microseconds. Each (head, row)
// alone, keys in order: a row's numbers depend only on its query and what it sees, whatever the number of rows.
// exp as Cephes' expf (range reduction by ln 2, degree-6 polynomial, about 1 ulp); arguments below -87.3 (the
// scores far under their maximum) and keys the mask hides contribute exactly 0.
static inline __m512 exp_nonpositive(__m512 x) {  // x <= 0
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2_hi = _mm512_set1_ps(0.693359375f),
                 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 alive = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_GE_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
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

static inline __attribute__((always_inline)) void attend_row(const float *q, const float *k, const float *v, int T,
                                                              int hd, const uint8_t *visible, float scale,
                                                              float *scores, float *out) {
    // scores [T rounded up to 16]: scratch. out [hd] = sum_t p_t v_t / sum_t p_t over the visible t. Keys in blocks
    // of 16: their dot products summed lane-wise, then the 16 sums at once (sums_of_16); a block the row cannot see
    // at all is skipped (a static-shape cache's unused tail).
    const __m512 hidden = _mm512_set1_ps(-INFINITY), scaling = _mm512_set1_ps(scale);
    __m512 top = hidden;
    for (int t0 = 0; t0 < T; t0 += 16) {
        int count = T - t0 < 16 ? T - t0 : 16;
        __mmask16 lanes = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
        uint8_t flags[16] = {0};
        memcpy(flags, visible + t0, (size_t)count);  // not past the row's T bytes
        __mmask16 seen = _mm512_mask_cmpneq_epi32_mask(
            lanes, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)flags)), _mm512_setzero_si512());
        if (!seen) {
            _mm512_storeu_ps(scores + t0, hidden);
            continue;
        }
        __m512 dots[16];
        for (int j = 0; j < 16; j++) {
            if (j >= count) {
                dots[j] = _mm512_setzero_ps();
                continue;
            }
            const float *key = k + (size_t)(t0 + j) * hd;
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(key));
            for (int i = 16; i < hd; i += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(key + i), s);
            dots[j] = s;
        }
        __m512 block = _mm512_mask_blend_ps(seen, hidden, _mm512_mul_ps(sums_of_16(dots), scaling));
        _mm512_storeu_ps(scores + t0, block);
        top = _mm512_max_ps(top, block);
    }
    __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    for (int t0 = 0; t0 < T; t0 += 16) {  // hidden keys: exp(-inf) flushed to exactly 0
        __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + t0), shift));
        _mm512_storeu_ps(scores + t0, p);
        total = _mm512_add_ps(total, p);
    }
    __m512 acc[16];
    int chunks = hd / 16;
    for (int c = 0; c < chunks; c++) acc[c] = _mm512_setzero_ps();
    for (int t = 0; t < T; t++) {
        if (scores[t] == 0.0f) continue;  // hidden, or too small to count
        __m512 p = _mm512_set1_ps(scores[t]);
        const float *value = v + (size_t)t * hd;
        for (int c = 0; c < chunks; c++) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(value + 16 * c), acc[c]);
    }
    __m512 sum = _mm512_set1_ps(_mm512_reduce_add_ps(total));
    for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out + 16 * c, _mm512_div_ps(acc[c], sum));
}

// q [H][N][hd] (contiguous); head j's keys and values: row t at k + j * head_stride + t * hd (j = h / (H / Hkv));
// visible [N][T] bytes (nonzero: row n attends to key t; every row sees at least one key); out [N][H * hd], the
// layout the output projection reads. hd % 16 == 0, hd <= 256. 0, or -1 without scratch memory (out unwritten).
int attention_rows(const float *q, int H, int Hkv, int N, int hd, const float *k, const float *v, long head_stride,
                   int T, const uint8_t *visible, float scale, float *out, int threads) {
    int padded = (T + 15) / 16 * 16, group = H / Hkv, units = H * N;
    if (threads > units) threads = units;
    if (threads < 1) threads = 1;
    float *scratch = malloc(sizeof(float) * (size_t)padded * threads);
    if (scratch == NULL) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int u = 0; u < units; u++) {  // (head, row) pairs, a key/value head's rows side by side
        int h = u / N, n = u % N;
        size_t kv = (size_t)(h / group) * head_stride;
        const float *row_q = q + (size_t)u * hd, *row_k = k + kv, *row_v = v + kv;
        const uint8_t *seen = visible + (size_t)n * T;
        float *scores = scratch + (size_t)omp_get_thread_num() * padded, *row_out = out + (size_t)n * H * hd + h * hd;
        switch (hd) {  // the common head sizes with their loops unrolled (the accumulators in registers)
            case 64: attend_row(row_q, row_k, row_v, T, 64, seen, scale, scores, row_out); break;
            case 128: attend_row(row_q, row_k, row_v, T, 128, seen, scale, scores, row_out); break;
            case 32: attend_row(row_q, row_k, row_v, T, 32, seen, scale, scores, row_out); break;
            default: attend_row(row_q, row_k, row_v, T, hd, seen, scale, scores, row_out);
        }
    }
    free(scratch);
    return 0;
}

// The rows' rotated keys k [Hkv][N][hd] and their values (the v heads of the fused projection's rows qkv
// [N][(H + 2 Hkv) hd]) into the cache at rows start..start+N-1 (head j's row t at keys + j * head_stride + t * hd).
static void append_keys_values(const float *k, const float *qkv, int N, int H, int Hkv, int hd, float *keys,
                               float *values, long head_stride, int start) {
    int width = (H + 2 * Hkv) * hd;
    for (int j = 0; j < Hkv; j++)
        for (int n = 0; n < N; n++) {
            size_t row = (size_t)j * head_stride + (size_t)(start + n) * hd;
            memcpy(keys + row, k + ((size_t)j * N + n) * hd, sizeof(float) * hd);
            memcpy(values + row, qkv + (size_t)n * width + (size_t)(H + Hkv + j) * hd, sizeof(float) * hd);
        }
}

// ---- A decoder layer's decode-time rows in two calls (decode.lean_decoder.FusedLayer): the same functions in the
// same order as the lean forward's Python (so the same bits), without its thirty-odd tensor operations a layer. ----
typedef struct {  // a Q4_1 matrix in the FMA form: packed [N][K/2], d and m [N][K/32]
    const uint8_t *packed;
    const float *d, *m;
    int N;
} q41_matrix;

// y [N][D] = x + o(attention(rope(qkv(rms_norm(x))))); gate_up [N][2I] = gate_up(rms_norm(y)); the rows' keys and
// values written to the cache at rows start..start+N-1 of each head (head j's row t at keys + j * head_stride +
// t * hd). work: N * (D + Q + (H + Hkv) * hd + H * hd) floats, Q = (H + 2 Hkv) * hd. 0, or -1 (no memory).
int layer_rows_attention(const float *x, int N, int D, const float *norm_in, float eps_in, q41_matrix qkv, int H,
                         int Hkv, int hd, const float *cos, const float *sin, float *keys, float *values,
                         long head_stride, int start, int T, const uint8_t *visible, float scale, q41_matrix o,
                         const float *norm_post, float eps_post, q41_matrix gate_up, float *y, float *gate_up_out,
                         float *work, int threads) {
    int width = (H + 2 * Hkv) * hd;
    float *normed = work, *fused = normed + (size_t)N * D, *q = fused + (size_t)N * width;
    float *k = q + (size_t)H * N * hd, *attended = k + (size_t)Hkv * N * hd;
    rms_norm_rows(x, N, D, norm_in, eps_in, normed);
    q41_gemm(normed, N, D, qkv.packed, qkv.d, qkv.m, width, fused, threads);
    rope_qk(fused, N, H, Hkv, hd, cos, sin, q, k);
    append_keys_values(k, fused, N, H, Hkv, hd, keys, values, head_stride, start);
    if (attention_rows(q, H, Hkv, N, hd, keys, values, head_stride, T, visible, scale, attended, threads) != 0)
        return -1;
    q41_gemm(attended, N, H * hd, o.packed, o.d, o.m, D, y, threads);  // o(attended), then x + it, as torch adds
    for (size_t i = 0; i < (size_t)N * D; i++) y[i] = x[i] + y[i];
    rms_norm_rows(y, N, D, norm_post, eps_post, normed);
    q41_gemm(normed, N, D, gate_up.packed, gate_up.d, gate_up.m, gate_up.N, gate_up_out, threads);
    return 0;
}

// y [N][D] += down(activated [N][I]); work: N * D floats.
void layer_rows_down(float *y, int N, int D, const float *activated, int I, q41_matrix down, float *work,
                     int threads) {
    q41_gemm(activated, N, I, down.packed, down.d, down.m, D, work, threads);
    for (size_t i = 0; i < (size_t)N * D; i++) y[i] = y[i] + work[i];
}

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

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;
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
    uint16_t *parts = aligned_alloc(64, ((3 * plane * 2 + 63) / 64) * 64);
    float *sums = malloc(sizeof(float) * (size_t)R * (K / 32));
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

// ---- Q8_0 weights times int8 activations on AVX512-VNNI, for drafters only: x is rounded, so this is an
// approximation of x @ W^T (llama.cpp's Q8_0 x Q8_0 dot), never used for the target. Each row and group of 32 of x
// becomes int8 codes with step max |x| / 127, offset by 128 to the unsigned bytes vpdpbusd multiplies with the
// weights' signed codes (64 products a instruction, in place of 16 FMAs after a conversion); the offset's share,
// 128 times the group's code sum, is precomputed per output and group (`bias`, negated: each group's accumulator
// starts from it). Layout: codes [N/16][G][8][16][4] (16 outputs side by side, 4 consecutive k each), steps d and
// bias [N/16][G][16]. Each group's integer dot is exact; the groups are summed in fp32, d_w * d_x first. A row
// is computed alike whatever R is. N % 32 == 0, K % 32 == 0. ----
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define VRB 4

VNNI_TARGET static void quantize_rows(const float *x, int R, int K, uint8_t *xq, float *dx) {
    int G = K / 32;
    const __m512i offset = _mm512_set1_epi32(128);
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            const float *v = x + (size_t)r * K + g * 32;
            __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
            float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            float step = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
            __m512 scale = _mm512_set1_ps(inverse);
            __m512i qa = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, scale)), offset);  // nearest, even
            __m512i qb = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, scale)), offset);
            _mm_storeu_si128((__m128i *)(xq + (size_t)r * K + g * 32), _mm512_cvtepi32_epi8(qa));
            _mm_storeu_si128((__m128i *)(xq + (size_t)r * K + g * 32 + 16), _mm512_cvtepi32_epi8(qb));
            dx[(size_t)r * G + g] = step;
        }
}

// y [R][N] from rows already rounded by quantize_rows (xq, dx).
VNNI_TARGET static void int8_gemm_rounded(const uint8_t *xq, const float *dx, int R, int K, const int8_t *codes,
                                          const float *d, const int32_t *bias, int N, float *y, int threads) {
    int G = K / 32, blocks = N / 16;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int b0 = 0; b0 < blocks; b0 += 2) {  // two blocks of 16 outputs
        for (int r0 = 0; r0 < R; r0 += VRB) {
            int rb = R - r0 < VRB ? R - r0 : VRB;
            __m512 out[VRB][2];
            for (int r = 0; r < VRB; r++) out[r][0] = out[r][1] = _mm512_setzero_ps();
            for (int g = 0; g < G; g++) {
                size_t at[2] = {(size_t)b0 * G + g, (size_t)(b0 + 1) * G + g};
                __m512i acc[VRB][2];
                for (int a = 0; a < 2; a++) {
                    __m512i start = _mm512_loadu_si512(bias + 16 * at[a]);
                    for (int r = 0; r < VRB; r++) acc[r][a] = start;
                }
                for (int t = 0; t < 8; t++) {
                    __m512i w0 = _mm512_loadu_si512(codes + 512 * at[0] + 64 * t);
                    __m512i w1 = _mm512_loadu_si512(codes + 512 * at[1] + 64 * t);
                    for (int r = 0; r < VRB; r++) {
                        if (r >= rb) break;
                        int32_t four;
                        memcpy(&four, xq + (size_t)(r0 + r) * K + g * 32 + 4 * t, 4);
                        __m512i xb = _mm512_set1_epi32(four);
                        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], xb, w0);
                        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], xb, w1);
                    }
                }
                for (int a = 0; a < 2; a++) {
                    __m512 dw = _mm512_loadu_ps(d + 16 * at[a]);
                    for (int r = 0; r < VRB; r++) {
                        if (r >= rb) break;
                        __m512 both = _mm512_mul_ps(dw, _mm512_set1_ps(dx[(size_t)(r0 + r) * G + g]));
                        out[r][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][a]), both, out[r][a]);
                    }
                }
            }
            for (int r = 0; r < rb; r++)
                for (int a = 0; a < 2; a++) _mm512_storeu_ps(y + (size_t)(r0 + r) * N + (b0 + a) * 16, out[r][a]);
        }
    }
}

VNNI_TARGET int q8_int8_gemm(const float *x, int R, int K, const int8_t *codes, const float *d, const int32_t *bias,
                             int N, float *y, int threads) {
    uint8_t *xq = malloc((size_t)R * K);
    float *dx = malloc(sizeof(float) * (size_t)R * (K / 32));
    if (xq == NULL || dx == NULL) {
        free(xq);
        free(dx);
        return -1;
    }
    quantize_rows(x, R, K, xq, dx);
    int8_gemm_rounded(xq, dx, R, K, codes, d, bias, N, y, threads);
    free(xq);
    free(dx);
    return 0;
}

// ---- The EAGLE-3 drafter's decode-time rows on int8 matrices (decode.lean_eagle3), in two calls: its layer, and
// its head's log-softmax top-K. The same operations as LeanEagle3's Python in the same order, without its twenty-odd
// tensor operations a depth; SiLU here from the attention's exp (a few ulps from torch's). ----
typedef struct {  // an int8 matrix (Q8Int8Weight): codes [N/16][K/32][8][16][4], d and bias [N/16][K/32][16]
    const int8_t *codes;
    const float *d;
    const int32_t *bias;
    int N;
} int8_matrix;

static int int8_rows(const float *x, int R, int K, int8_matrix w, float *y, int threads) {
    return q8_int8_gemm(x, R, K, w.codes, w.d, w.bias, w.N, y, threads);
}

static inline __m512 silu16(__m512 x) {  // x * sigmoid(x), sigmoid from exp(-|x|) (no overflow either side)
    __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
    __m512 numerator = _mm512_mask_blend_ps(positive, e, _mm512_set1_ps(1.0f));
    return _mm512_mul_ps(x, _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

// out [N][D] = the layer over rows (rms_norm(embeds) | rms_norm(states)) at `positions` (cos and sin: tables
// [P][hd]), their keys and values appended to the cache at rows start..start+N-1 (head j's row t at keys +
// j * head_stride + t * hd), each row attending to the keys `visible` [N][start + N] marks. D, I % 16 == 0,
// hd % 32 == 0. 0, or -1 (no memory).
int eagle3_rows(const float *embeds, const float *states, int N, int D, const float *norm_embed, float eps_embed,
                const float *norm_state, float eps_state, int8_matrix qkv, int H, int Hkv, int hd,
                const float *cos_table, const float *sin_table, const int64_t *positions, float *keys, float *values,
                long head_stride, int start, const uint8_t *visible, float scale, int8_matrix o,
                const float *norm_post, float eps_post, int8_matrix gate_up, int I, int8_matrix down, float *out,
                int threads) {
    int width = (H + 2 * Hkv) * hd;
    size_t floats = (size_t)N * (2 * D + width + 2 * hd + (H + Hkv) * hd + H * hd + 2 * D + 3 * I);
    float *work = malloc(sizeof(float) * floats);
    if (work == NULL) return -1;
    float *x = work, *fused = x + (size_t)N * 2 * D, *cs = fused + (size_t)N * width, *sn = cs + (size_t)N * hd;
    float *q = sn + (size_t)N * hd, *k = q + (size_t)H * N * hd, *attended = k + (size_t)Hkv * N * hd;
    float *hidden = attended + (size_t)N * H * hd, *normed = hidden + (size_t)N * D, *gu = normed + (size_t)N * D;
    float *act = gu + (size_t)N * 2 * I;
    int failed = 0;
    for (int r = 0; r < N; r++) {
        rms_norm_rows(embeds + (size_t)r * D, 1, D, norm_embed, eps_embed, x + (size_t)r * 2 * D);
        rms_norm_rows(states + (size_t)r * D, 1, D, norm_state, eps_state, x + (size_t)r * 2 * D + D);
        memcpy(cs + (size_t)r * hd, cos_table + (size_t)positions[r] * hd, sizeof(float) * hd);
        memcpy(sn + (size_t)r * hd, sin_table + (size_t)positions[r] * hd, sizeof(float) * hd);
    }
    failed |= int8_rows(x, N, 2 * D, qkv, fused, threads);
    rope_qk(fused, N, H, Hkv, hd, cs, sn, q, k);
    append_keys_values(k, fused, N, H, Hkv, hd, keys, values, head_stride, start);
    failed |= attention_rows(q, H, Hkv, N, hd, keys, values, head_stride, start + N, visible, scale, attended,
                             threads);
    failed |= int8_rows(attended, N, H * hd, o, hidden, threads);
    for (size_t i = 0; i < (size_t)N * D; i++) hidden[i] = states[i] + hidden[i];
    rms_norm_rows(hidden, N, D, norm_post, eps_post, normed);
    failed |= int8_rows(normed, N, D, gate_up, gu, threads);
    for (int r = 0; r < N; r++)
        for (int i = 0; i < I; i += 16) {
            const float *row = gu + (size_t)r * 2 * I;
            _mm512_storeu_ps(act + (size_t)r * I + i,
                             _mm512_mul_ps(silu16(_mm512_loadu_ps(row + i)), _mm512_loadu_ps(row + I + i)));
        }
    failed |= int8_rows(act, N, I, down, out, threads);
    for (size_t i = 0; i < (size_t)N * D; i++) out[i] = hidden[i] + out[i];
    free(work);
    return failed ? -1 : 0;
}

// Each row's `topk` most probable draft tokens under the head: log-softmax of head(rms_norm(out)) over its M
// outputs; values [N][topk] descending (ties: the lower index first), indices [N][topk]. M % 32 == 0, D % 16 == 0.
// 0, or -1 (no memory).
int eagle3_top(const float *out, int N, int D, const float *norm_out, float eps_out, int8_matrix head, int topk,
               float *values, int64_t *indices, int threads) {
    int M = head.N;
    float *normed = malloc(sizeof(float) * ((size_t)N * D + (size_t)N * M));
    if (normed == NULL) return -1;
    float *logits = normed + (size_t)N * D;
    rms_norm_rows(out, N, D, norm_out, eps_out, normed);
    int failed = int8_rows(normed, N, D, head, logits, threads);
    for (int r = 0; r < N && !failed; r++) {
        const float *row = logits + (size_t)r * M;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int i = 0; i < M; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + i));
        float peak = _mm512_reduce_max_ps(top);
        __m512 shift = _mm512_set1_ps(peak), total = _mm512_setzero_ps();
        for (int i = 0; i < M; i += 16)
            total = _mm512_add_ps(total, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + i), shift)));
        float log_total = logf(_mm512_reduce_add_ps(total));
        float *best = values + (size_t)r * topk;
        int64_t *at = indices + (size_t)r * topk;
        int kept = 0;
        for (int i = 0; i < M; i++) {  // insertion into the kept few, descending; a tie keeps the earlier index
            float v = row[i];
            if (kept == topk && v <= best[kept - 1]) continue;
            int j = kept < topk ? kept++ : topk - 1;
            while (j > 0 && best[j - 1] < v) {
                best[j] = best[j - 1];
                at[j] = at[j - 1];
                j--;
            }
            best[j] = v;
            at[j] = i;
        }
        for (int j = 0; j < kept; j++) best[j] = (best[j] - peak) - log_total;  // as log_softmax: x - max - log sum
    }
    free(normed);
    return failed ? -1 : 0;
}

// ---- The greedy head: each row's most probable next token, exactly the argmax of q80_gemm's logits (the FMA form),
// without computing them all. The int8 kernel's logits a_n (x rounded to int8) are within b_n of the exact ones,
// b_n = sum_g dx_g * slack[n, g] with slack = 0.52 * d * (the group's sum of |codes|): rounding x moves each group's
// dot by at most half its step per |code| (0.5), and the fp32 sums of both computations by far less (0.02 covers
// them with room). Every output whose a_n + b_n reaches max_m (a_m - b_m) is a candidate (the argmax always is);
// the candidates' logits are computed as q80_gemm computes them (the same operations in the same order: the same
// bits), and the first of the largest wins, as torch.argmax. A few candidates a row on a real model. ----
static float exact_logit(const float *x, int K, const int8_t *codes, const float *d, int n) {
    int G = K / 32, block = n / 16, lane = n % 16;
    __m512 acc = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        int8_t q[32];
        const int8_t *group = codes + 512 * ((size_t)block * G + g);
        for (int t = 0; t < 8; t++) memcpy(q + 4 * t, group + 64 * t + 4 * lane, 4);
        __m512 step = _mm512_set1_ps(d[16 * ((size_t)block * G + g) + lane]);
        for (int half = 0; half < 2; half++) {  // as q80_gemm: weights 0..15 of the group, then 16..31
            __m128i codes16 = _mm_loadu_si128((const __m128i *)(q + 16 * half));
            __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes16)), step);
            acc = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + g * 32 + half * 16), acc);
        }
    }
    return _mm512_reduce_add_ps(acc);
}

// tokens [R]: each row's argmax (-1 for a row with a NaN: no output qualifies, or a candidate's logit is NaN);
// candidates [R]: how many outputs were computed exactly. 0, or -1 (no memory).
int q8_argmax(const float *x, int R, int K, const int8_t *codes, const float *d, const int32_t *bias,
              const float *slack, int N, int64_t *tokens, int32_t *candidates, int threads) {
    int G = K / 32, blocks = N / 16;
    float *approx = malloc(sizeof(float) * (size_t)R * N * 2), *dx = malloc(sizeof(float) * (size_t)R * G);
    uint8_t *xq = malloc((size_t)R * K);
    if (approx == NULL || dx == NULL || xq == NULL) {
        free(approx);
        free(dx);
        free(xq);
        return -1;
    }
    float *bound = approx + (size_t)R * N;
    quantize_rows(x, R, K, xq, dx);  // x rounded once: the int8 pass and the bound read the same steps
    int8_gemm_rounded(xq, dx, R, K, codes, d, bias, N, approx, threads);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int b = 0; b < blocks; b++)
        for (int r = 0; r < R; r++) {
            __m512 acc = _mm512_setzero_ps();
            for (int g = 0; g < G; g++)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(slack + 16 * ((size_t)b * G + g)),
                                      _mm512_set1_ps(dx[(size_t)r * G + g]), acc);
            _mm512_storeu_ps(bound + (size_t)r * N + 16 * b, acc);
        }
    for (int r = 0; r < R; r++) {
        const float *a = approx + (size_t)r * N, *e = bound + (size_t)r * N;
        __m512 floor = _mm512_set1_ps(-INFINITY);
        for (int n = 0; n < N; n += 16)
            floor = _mm512_max_ps(floor, _mm512_sub_ps(_mm512_loadu_ps(a + n), _mm512_loadu_ps(e + n)));
        __m512 threshold = _mm512_set1_ps(_mm512_reduce_max_ps(floor));
        float best = -INFINITY;
        int64_t at = -1;
        int32_t count = 0, unordered = 0;
        for (int n0 = 0; n0 < N && !unordered; n0 += 16) {
            __mmask16 reach = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(a + n0), _mm512_loadu_ps(e + n0)),
                                                 threshold, _CMP_GE_OQ);
            while (reach) {
                int n = n0 + __builtin_ctz(reach);
                reach &= reach - 1;
                float v = exact_logit(x + (size_t)r * K, K, codes, d, n);
                count++;
                unordered |= v != v;  // a NaN logit: torch's argmax rules, not this (-1)
                if (v > best || at < 0) {  // increasing n: a tie keeps the first
                    best = v;
                    at = n;
                }
            }
        }
        tokens[r] = unordered ? -1 : at;
        candidates[r] = count;
    }
    free(approx);
    free(dx);
    free(xq);
    return 0;
}
"""

# -ffp-contract=off: the weights are rebuilt as q * d, rounded, + m, rounded, as they were dequantized; a fused
# multiply-add would round once and give weights one ulp off the model's.
GCC_FLAGS = ("-O3", "-mavx512f", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


class Q41Weight:
    """One [N, K] matrix as Q4_1 in one of the kernel's forms: packed uint8 codes two a byte, step d and minimum
    m. "fma" (AVX-512): packed [N, K/2], d and m [N, K/32] fp32. "amx" (AMX-BF16 tiles): packed [N/16, K/32, 8,
    32] in the tile unit's pair order, d and m [N/16, K/32, 16] fp16 (see KERNEL_SOURCE)."""

    def __init__(self, packed: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor, form: str = "fma"):
        self.packed, self.step, self.minimum, self.form = packed, step, minimum, form

    @property
    def shape(self) -> tuple[int, int]:
        if self.form == "amx":
            return self.packed.shape[0] * 16, self.packed.shape[1] * GROUP
        return self.packed.shape[0], self.packed.shape[1] * 2


def grid_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes [N, K/32, 32] in 0..15 as float, step [N, K/32], min [N, K/32]): each group's 4-bit grid
    from its min and max, the one Q4_1 quantizes on."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15)
    return codes, step, low


def grid_deviation(weight: torch.Tensor) -> float:
    """max |w - its 4-bit grid value| / max |w|: 0 when the matrix is exactly Q4_1."""
    codes, step, low = grid_codes(weight)
    rebuilt = (codes * step[..., None] + low[..., None]).reshape(weight.shape)
    return float((rebuilt - weight).abs().max() / weight.abs().max().clamp(min=1e-30))


OUTPUT_BLOCK = 2  # the FMA form's NB: outputs computed together
AMX_OUTPUT_BLOCK = 32  # the AMX form's: two tiles of 16 outputs


def shape_supported(weight: torch.Tensor) -> bool:
    """[N, K] with K whole groups and N whole output blocks of the kernel's FMA form (every form's minimum)."""
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0 and weight.shape[0] % OUTPUT_BLOCK == 0


def scales_are_fp16(codes: torch.Tensor, step: torch.Tensor, low: torch.Tensor | None = None) -> bool:
    """Whether the weights come out the same with the steps (and minima) rounded to fp16, as the AMX form stores
    them: a GGUF stores them as fp16, so every matrix of the default target does (codes [N, G, 32], step and low
    [N, G])."""
    def rebuilt(d, m):
        return codes * d[..., None] + (0 if m is None else m[..., None])
    half = (lambda t: None if t is None else t.half().float())  # noqa: E731
    return torch.equal(rebuilt(half(step), half(low)), rebuilt(step, low))


def _check_shape(caller: str, weight: torch.Tensor, form: str) -> None:
    block = AMX_OUTPUT_BLOCK if form == "amx" else OUTPUT_BLOCK
    if not shape_supported(weight) or weight.shape[0] % block:
        raise ValueError(f"{caller}: K must be a multiple of {GROUP} and N of {block} ({form} form), "
                         f"got {list(weight.shape)}")


def _choose_form(caller: str, weight: torch.Tensor, form: str | None, fp16_scales: Callable[[], bool]) -> str:
    """form, or where None: "amx" where this process may use the AMX form (`amx_unavailable`), N is whole blocks
    of 32 outputs and the scales are fp16 values, else "fma". An error names what keeps an asked form out."""
    if form is None:
        usable = weight.shape[0] % AMX_OUTPUT_BLOCK == 0 and amx_unavailable() is None
        form = "amx" if usable and fp16_scales() else "fma"
    if form not in ("fma", "amx"):
        raise ValueError(f"{caller}: form must be 'fma' or 'amx', got {form!r}")
    if form == "amx" and (why := amx_unavailable()) is not None:  # also asks Linux for the tiles, once
        raise RuntimeError(f"{caller}: the AMX form cannot run here: {why}")
    _check_shape(caller, weight, form)
    if form == "amx" and not fp16_scales():
        raise ValueError(f"{caller}: the AMX form stores steps and minima as fp16, and this matrix's are not fp16 "
                         f"values")
    return form


def _by_block(per_group: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [N/16, G, 16]: a group's steps (or minima) for a block of 16 outputs side by side."""
    n, groups = per_group.shape
    return per_group.reshape(n // 16, 16, groups).permute(0, 2, 1).contiguous()


def _from_blocks(blocked: torch.Tensor) -> torch.Tensor:
    """_by_block's inverse: [N/16, G, 16] -> [N, G]."""
    return blocked.permute(0, 2, 1).reshape(-1, blocked.shape[1])


def pack_q41(weight: torch.Tensor, form: str | None = None) -> Q41Weight:
    """[N, K] fp32 -> Q41Weight in `form` (default: AMX where it may run, see `_choose_form`). FMA form: byte j of
    group g holds code j (low nibble) and code j + 16 (high nibble); AMX form: the tile unit's order, fp16 steps
    and minima (KERNEL_SOURCE)."""
    _check_shape("pack_q41", weight, "fma")  # every form's minimum, before the grid is read
    n, k = weight.shape
    codes, step, low = grid_codes(weight.detach().float())
    form = _choose_form("pack_q41", weight, form, lambda: scales_are_fp16(codes, step, low))
    codes = codes.to(torch.uint8)  # [N, G, 32]
    if form == "fma":
        packed = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, k // 2).contiguous()
        return Q41Weight(packed, step.contiguous(), low.contiguous())
    groups = k // GROUP
    pairs = codes.reshape(n // 16, 16, groups, 8, 2, 2)  # [block, n, g, p, row 2p or 2p + 1, pair element]
    pairs = pairs.permute(0, 2, 3, 4, 1, 5).reshape(n // 16, groups, 8, 2, 32)  # [block, g, p, row parity, 32]
    packed = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).contiguous()  # [N/16, G, 8, 32]
    return Q41Weight(packed, _by_block(step).half(), _by_block(low).half(), form="amx")


def unpack_q41(w: Q41Weight) -> torch.Tensor:
    """Q41Weight -> the [N, K] fp32 matrix it stands for (the packing's inverse, for checks)."""
    n, k = w.shape
    if w.form == "amx":
        rows = torch.stack([w.packed & 15, w.packed >> 4], dim=3)  # [N/16, G, 8, 2, 32]
        codes = rows.reshape(n // 16, k // GROUP, 8, 2, 16, 2).permute(0, 4, 1, 2, 3, 5)  # [blk, n, g, p, par, 2]
        codes = codes.reshape(n, k // GROUP, GROUP).float()
        step, minimum = _from_blocks(w.step).float(), _from_blocks(w.minimum).float()
    else:
        bytes_ = w.packed.reshape(n, k // GROUP, 16)
        codes = torch.cat([bytes_ & 15, bytes_ >> 4], dim=-1).float()  # [N, G, 32]
        step, minimum = w.step, w.minimum
    return (codes * step[..., None] + minimum[..., None]).reshape(n, k)


class Q80Weight:
    """One [N, K] matrix as Q8_0 (w = q * d) in one of the kernel's forms. "fma": int8 codes [N, K], step d
    [N, K/32] fp32. "amx": codes [N/16, K/32, 16, 32] in the tile unit's pair order, d [N/16, K/32, 16] fp16."""

    def __init__(self, codes: torch.Tensor, step: torch.Tensor, form: str = "fma"):
        self.codes, self.step, self.form = codes, step, form

    @property
    def shape(self) -> tuple[int, int]:
        if self.form == "amx":
            return self.codes.shape[0] * 16, self.codes.shape[1] * GROUP
        return tuple(self.codes.shape)


def q80_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes [N, K/32, 32] in -127..127 as float, step [N, K/32]): each group's grid as Q8_0 writes it,
    d = max |w| / 127 (a group of zeros: d = 0)."""
    n, k = weight.shape
    groups = weight.reshape(n, k // GROUP, GROUP)
    step = groups.abs().amax(-1) / 127
    codes = torch.round(groups / step.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).clamp(-127, 127)
    return codes, step


def q80_deviation(weight: torch.Tensor) -> float:
    """max |w - its 8-bit grid value| / max |w|: 0 when the matrix is exactly Q8_0."""
    codes, step = q80_codes(weight)
    rebuilt = (codes * step[..., None]).reshape(weight.shape)
    return float((rebuilt - weight).abs().max() / weight.abs().max().clamp(min=1e-30))


def pack_q80(weight: torch.Tensor, form: str | None = None) -> Q80Weight:
    """[N, K] fp32 -> Q80Weight (int8 codes, one step per group of 32) in `form` (default: AMX where it may run,
    see `_choose_form`; its steps fp16)."""
    _check_shape("pack_q80", weight, "fma")
    codes, step = q80_codes(weight.detach().float())
    form = _choose_form("pack_q80", weight, form, lambda: scales_are_fp16(codes, step))
    codes = codes.to(torch.int8)  # [N, G, 32]
    if form == "fma":
        return Q80Weight(codes.reshape(weight.shape).contiguous(), step.contiguous())
    n, groups = weight.shape[0], weight.shape[1] // GROUP
    pairs = codes.reshape(n // 16, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)  # [block, g, row kk, n, pair element]
    return Q80Weight(pairs.reshape(n // 16, groups, 16, 32).contiguous(), _by_block(step).half(), form="amx")


def unpack_q80(w: Q80Weight) -> torch.Tensor:
    """Q80Weight -> the [N, K] fp32 matrix it stands for."""
    n, k = w.shape
    if w.form == "amx":
        codes = w.codes.reshape(n // 16, k // GROUP, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(n, k // GROUP, GROUP)
        step = _from_blocks(w.step).float()
    else:
        codes, step = w.codes.reshape(n, k // GROUP, GROUP), w.step
    return (codes.float() * step[..., None]).reshape(n, k)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), read once; empty where there is no such file."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def avx512_available() -> bool:
    return "avx512f" in cpu_flags()


class Q41Matrix(ctypes.Structure):
    """The library's q41_matrix: an FMA-form Q41Weight's pointers (the weight must outlive every call)."""
    _fields_ = [("packed", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p), ("N", ctypes.c_int)]

    @classmethod
    def of(cls, w: "Q41Weight") -> "Q41Matrix":
        if w.form != "fma":
            raise ValueError(f"Q41Matrix: the {w.form} form has no q41_matrix")
        return cls(w.packed.data_ptr(), w.step.data_ptr(), w.minimum.data_ptr(), w.shape[0])


class Int8Matrix(ctypes.Structure):
    """The library's int8_matrix: a Q8Int8Weight's pointers (the weight must outlive every call)."""
    _fields_ = [("codes", ctypes.c_void_p), ("d", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("N", ctypes.c_int)]

    @classmethod
    def of(cls, w: "Q8Int8Weight") -> "Int8Matrix":
        return cls(w.codes.data_ptr(), w.step.data_ptr(), w.bias.data_ptr(), w.shape[0])


def build_kernel(directory: Path) -> ctypes.CDLL:
    """Compile KERNEL_SOURCE with gcc into directory/libq41.so (atomically: a half-written library is never
    loaded) and load it. RuntimeError naming what is missing or what gcc said."""
    if shutil.which("gcc") is None:
        raise RuntimeError("the Q4_1 kernel needs gcc on PATH")
    if not avx512_available():
        raise RuntimeError("the Q4_1 kernel is AVX-512 and this CPU has no avx512f")
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / "libq41.so"
    if not library.exists():
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            source, built = Path(tmp) / "q41.c", Path(tmp) / "libq41.so"
            source.write_text(KERNEL_SOURCE)
            done = subprocess.run(["gcc", *GCC_FLAGS, str(source), "-o", str(built)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"gcc could not build the Q4_1 kernel: {done.stderr.strip()[-500:]}")
            os.replace(built, library)
    lib = ctypes.CDLL(str(library))
    pointer = ctypes.c_void_p
    lib.q41_gemm.argtypes = [pointer, ctypes.c_int, ctypes.c_int, pointer, pointer, pointer, ctypes.c_int, pointer,
                             ctypes.c_int]
    lib.q41_gemm.restype = None
    lib.q80_gemm.argtypes = [pointer, ctypes.c_int, ctypes.c_int, pointer, pointer, ctypes.c_int, pointer, ctypes.c_int]
    lib.q80_gemm.restype = None
    lib.q41_amx.argtypes, lib.q41_amx.restype = lib.q41_gemm.argtypes, ctypes.c_int
    lib.q80_amx.argtypes, lib.q80_amx.restype = lib.q80_gemm.argtypes, ctypes.c_int
    lib.amx_request.argtypes, lib.amx_request.restype = [], ctypes.c_int
    lib.rms_norm_rows.argtypes = [pointer, ctypes.c_int, ctypes.c_int, pointer, ctypes.c_float, pointer]
    lib.rope_qk.argtypes = [pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, pointer, pointer, pointer,
                            pointer]
    lib.rms_norm_rows.restype = lib.rope_qk.restype = None
    lib.attention_rows.argtypes = [pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, pointer, pointer,
                                   ctypes.c_long, ctypes.c_int, pointer, ctypes.c_float, pointer, ctypes.c_int]
    lib.attention_rows.restype = ctypes.c_int
    matrix, i, f = Q41Matrix, ctypes.c_int, ctypes.c_float
    lib.layer_rows_attention.argtypes = [pointer, i, i, pointer, f, matrix, i, i, i, pointer, pointer, pointer, pointer,
                                         ctypes.c_long, i, i, pointer, f, matrix, pointer, f, matrix, pointer, pointer,
                                         pointer, i]
    lib.layer_rows_attention.restype = ctypes.c_int
    lib.layer_rows_down.argtypes = [pointer, i, i, pointer, i, matrix, pointer, i]
    lib.layer_rows_down.restype = None
    lib.q8_int8_gemm.argtypes = [pointer, i, i, pointer, pointer, pointer, i, pointer, i]
    lib.q8_int8_gemm.restype = ctypes.c_int
    m8 = Int8Matrix
    lib.eagle3_rows.argtypes = [pointer, pointer, i, i, pointer, f, pointer, f, m8, i, i, i, pointer, pointer, pointer,
                                pointer, pointer, ctypes.c_long, i, pointer, f, m8, pointer, f, m8, i, m8, pointer, i]
    lib.eagle3_top.argtypes = [pointer, i, i, pointer, f, m8, i, pointer, pointer, i]
    lib.eagle3_rows.restype = lib.eagle3_top.restype = ctypes.c_int
    lib.q8_argmax.argtypes = [pointer, i, i, pointer, pointer, pointer, pointer, i, pointer, pointer, i]
    lib.q8_argmax.restype = ctypes.c_int
    return lib


def kernel_directory() -> Path:
    """Content-addressed by the source and the flags: an edited kernel is built anew, never loaded stale."""
    digest = hashlib.sha256((KERNEL_SOURCE + " ".join(GCC_FLAGS)).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"q41-{digest}"


@functools.lru_cache(maxsize=1)
def _kernel() -> tuple[ctypes.CDLL | None, str | None]:
    try:
        return build_kernel(kernel_directory()), None
    except (RuntimeError, OSError) as error:
        return None, str(error)


def kernel_library() -> ctypes.CDLL | None:
    """The library (GEMM forms, RMSNorm, RoPE) where the engine may use it, else None (see kernel_unavailable)."""
    return _kernel()[0] if kernel_unavailable() is None else None


def kernel_unavailable() -> str | None:
    """None when the engine may use the kernel, else why not."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return f"${DISABLE_ENV} is set"
    return _kernel()[1]


AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw")


@functools.lru_cache(maxsize=1)
def _amx_granted() -> str | None:
    """Asks Linux once for this process's tile state; None when granted, else why not."""
    missing = [f for f in AMX_FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU has no {', '.join(missing)}"
    if _kernel()[0].amx_request() != 0:
        return "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return None


def amx_unavailable() -> str | None:
    """None when the kernel's AMX form may run in this process, else why not ($SPECDISTILL_NO_AMX switches it off
    for comparisons; the FMA form then computes every matrix)."""
    return kernel_unavailable() or (f"${NO_AMX_ENV} is set" if os.environ.get(NO_AMX_ENV, "") not in ("", "0")
                                    else _amx_granted())


def q41_linear(lib: ctypes.CDLL, x: torch.Tensor, w: Q41Weight) -> torch.Tensor:
    """x [R, K] fp32 (1 <= R <= MAX_ROWS) -> [R, N], as F.linear(x, unpack_q41(w)) up to the summation order."""
    n, k = w.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"q41_linear: x must be fp32 [1..{MAX_ROWS}, {k}], got {x.dtype} {list(x.shape)}")
    return q41_gemm(lib, x.contiguous(), w)


def q41_gemm(lib: ctypes.CDLL, x: torch.Tensor, w: Q41Weight) -> torch.Tensor:
    """q41_linear without its checks, for callers that have made them: x contiguous fp32 [1..MAX_ROWS, K]."""
    n, k = w.shape
    y = torch.empty(x.shape[0], n)
    if w.form == "amx":
        if lib.q41_amx(x.data_ptr(), x.shape[0], k, w.packed.data_ptr(), w.step.data_ptr(), w.minimum.data_ptr(), n,
                       y.data_ptr(), torch.get_num_threads()) != 0:
            raise MemoryError(f"q41_amx: no memory for the bf16 parts of x {list(x.shape)}")
        return y
    lib.q41_gemm(x.data_ptr(), x.shape[0], k, w.packed.data_ptr(), w.step.data_ptr(), w.minimum.data_ptr(), n,
                 y.data_ptr(), torch.get_num_threads())
    return y


def rms_norm_rows(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (D,), weight, eps) for contiguous fp32 x [..., D] (D % 16 == 0), in one call; the sum of
    squares in another order than torch's (a few ulps)."""
    y = torch.empty_like(x)
    lib.rms_norm_rows(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps, y.data_ptr())
    return y


def rope_qk(lib: ctypes.CDLL, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv fp32 [..., N, (heads + 2 kv_heads) head_dim], cos and sin [..., N, head_dim] (head_dim % 32 == 0;
    leading dimensions of 1) -> the rotated q [heads, N, head_dim] and k [kv_heads, N,
    head_dim], as transformers computes them."""
    n = qkv.numel() // ((heads + 2 * kv_heads) * head_dim)
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()  # no copies where they are (the engine's)
    q, k = torch.empty(heads, n, head_dim), torch.empty(kv_heads, n, head_dim)
    lib.rope_qk(qkv.data_ptr(), n, heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                k.data_ptr())
    return q, k


def attention_rows(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention of a few rows over a cache, in one call: q fp32 [H, N, hd] (contiguous; hd % 16 == 0,
    at most 256), keys and values fp32 [Hkv, T, hd] with rows of hd contiguous floats (views of a longer buffer are
    read in place), visible bool [N, T] (True: row n attends to key t; every row sees one at least) -> [N, H * hd],
    each (head, row) as softmax(q k^T * scale) v over what it sees, alike whatever N is (see KERNEL_SOURCE)."""
    heads, n, hd = q.shape
    kv_heads, t = keys.shape[0], keys.shape[1]
    if (q.dtype != torch.float32 or not q.is_contiguous() or hd % 16 or hd > 256 or heads % kv_heads
            or keys.shape != values.shape or keys.shape[2] != hd or keys.stride()[1:] != (hd, 1)
            or values.stride() != keys.stride() or keys.dtype != torch.float32 or values.dtype != torch.float32
            or visible.shape != (n, t) or visible.dtype != torch.bool):
        raise ValueError(f"attention_rows: q {q.dtype} {list(q.shape)}, keys {keys.dtype} {list(keys.shape)} strides "
                         f"{keys.stride()}, values {list(values.shape)} strides {values.stride()}, visible "
                         f"{visible.dtype} {list(visible.shape)}: not shapes this kernel reads")
    return attend(lib, q, keys, values, visible, scale)


def attend(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
           scale: float) -> torch.Tensor:
    """attention_rows without its checks, for callers whose tensors are of its kind by construction (the lean
    forwards)."""
    heads, n, hd = q.shape
    visible = visible.contiguous()
    out = torch.empty(n, heads * hd)
    if lib.attention_rows(q.data_ptr(), heads, keys.shape[0], n, hd, keys.data_ptr(), values.data_ptr(),
                          keys.stride(0), keys.shape[1], visible.data_ptr(), scale, out.data_ptr(),
                          torch.get_num_threads()) != 0:
        raise MemoryError(f"attention_rows: no memory for the scores of {keys.shape[1]} keys")
    return out


class KernelLinear(torch.nn.Module):
    """y = x W^T for a bias-free fp32 W exactly on a grid a kernel of this library reads: up to MAX_ROWS rows
    through the kernel (`gemm` over `pack`'s form), more (prefill) through oneDNN's packed GEMM of the same weights.
    Inference only. Subclasses name the form."""

    pack: Callable[[torch.Tensor], object]  # [N, K] fp32 -> the kernel's form
    gemm: Callable[[ctypes.CDLL, torch.Tensor, object], torch.Tensor]  # (lib, x [R, K], form) -> [R, N]

    def __init__(self, linear: torch.nn.Linear, lib: ctypes.CDLL):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.lib = lib
        self.codes = self.pack(linear.weight.detach())
        self.prefill = PackedLinear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{type(self).__name__} is for inference; train the original module")
        rows = x.numel() // self.in_features
        if not 1 <= rows <= MAX_ROWS or x.dtype != torch.float32:
            return self.prefill(x)
        y = self.gemm(self.lib, x.reshape(rows, self.in_features).contiguous(), self.codes)  # the checks are above
        return y.view(*x.shape[:-1], self.out_features)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward for the lean forwards' hot path, without nn.Module's dispatch and forward's checks: x fp32
        [1, N, in], no gradient wanted -> [1, N, out]."""
        n = x.shape[1]
        if n > MAX_ROWS:
            return self.prefill(x)
        return self.gemm(self.lib, x.reshape(n, self.in_features).contiguous(), self.codes).view(1, n, -1)


class Q41Linear(KernelLinear):
    """A KernelLinear over Q4_1 (the default target's layer matrices)."""

    pack = staticmethod(pack_q41)
    gemm = staticmethod(q41_gemm)


def q80_gemm(lib: ctypes.CDLL, x: torch.Tensor, w: Q80Weight) -> torch.Tensor:
    """x contiguous fp32 [1..MAX_ROWS, K] -> [R, N] over a Q80Weight (the caller has checked x)."""
    n, k = w.shape
    y = torch.empty(x.shape[0], n)
    if w.form == "amx":
        if lib.q80_amx(x.data_ptr(), x.shape[0], k, w.codes.data_ptr(), w.step.data_ptr(), n, y.data_ptr(),
                       torch.get_num_threads()) != 0:
            raise MemoryError(f"q80_amx: no memory for the bf16 parts of x {list(x.shape)}")
        return y
    lib.q80_gemm(x.data_ptr(), x.shape[0], k, w.codes.data_ptr(), w.step.data_ptr(), n, y.data_ptr(),
                 torch.get_num_threads())
    return y


class Q80Linear(KernelLinear):
    """A KernelLinear over Q8_0 (the default target's tied head)."""

    pack = staticmethod(pack_q80)
    gemm = staticmethod(q80_gemm)


def q80_usable(linear: torch.nn.Module) -> bool:
    """A bias-free fp32 CPU nn.Linear of a shape the kernel takes, exactly on its Q8_0 grid up to float rounding."""
    w = getattr(linear, "weight", None)
    return (isinstance(linear, torch.nn.Linear) and linear.bias is None and w.dtype == torch.float32
            and w.device.type == "cpu" and shape_supported(w) and q80_deviation(w.detach()) <= GRID_TOLERANCE)


def head_for_inference(head: torch.nn.Module) -> torch.nn.Module:
    """The target's output head for the engine: on the Q8_0 kernel where it is exactly Q8_0 (the default
    target's tied embedding) and the kernel runs, else models.packed_linear's packed copy. Logged once per head;
    the grid check (a pass over every weight) and the copy are cached until the weights change."""
    usable = cached_copy(_head_checks, head, weights_signature(head), lambda: q80_usable(head))
    if kernel_unavailable() is not None or not usable:
        return packed_for_inference(head)

    def build():
        fast = Q80Linear(head, _kernel()[0])
        log.info("fp32 head: the Q8_0 kernel (%d x %d, its %s form)", head.out_features, head.in_features,
                 fast.codes.form)
        return fast
    return cached_copy(_copies, head, ("q80", amx_unavailable(), weights_signature(head)), build)


def q80_rounded(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> the nearest Q8_0 matrix whose steps are fp16 values (the AMX form's), each group's step
    rounded up to an fp16 value so its largest weight's code is exactly 127 (`pack_q80` then reads the same step
    back). For drafters: their weights are not on any grid, and drafting in Q8_0 changes only which tokens are
    proposed, never the output (the target verifies)."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // GROUP, GROUP)
    largest = groups.abs().amax(-1)  # [N, G]
    step = (largest / 127).half()
    step = torch.where(step.float() * 127 < largest, torch.nextafter(step, torch.full_like(step, float("inf"))), step)
    step = step.float()[..., None]
    codes = torch.where(step > 0, torch.round(groups / step.clamp(min=torch.finfo(torch.float32).tiny)), 0.0)
    return (codes.clamp(-127, 127) * step).reshape(n, k)


def q80_inference_copy(linear: torch.nn.Linear) -> torch.nn.Module:
    """A bias-free fp32 CPU nn.Linear's weights rounded to Q8_0 (`q80_rounded`), on the Q8_0 kernel (its AMX form
    where it runs); prefill-sized calls through oneDNN over the same rounded weights. The linear is untouched.
    ValueError naming what is missing where the kernel or the shape does not allow it."""
    if (why := kernel_unavailable()) is not None:
        raise ValueError(f"Q8_0 drafting weights need the kernel library: {why}")
    if linear.bias is not None or not shape_supported(linear.weight):
        raise ValueError(f"Q8_0 drafting weights: a bias-free matrix with K a multiple of {GROUP} and N of "
                         f"{OUTPUT_BLOCK}, got {list(linear.weight.shape)} (bias: {linear.bias is not None})")
    return Q80Linear(q80_rounded_linear(linear), _kernel()[0])


def q80_rounded_linear(linear: torch.nn.Linear) -> torch.nn.Linear:
    """A frozen bias-free copy of `linear` with its weights rounded to Q8_0 (`q80_rounded`); the linear is
    untouched."""
    rounded = torch.nn.Linear(linear.in_features, linear.out_features, bias=False)
    with torch.no_grad():
        rounded.weight.copy_(q80_rounded(linear.weight))
    return rounded.requires_grad_(False)


class Q8Int8Weight:
    """One [N, K] matrix as Q8_0 (w = q * d) laid out for the int8 dot products of `q8_int8_gemm`: codes
    [N/16, K/32, 8, 16, 4] int8 (16 outputs side by side, four consecutive k each), steps d [N/16, K/32, 16] fp32,
    bias [N/16, K/32, 16] int32 = -128 * each group's code sum (the unsigned offset of x's codes, taken back)."""

    def __init__(self, codes: torch.Tensor, step: torch.Tensor, bias: torch.Tensor):
        self.codes, self.step, self.bias = codes, step, bias

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0] * 16, self.codes.shape[1] * GROUP


INT8_OUTPUT_BLOCK = 32  # q8_int8_gemm computes two blocks of 16 outputs together


def pack_q8_int8(weight: torch.Tensor) -> Q8Int8Weight:
    """[N, K] fp32 (N % 32 == 0, K % 32 == 0) -> its Q8_0 grid (`q80_codes`) in the int8 kernel's layout."""
    _check_int8_shape("pack_q8_int8", weight)
    return int8_layout(*q80_codes(weight.detach().float()))


def _check_int8_shape(caller: str, weight: torch.Tensor) -> None:
    n, k = weight.shape
    if k % GROUP or n % INT8_OUTPUT_BLOCK:
        raise ValueError(f"{caller}: K must be a multiple of {GROUP} and N of {INT8_OUTPUT_BLOCK}, "
                         f"got {list(weight.shape)}")


def int8_layout(codes: torch.Tensor, step: torch.Tensor) -> Q8Int8Weight:
    """A Q8_0 grid (codes [N, G, 32] as float, step [N, G]: `q80_codes`) in the int8 kernel's layout."""
    n, groups = step.shape
    codes = codes.to(torch.int8).reshape(n // 16, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    bias = (-128 * codes.to(torch.int32).sum(dim=(2, 4))).to(torch.int32).contiguous()  # [N/16, G, 16]
    return Q8Int8Weight(codes, _by_block(step), bias)


def unpack_q8_int8(w: Q8Int8Weight) -> torch.Tensor:
    """Q8Int8Weight -> the [N, K] fp32 matrix it stands for."""
    n, k = w.shape
    codes = w.codes.permute(0, 3, 1, 2, 4).reshape(n, k // GROUP, GROUP).float()
    return (codes * _from_blocks(w.step)[..., None]).reshape(n, k)


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x fp32 [R, K] -> (codes [R, K/32, 32] in -127..127 as float, step [R, K/32]): the rounding of x that
    `q8_int8_gemm` makes (step max |x| / 127 per group; x times 127 / max, rounded to nearest even)."""
    r, k = x.shape
    groups = x.reshape(r, k // GROUP, GROUP)
    top = groups.abs().amax(-1)
    inverse = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    return torch.round(groups * inverse[..., None]), top / 127.0


def vnni_unavailable() -> str | None:
    """None when the int8 kernel (`q8_int8_gemm`) may run here, else why not."""
    missing = [f for f in ("avx512bw", "avx512_vnni") if f not in cpu_flags()]
    return kernel_unavailable() or (f"this CPU has no {', '.join(missing)}" if missing else None)


def q8_int8_gemm(lib: ctypes.CDLL, x: torch.Tensor, w: Q8Int8Weight) -> torch.Tensor:
    """x contiguous fp32 [1..MAX_ROWS, K] -> [R, N], about x @ unpack_q8_int8(w)^T: x rounded to int8 per row and
    group of 32 (`int8_rows`), each group's dot exact in int32, the groups summed in fp32. Drafters only."""
    n, k = w.shape
    y = torch.empty(x.shape[0], n)
    if lib.q8_int8_gemm(x.data_ptr(), x.shape[0], k, w.codes.data_ptr(), w.step.data_ptr(), w.bias.data_ptr(), n,
                        y.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError(f"q8_int8_gemm: no memory for the int8 codes of x {list(x.shape)}")
    return y


class Q8Int8Linear(KernelLinear):
    """A KernelLinear over Q8_0 weights with int8 activations (`q8_int8_gemm`): for drafters, whose numbers decide
    only which tokens are proposed."""

    pack = staticmethod(pack_q8_int8)
    gemm = staticmethod(q8_int8_gemm)


GREEDY_SLACK = 0.52  # q8_argmax's bound per unit of dx * d * sum |codes|: 0.5 for x's rounding, 0.02 for fp32 sums
FULL_HEAD_ENV = "SPECDISTILL_FULL_HEAD"  # greedy steps compute every logit (comparisons, escape hatch)


class GreedyHead:
    """The target's next tokens under greedy decoding from its Q8_0 head (the default target's tied embedding, on
    the FMA form), exactly torch.argmax of `q80_gemm`'s logits, at the int8 kernel's cost: an int8 pass over every
    output with a bound on its distance from the exact logit, then the exact logits (the same operations in the same
    order as q80_gemm) of the few outputs the bound cannot rule out (`q8_argmax` in KERNEL_SOURCE). On a 2-core Zen 4
    the head's 49152 x 576 over one row costs 1.5 ms instead of 2.7, over four 1.6 instead of 3.3 (BENCHMARKS.md,
    "The greedy head")."""

    def __init__(self, weight: torch.Tensor, lib: ctypes.CDLL):
        self.lib = lib
        _check_int8_shape("GreedyHead", weight)
        codes, step = q80_codes(weight.detach().float())  # [N, G, 32], [N, G]: the FMA form's own grid
        self.codes = int8_layout(codes, step)
        slack = (GREEDY_SLACK * step.double() * codes.abs().sum(-1).double()).float()
        slack = torch.nextafter(slack, torch.full_like(slack, float("inf")))  # rounded up: never below the bound
        self.slack = _by_block(slack)  # [N/16, G, 16]

    def tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x fp32 [R, K] (1 <= R <= MAX_ROWS) -> (each row's argmax [R] int64, -1 for a row with no candidate (NaN);
        how many outputs each row computed exactly [R])."""
        n, k = self.codes.shape
        x = x.contiguous()
        tokens, candidates = torch.empty(x.shape[0], dtype=torch.int64), torch.empty(x.shape[0], dtype=torch.int32)
        if self.lib.q8_argmax(x.data_ptr(), x.shape[0], k, self.codes.codes.data_ptr(), self.codes.step.data_ptr(),
                              self.codes.bias.data_ptr(), self.slack.data_ptr(), n, tokens.data_ptr(),
                              candidates.data_ptr(), torch.get_num_threads()) != 0:
            raise MemoryError(f"q8_argmax: no memory for {x.shape[0]} rows of {n} logits")
        return tokens, candidates


def greedy_head_for(head: torch.nn.Module) -> GreedyHead | None:
    """The greedy head of a target whose inference head (`head_for_inference`) is the Q8_0 kernel's FMA form, where
    the int8 kernel runs (AVX512-VNNI) and N is whole blocks of 32; else None (greedy steps take the argmax of the
    full logits). $SPECDISTILL_FULL_HEAD keeps the full logits. Cached until the weights change."""
    if os.environ.get(FULL_HEAD_ENV, "") not in ("", "0") or vnni_unavailable() is not None:
        return None
    fast = head_for_inference(head)
    if not isinstance(fast, Q80Linear) or fast.codes.form != "fma" or not int8_shapes_supported(head):
        return None
    return cached_copy(_copies, fast, ("greedy", weights_signature(head)),
                       lambda: GreedyHead(head.weight, _kernel()[0]))


def int8_shapes_supported(linear: torch.nn.Module) -> bool:
    """A linear of a shape `q8_int8_gemm` takes: K whole groups of 32, N whole pairs of 16-output blocks."""
    w = getattr(linear, "weight", None)
    return w is not None and w.dim() == 2 and w.shape[1] % GROUP == 0 and w.shape[0] % INT8_OUTPUT_BLOCK == 0


def int8_inference_copy(linear: torch.nn.Linear) -> torch.nn.Module:
    """As `q80_inference_copy`, on the int8 kernel (`Q8Int8Linear`): the weights rounded to Q8_0, decode-time rows
    rounded to int8 per group of 32. ValueError naming what is missing where the CPU or the shape does not allow
    it."""
    if (why := vnni_unavailable()) is not None:
        raise ValueError(f"int8 drafting weights need the kernel library on AVX512-VNNI: {why}")
    if linear.bias is not None or not int8_shapes_supported(linear):
        raise ValueError(f"int8 drafting weights: a bias-free matrix with K a multiple of {GROUP} and N of "
                         f"{INT8_OUTPUT_BLOCK}, got {list(linear.weight.shape)} (bias: {linear.bias is not None})")
    return Q8Int8Linear(q80_rounded_linear(linear), _kernel()[0])


def q41_usable(linear: torch.nn.Linear) -> bool:
    """A bias-free fp32 CPU matrix of a shape the kernel takes, on its Q4_1 grid up to float rounding (the
    default target's layers: exactly)."""
    w = linear.weight
    return (linear.bias is None and w.dtype == torch.float32 and w.device.type == "cpu" and shape_supported(w)
            and grid_deviation(w.detach()) <= GRID_TOLERANCE)


def q41_or_packed(linear: torch.nn.Module) -> torch.nn.Module:
    """Q41Linear where `q41_usable` and the kernel is available, else PackedLinear (oneDNN)."""
    if kernel_unavailable() is None and q41_usable(linear):
        return Q41Linear(linear, _kernel()[0])
    return PackedLinear(linear)


def q41_for_inference(module: torch.nn.Module) -> torch.nn.Module:
    """models.packed_linear.packed_for_inference(module) with its exactly-Q4_1 matrices (and an exactly-Q8_0
    head) on the kernels: for batched
    generation by the target (distill.generation), whose decode steps are one row per sequence. The same weights,
    so the same greedy tokens up to fp32 summation order (BENCHMARKS.md, stop 46). Cached until the weights
    change."""
    if kernel_unavailable() is not None or not packing_supported(module):
        return packed_for_inference(module)
    return cached_copy(_copies, module, ("q41", amx_unavailable(), weights_signature(module)),
                       lambda: clone_with_packed_linears(module, _on_a_kernel_or_packed))


def _on_a_kernel_or_packed(linear: torch.nn.Linear) -> torch.nn.Module:
    """Q41Linear, else Q80Linear (a head), else PackedLinear; each grid checked once."""
    if kernel_unavailable() is None:
        if q41_usable(linear):
            return Q41Linear(linear, _kernel()[0])
        if q80_usable(linear):
            return Q80Linear(linear, _kernel()[0])
    return PackedLinear(linear)
