#include "cpu_kernels.h"

// ---- Q8_0 weights times int8 activations on AVX512-VNNI, for drafters only: x is rounded, so this is an
// approximation of x @ W^T (llama.cpp's Q8_0 x Q8_0 dot), never used for the target. Each row and group of 32 of x
// becomes int8 codes with step max |x| / 127, offset by 128 to the unsigned bytes vpdpbusd multiplies with the
// weights' signed codes (64 products a instruction, in place of 16 FMAs after a conversion); the offset's share,
// 128 times the group's code sum, is precomputed per output and group (`bias`, negated: each group's accumulator
// starts from it). Layout: codes [N/16][G][8][16][4] (16 outputs side by side, 4 consecutive k each), steps d and
// bias [N/16][G][16]. Each group's integer dot is exact; the groups are summed in fp32, d_w * d_x first. A row
// is computed alike whatever R is. N % 32 == 0, K % 32 == 0. ----
#define VNNI_TARGET ISA_TARGET("avx512f,avx512bw,avx512vnni")
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

#ifdef SPECDISTILL_AVX2
#include "int8_avx2.h"  // the AVX2 build's int8_gemm_rounded, the same numbers
#else
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
#endif  // SPECDISTILL_AVX2

VNNI_TARGET int q8_int8_gemm(const float *x, int R, int K, const int8_t *codes, const float *d, const int32_t *bias,
                             int N, float *y, int threads) {
    uint8_t *xq = (uint8_t *)malloc((size_t)R * K);
    float *dx = (float *)malloc(sizeof(float) * (size_t)R * (K / 32));
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
// (int8_matrix: cpu_kernels.h)

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
    float *work = (float *)malloc(sizeof(float) * floats);
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
    float *normed = (float *)malloc(sizeof(float) * ((size_t)N * D + (size_t)N * M));
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
    float *approx = (float *)malloc(sizeof(float) * (size_t)R * N * 2), *dx = (float *)malloc(sizeof(float) * (size_t)R * G);
    uint8_t *xq = (uint8_t *)malloc((size_t)R * K);
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
