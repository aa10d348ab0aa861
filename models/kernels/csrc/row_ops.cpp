#include "cpu_kernels.h"

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
// blocking, made for long queries), about 2 ms of a 16 ms forward; this is a few microseconds. Each (head, row)'s
// numbers alone, keys in order: a row's numbers depend only on its query and what it sees, whatever the number of
// rows. A call takes G query heads of one row that share a key/value head together (attend_heads), so each key and
// value is read once for the G of them, each head's operations in the order one head alone takes.
// exp as Cephes' expf (range reduction by ln 2, degree-6 polynomial, about 1 ulp); arguments below -87.3 (the
// scores far under their maximum) and keys the mask hides contribute exactly 0.

#ifdef SPECDISTILL_AVX2
#include "attention_avx2.h"  // the AVX2 build's attend_heads, the same numbers
#else
template <int G, int HD>  // HD: the head size, or 0 for hd at run time (then G == 1)
static inline __attribute__((always_inline)) void attend_heads(const float *q, long q_stride, const float *k,
                                                                const float *v, int T, int hd,
                                                                const uint8_t *visible, float scale, float *scores,
                                                                int padded, float *out) {
    // q: head g's query at q + g * q_stride [hd]; scores [G][padded]: scratch; out + g * hd [hd] = sum_t p_t v_t /
    // sum_t p_t over the visible t, for head g. Keys in blocks of 16: each key's 16-lane products summed over the
    // head's chunks of 16 in order, then the block's 16 sums at once (sums_of_16); a block the row cannot see at all
    // is skipped (a static-shape cache's unused tail).
    const int chunks = HD ? HD / 16 : hd / 16;
    const __m512 hidden = _mm512_set1_ps(-INFINITY), scaling = _mm512_set1_ps(scale);
    __m512 query[G][HD ? HD / 16 : 16], top[G];
    for (int g = 0; g < G; g++) {
        top[g] = hidden;
        for (int c = 0; c < chunks; c++) query[g][c] = _mm512_loadu_ps(q + g * q_stride + 16 * c);
    }
    for (int t0 = 0; t0 < T; t0 += 16) {
        int count = T - t0 < 16 ? T - t0 : 16;
        __mmask16 lanes = count == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
        uint8_t flags[16] = {0};
        memcpy(flags, visible + t0, (size_t)count);  // not past the row's T bytes
        __mmask16 seen = _mm512_mask_cmpneq_epi32_mask(
            lanes, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)flags)), _mm512_setzero_si512());
        if (!seen) {
            for (int g = 0; g < G; g++) _mm512_storeu_ps(scores + g * padded + t0, hidden);
            continue;
        }
        __m512 dots[G][16];
        for (int j = 0; j < 16; j++) {
            if (j >= count) {
                for (int g = 0; g < G; g++) dots[g][j] = _mm512_setzero_ps();
                continue;
            }
            const float *key = k + (size_t)(t0 + j) * hd;
            __m512 first = _mm512_loadu_ps(key), s[G];
            for (int g = 0; g < G; g++) s[g] = _mm512_mul_ps(query[g][0], first);
            for (int c = 1; c < chunks; c++) {
                __m512 part = _mm512_loadu_ps(key + 16 * c);
                for (int g = 0; g < G; g++) s[g] = _mm512_fmadd_ps(query[g][c], part, s[g]);
            }
            for (int g = 0; g < G; g++) dots[g][j] = s[g];
        }
        for (int g = 0; g < G; g++) {
            __m512 block = _mm512_mask_blend_ps(seen, hidden, _mm512_mul_ps(sums_of_16(dots[g]), scaling));
            _mm512_storeu_ps(scores + g * padded + t0, block);
            top[g] = _mm512_max_ps(top[g], block);
        }
    }
    for (int g = 0; g < G; g++) {  // hidden keys: exp(-inf) flushed to exactly 0
        __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top[g]));
        float *row = scores + g * padded;
        for (int t0 = 0; t0 < T; t0 += 16)
            _mm512_storeu_ps(row + t0, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + t0), shift)));
    }
    // Both sums run over the visible keys one by one in cache order, so a row's numbers depend on which keys it sees
    // and in what order, not on where they sit: a tree row's ancestors lie scattered among its siblings, the same
    // tokens' keys in plain decoding are consecutive (a sum kept in 16 lanes by position gave them other roundings).
    // A key whose weight is 0 (hidden, or too small to count) leaves a head's sums as they are (the masked FMA; the
    // total gains +0.0, which leaves a nonnegative sum unchanged).
    __m512 acc[G][HD ? HD / 16 : 16];
    float total[G];
    for (int g = 0; g < G; g++) {
        total[g] = 0.0f;
        for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_setzero_ps();
    }
    for (int t = 0; t < T; t++) {
        __m512 p[G];
        __mmask16 counts[G];
        bool any = false;
        for (int g = 0; g < G; g++) {
            float weight = scores[g * padded + t];
            total[g] += weight;
            counts[g] = weight != 0.0f ? (__mmask16)0xFFFF : (__mmask16)0;
            any |= weight != 0.0f;
            p[g] = _mm512_set1_ps(weight);
        }
        if (!any) continue;
        const float *value = v + (size_t)t * hd;
        for (int c = 0; c < chunks; c++) {
            __m512 part = _mm512_loadu_ps(value + 16 * c);
            for (int g = 0; g < G; g++) acc[g][c] = _mm512_mask3_fmadd_ps(p[g], part, acc[g][c], counts[g]);
        }
    }
    for (int g = 0; g < G; g++) {
        __m512 sum = _mm512_set1_ps(total[g]);
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out + g * hd + 16 * c, _mm512_div_ps(acc[g][c], sum));
    }
}
#endif  // SPECDISTILL_AVX2

// G query heads of one row over their key/value head: the common head sizes with their loops unrolled (the queries
// and accumulators in registers), any other multiple of 16 one head at a time.
template <int G>
static void attend_heads_of(const float *q, long q_stride, const float *k, const float *v, int T, int hd,
                            const uint8_t *visible, float scale, float *scores, int padded, float *out) {
    switch (hd) {
        case 128: attend_heads<G, 128>(q, q_stride, k, v, T, hd, visible, scale, scores, padded, out); return;
        case 64: attend_heads<G, 64>(q, q_stride, k, v, T, hd, visible, scale, scores, padded, out); return;
        case 32: attend_heads<G, 32>(q, q_stride, k, v, T, hd, visible, scale, scores, padded, out); return;
        default:
            for (int g = 0; g < G; g++)
                attend_heads<1, 0>(q + g * q_stride, q_stride, k, v, T, hd, visible, scale, scores, padded,
                                   out + g * hd);
    }
}

static void attend_group(int G, const float *q, long q_stride, const float *k, const float *v, int T, int hd,
                         const uint8_t *visible, float scale, float *scores, int padded, float *out) {
    switch (G) {
        case 3: attend_heads_of<3>(q, q_stride, k, v, T, hd, visible, scale, scores, padded, out); return;
        case 2: attend_heads_of<2>(q, q_stride, k, v, T, hd, visible, scale, scores, padded, out); return;
        default: attend_heads_of<1>(q, q_stride, k, v, T, hd, visible, scale, scores, padded, out);
    }
}

// A call's units: (key/value head, run of up to `most` (1..MOST_HEADS) of its query heads, row), a key/value head's
// units side by side. A key/value head's `group` query heads split into runs of `most`, the last one shorter
// (7 -> 3, 3, 1). Every `most` gives each head the same bits (1: each head alone).
struct HeadRuns {
    int group, most, runs;
    int first(int r) const { return r * most; }
    int size(int r) const { return group - first(r) < most ? group - first(r) : most; }
};

static HeadRuns head_runs(int H, int Hkv, int most) {
    int group = H / Hkv;
    most = most < 1 ? 1 : most > MOST_HEADS ? MOST_HEADS : most;
    return {group, most, (group + most - 1) / most};
}

// q [H][N][hd] (contiguous); head j's keys and values: row t at k + j * head_stride + t * hd (j = h / (H / Hkv));
// visible [N][T] bytes (nonzero: row n attends to key t; every row sees at least one key); out [N][H * hd], the
// layout the output projection reads. hd % 16 == 0, hd <= 256. 0, or -1 without scratch memory (out unwritten).
int attention_rows(const float *q, int H, int Hkv, int N, int hd, const float *k, const float *v, long head_stride,
                   int T, const uint8_t *visible, float scale, float *out, int threads, int most_heads) {
    HeadRuns runs = head_runs(H, Hkv, most_heads);
    int padded = (T + 15) / 16 * 16, units = Hkv * runs.runs * N;
    if (threads > units) threads = units;
    if (threads < 1) threads = 1;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)padded * MOST_HEADS * threads);
    if (scratch == NULL) return -1;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int u = 0; u < units; u++) {
        int n = u % N, r = (u / N) % runs.runs, j = u / N / runs.runs, h = j * runs.group + runs.first(r);
        size_t kv = (size_t)j * head_stride;
        float *scores = scratch + (size_t)omp_get_thread_num() * padded * MOST_HEADS;
        attend_group(runs.size(r), q + ((size_t)h * N + n) * hd, (long)N * hd, k + kv, v + kv, T, hd,
                     visible + (size_t)n * T, scale, scores, padded, out + (size_t)n * H * hd + (size_t)h * hd);
    }
    free(scratch);
    return 0;
}

// Rows of several sequences in one forward (distill.engine_generation: many prompts decoded together), each sequence's
// keys a contiguous span of one cache: row n attends to the keys [spans[2n], spans[2n + 1]) alone, all of them seen,
// so its numbers are the ones attention_rows gives it over the same keys in its own cache (the same operations over
// the same keys in the same order), and its cost follows its own span, not the cache's. 0, or -1 without scratch
// memory.
int attention_spans(const float *q, int H, int Hkv, int N, int hd, const float *k, const float *v, long head_stride,
                    const int64_t *spans, float scale, float *out, int threads) {
    HeadRuns runs = head_runs(H, Hkv, MOST_HEADS);
    int longest = 1, units = Hkv * runs.runs * N;
    for (int n = 0; n < N; n++) {
        int width = (int)(spans[2 * n + 1] - spans[2 * n]);
        if (width > longest) longest = width;
    }
    int padded = (longest + 15) / 16 * 16;
    if (threads > units) threads = units;
    if (threads < 1) threads = 1;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)padded * MOST_HEADS * threads);
    uint8_t *seen = (uint8_t *)malloc((size_t)padded);
    if (scratch == NULL || seen == NULL) {
        free(scratch);
        free(seen);
        return -1;
    }
    memset(seen, 1, (size_t)padded);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int u = 0; u < units; u++) {  // as attention_rows
        int n = u % N, r = (u / N) % runs.runs, j = u / N / runs.runs, h = j * runs.group + runs.first(r);
        long first = spans[2 * n];
        int T = (int)(spans[2 * n + 1] - first);
        size_t kv = (size_t)j * head_stride + (size_t)first * hd;
        float *scores = scratch + (size_t)omp_get_thread_num() * padded * MOST_HEADS;
        attend_group(runs.size(r), q + ((size_t)h * N + n) * hd, (long)N * hd, k + kv, v + kv, T, hd, seen, scale,
                     scores, padded, out + (size_t)n * H * hd + (size_t)h * hd);
    }
    free(scratch);
    free(seen);
    return 0;
}

// The rows' rotated keys k [Hkv][N][hd] and their values (the v heads of the fused projection's rows qkv
// [N][(H + 2 Hkv) hd]) into the cache at rows start..start+N-1 (head j's row t at keys + j * head_stride + t * hd).
void append_keys_values(const float *k, const float *qkv, int N, int H, int Hkv, int hd, float *keys,
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
// same order as the lean forward's Python (so the same bits), without its thirty-odd tensor operations a layer. The
// projections are the default target's Q4_1 matrices or a K-quant GGUF's own blocks (kq_linear). ----

static int project(const float *x, int R, int K, q41_matrix w, float *y, int threads) {
    q41_gemm(x, R, K, w.packed, w.d, w.m, w.N, y, threads);
    return 0;
}

static int project(const float *x, int R, int, const kq_linear &w, float *y, int threads) {
    return kq_linear_rows(x, R, w, y, threads);
}

// y [N][D] = x + o(attention(rope(qkv(rms_norm(x))))); gate_up [N][2I] = gate_up(rms_norm(y)); the rows' keys and
// values written to the cache at rows start..start+N-1 of each head (head j's row t at keys + j * head_stride +
// t * hd). work: N * (D + Q + (H + Hkv) * hd + H * hd) floats, Q = (H + 2 Hkv) * hd. 0, or -1 (no memory).
template <typename Matrix>
static int layer_attention(const float *x, int N, int D, const float *norm_in, float eps_in, const Matrix &qkv,
                           int H, int Hkv, int hd, const float *cos, const float *sin, float *keys, float *values,
                           long head_stride, int start, int T, const uint8_t *visible, float scale, const Matrix &o,
                           const float *norm_post, float eps_post, const Matrix &gate_up, float *y,
                           float *gate_up_out, float *work, int threads) {
    int width = (H + 2 * Hkv) * hd;
    float *normed = work, *fused = normed + (size_t)N * D, *q = fused + (size_t)N * width;
    float *k = q + (size_t)H * N * hd, *attended = k + (size_t)Hkv * N * hd;
    rms_norm_rows(x, N, D, norm_in, eps_in, normed);
    if (project(normed, N, D, qkv, fused, threads) != 0) return -1;
    rope_qk(fused, N, H, Hkv, hd, cos, sin, q, k);
    append_keys_values(k, fused, N, H, Hkv, hd, keys, values, head_stride, start);
    if (attention_rows(q, H, Hkv, N, hd, keys, values, head_stride, T, visible, scale, attended, threads) != 0)
        return -1;
    if (project(attended, N, H * hd, o, y, threads) != 0) return -1;  // o(attended), then x + it, as torch adds
    for (size_t i = 0; i < (size_t)N * D; i++) y[i] = x[i] + y[i];
    rms_norm_rows(y, N, D, norm_post, eps_post, normed);
    return project(normed, N, D, gate_up, gate_up_out, threads);
}

// y [N][D] += down(activated [N][I]); work: N * D floats.
template <typename Matrix>
static int layer_down(float *y, int N, int D, const float *activated, int I, const Matrix &down, float *work,
                      int threads) {
    if (project(activated, N, I, down, work, threads) != 0) return -1;
    for (size_t i = 0; i < (size_t)N * D; i++) y[i] = y[i] + work[i];
    return 0;
}

int layer_rows_attention(const float *x, int N, int D, const float *norm_in, float eps_in, q41_matrix qkv, int H,
                         int Hkv, int hd, const float *cos, const float *sin, float *keys, float *values,
                         long head_stride, int start, int T, const uint8_t *visible, float scale, q41_matrix o,
                         const float *norm_post, float eps_post, q41_matrix gate_up, float *y, float *gate_up_out,
                         float *work, int threads) {
    return layer_attention(x, N, D, norm_in, eps_in, qkv, H, Hkv, hd, cos, sin, keys, values, head_stride, start, T,
                           visible, scale, o, norm_post, eps_post, gate_up, y, gate_up_out, work, threads);
}

int layer_rows_attention(const float *x, int N, int D, const float *norm_in, float eps_in, const kq_linear &qkv,
                         int H, int Hkv, int hd, const float *cos, const float *sin, float *keys, float *values,
                         long head_stride, int start, int T, const uint8_t *visible, float scale, const kq_linear &o,
                         const float *norm_post, float eps_post, const kq_linear &gate_up, float *y,
                         float *gate_up_out, float *work, int threads) {
    return layer_attention(x, N, D, norm_in, eps_in, qkv, H, Hkv, hd, cos, sin, keys, values, head_stride, start, T,
                           visible, scale, o, norm_post, eps_post, gate_up, y, gate_up_out, work, threads);
}

int layer_rows_down(float *y, int N, int D, const float *activated, int I, q41_matrix down, float *work,
                    int threads) {
    return layer_down(y, N, D, activated, I, down, work, threads);
}

int layer_rows_down(float *y, int N, int D, const float *activated, int I, const kq_linear &down, float *work,
                    int threads) {
    return layer_down(y, N, D, activated, I, down, work, threads);
}
