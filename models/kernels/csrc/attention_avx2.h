// The decode-time attention of the library's AVX2 build (row_ops.cpp includes this in place of its AVX-512
// attend_heads): the same operations in the same order on every lane, so each output is bit for bit what the AVX-512
// build computes. SIMDe's 512-bit emulation kept the queries, the 16 keys' partial sums and the accumulators in memory
// and cost 14% of the 1.5B's one-row forward and 29% of an 8-row one here.
//
// A 16-lane AVX-512 vector is two 8-lane halves (lanes 0-7, 8-15). The orders kept:
// - a key's score: lane i's products over the head's chunks of 16 in order (a mul, then FMAs), then sums_of_16's
//   tree per key: P_L = (e0 + e2) + (e1 + e3) within each 128-bit quarter L, then (P0 + P2) + (P1 + P3);
// - exp_nonpositive: the same polynomial; vscalefps(p, n) for an integer n in [-126, 0] is p * 2^n rounded once,
//   which a multiply by the float 2^n computes as well;
// - the weighted values: each lane's sum over the visible keys one by one in cache order, a key of weight 0 leaving
//   it as it is. AVX2 has 16 registers: the accumulators go in parts of 32 lanes a pass over the keys (G <= 3 heads
//   x 4 registers), each lane's order unchanged.
#pragma once

static inline __m256 exp_nonpositive_256(__m256 x) {  // exp_nonpositive on 8 lanes, x <= 0
    __m256 alive = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // alive lanes have n in [-126, 0]: 2^n is a normal float, built from its exponent bits
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(alive, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

// Four keys' scores from their 16-lane partial sums (lo: lanes 0-7, hi: lanes 8-15 of each): per key
// (P0 + P2) + (P1 + P3), in 128 bits, key order.
static inline __m256 pair_sums(__m256 a, __m256 b) {  // per 128-bit quarter: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
}

static inline __m128 sums_of_four(const __m256 lo[4], const __m256 hi[4]) {
    __m256 ql[2] = {pair_sums(lo[0], lo[1]), pair_sums(lo[2], lo[3])};  // as sums_of_16's first step
    __m256 qh[2] = {pair_sums(hi[0], hi[1]), pair_sums(hi[2], hi[3])};
    // per quarter: the 4 keys' P of that quarter (lo: [P0 x 4 | P1 x 4], hi: [P2 x 4 | P3 x 4])
    __m256 pl = _mm256_add_ps(_mm256_shuffle_ps(ql[0], ql[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(ql[0], ql[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 ph = _mm256_add_ps(_mm256_shuffle_ps(qh[0], qh[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(qh[0], qh[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m256 pairs = _mm256_add_ps(pl, ph);  // [P0 + P2 | P1 + P3]
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// Head g's weighted values over lanes [32 part, 32 part + 32): acc[g][i] for lanes 32 part + 8i ..
template <int G>
static inline void weigh_values_part(const float *v, int T, int hd, const float *scores, int padded, int part,
                                     float *out) {
    __m256 acc[G][4];
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = _mm256_setzero_ps();
    const int lanes = hd - 32 * part < 32 ? (hd - 32 * part) / 8 : 4;  // hd % 16 == 0: 2 or 4
    for (int t = 0; t < T; t++) {
        const float *value = v + (size_t)t * hd + 32 * part;
        for (int g = 0; g < G; g++) {
            float weight = scores[g * padded + t];
            if (weight == 0.0f) continue;  // the masked FMA: a weight of 0 leaves the sums as they are
            __m256 p = _mm256_set1_ps(weight);
            for (int i = 0; i < lanes; i++) acc[g][i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * i), acc[g][i]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < lanes; i++) _mm256_storeu_ps(out + g * hd + 32 * part + 8 * i, acc[g][i]);
}

template <int G, int HD>  // HD: the head size, or 0 for hd at run time (then G == 1)
static inline __attribute__((always_inline)) void attend_heads(const float *q, long q_stride, const float *k,
                                                                const float *v, int T, int hd,
                                                                const uint8_t *visible, float scale, float *scores,
                                                                int padded, float *out) {
    // as row_ops.cpp's AVX-512 attend_heads: q at q + g * q_stride [hd], scores [G][padded] scratch, out + g * hd [hd]
    const int chunks = HD ? HD / 16 : hd / 16;
    const __m256 scaling = _mm256_set1_ps(scale), hidden = _mm256_set1_ps(-INFINITY);
    __m256 top[G];
    for (int g = 0; g < G; g++) top[g] = hidden;
    for (int t0 = 0; t0 < T; t0 += 16) {
        int count = T - t0 < 16 ? T - t0 : 16;
        uint8_t flags[16] = {0};
        memcpy(flags, visible + t0, (size_t)count);  // not past the row's T bytes
        __m128i unseen = _mm_cmpeq_epi8(_mm_loadu_si128((const __m128i *)flags), _mm_setzero_si128());  // 0xFF
        if (_mm_movemask_epi8(unseen) == 0xFFFF) {  // the row sees none of the block
            for (int g = 0; g < G; g++) {
                _mm256_storeu_ps(scores + g * padded + t0, hidden);
                _mm256_storeu_ps(scores + g * padded + t0 + 8, hidden);
            }
            continue;
        }
        // keys the row does not see (or past T): all ones in their lanes, 8 keys a half
        __m256 unseen_lo = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(unseen));
        __m256 unseen_hi = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(unseen, 8)));
        for (int g = 0; g < G; g++) {
            const float *query = q + g * q_stride;
            __m128 four[4];
            for (int b = 0; b < 4; b++) {
                __m256 lo[4], hi[4];
                for (int j = 0; j < 4; j++) {
                    if (4 * b + j >= count) {
                        lo[j] = hi[j] = _mm256_setzero_ps();
                        continue;
                    }
                    const float *key = k + (size_t)(t0 + 4 * b + j) * hd;
                    __m256 sl = _mm256_mul_ps(_mm256_loadu_ps(query), _mm256_loadu_ps(key));
                    __m256 sh = _mm256_mul_ps(_mm256_loadu_ps(query + 8), _mm256_loadu_ps(key + 8));
                    for (int c = 1; c < chunks; c++) {
                        sl = _mm256_fmadd_ps(_mm256_loadu_ps(query + 16 * c), _mm256_loadu_ps(key + 16 * c), sl);
                        sh = _mm256_fmadd_ps(_mm256_loadu_ps(query + 16 * c + 8), _mm256_loadu_ps(key + 16 * c + 8),
                                             sh);
                    }
                    lo[j] = sl;
                    hi[j] = sh;
                }
                four[b] = sums_of_four(lo, hi);
            }
            __m256 first = _mm256_mul_ps(_mm256_set_m128(four[1], four[0]), scaling);
            __m256 second = _mm256_mul_ps(_mm256_set_m128(four[3], four[2]), scaling);
            first = _mm256_blendv_ps(first, hidden, unseen_lo);
            second = _mm256_blendv_ps(second, hidden, unseen_hi);
            _mm256_storeu_ps(scores + g * padded + t0, first);
            _mm256_storeu_ps(scores + g * padded + t0 + 8, second);
            top[g] = _mm256_max_ps(top[g], _mm256_max_ps(first, second));
        }
    }
    float total[G];
    for (int g = 0; g < G; g++) {  // hidden keys: exp(-inf) flushed to exactly 0
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(top[g]), _mm256_extractf128_ps(top[g], 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        __m256 shift = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))));
        float *row = scores + g * padded;
        for (int t = 0; t < T; t += 8)
            _mm256_storeu_ps(row + t, exp_nonpositive_256(_mm256_sub_ps(_mm256_loadu_ps(row + t), shift)));
        total[g] = 0.0f;
        for (int t = 0; t < T; t++) total[g] += row[t];
    }
    for (int part = 0; 32 * part < hd; part++) weigh_values_part<G>(v, T, hd, scores, padded, part, out);
    for (int g = 0; g < G; g++) {
        __m256 sum = _mm256_set1_ps(total[g]);
        for (int i = 0; i < hd; i += 8)
            _mm256_storeu_ps(out + g * hd + i, _mm256_div_ps(_mm256_loadu_ps(out + g * hd + i), sum));
    }
}
