// The Python boundary of the CPU kernels (cpu_kernels.h): every function checks device, dtype, shape and
// contiguity of what it is given before a pointer is taken, and raises (TypeError for a dtype, ValueError for a
// shape or a layout, MemoryError-like RuntimeError when scratch memory is refused) naming the function and the
// argument. Outputs are allocated here. Threads: torch's own count (at::get_num_threads) on torch's OpenMP runtime.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "cpu_kernels.h"

namespace {

constexpr int64_t kGroup = 32;    // weights per quantization group
constexpr int64_t kMaxRows = 64;  // decode-time calls; longer ones are prefill, left to oneDNN

int threads() { return at::get_num_threads(); }

void check_tensor(const at::Tensor &t, at::ScalarType dtype, const char *fn, const char *name) {
    TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor");
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, fn, ": ", name, " must be ", c10::toString(dtype), ", got ",
                     c10::toString(t.scalar_type()));
    TORCH_CHECK_VALUE(t.is_contiguous(), fn, ": ", name, " must be contiguous, got strides ", t.strides());
}

void check_shape(const at::Tensor &t, at::IntArrayRef shape, const char *fn, const char *name) {
    TORCH_CHECK_VALUE(t.sizes() == shape, fn, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

// x fp32 [R, K], 1 <= R <= kMaxRows, contiguous: the decode-time rows every GEMM reads
void check_rows(const at::Tensor &x, int64_t K, const char *fn) {
    check_tensor(x, at::kFloat, fn, "x");
    TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == K && x.size(0) >= 1 && x.size(0) <= kMaxRows, fn,
                      ": x must be [1..", kMaxRows, ", ", K, "], got ", x.sizes());
}

void check_norm(const at::Tensor &w, int64_t D, const char *fn, const char *name) {
    check_tensor(w, at::kFloat, fn, name);
    check_shape(w, {D}, fn, name);
}

void check_memory(int status, const char *fn) {
    TORCH_CHECK(status == 0, fn, ": out of memory for its scratch buffers");
}

// A Q4_1 matrix in the FMA form: packed uint8 [N, K/2], steps d and minima m fp32 [N, K/32]. Holds its tensors,
// so the pointers it hands the kernels live as long as it does.
struct Q41Matrix {
    at::Tensor packed, d, m;
    int64_t N, K;

    Q41Matrix(at::Tensor packed_, at::Tensor d_, at::Tensor m_)
        : packed(std::move(packed_)), d(std::move(d_)), m(std::move(m_)) {
        const char *fn = "Q41Matrix";
        check_tensor(packed, at::kByte, fn, "packed");
        TORCH_CHECK_VALUE(packed.dim() == 2, fn, ": packed must be [N, K/2], got ", packed.sizes());
        N = packed.size(0), K = packed.size(1) * 2;
        TORCH_CHECK_VALUE(K % kGroup == 0 && N % 2 == 0 && N > 0, fn, ": K must be a multiple of 32 and N of 2, got [",
                          N, ", ", K, "]");
        check_tensor(d, at::kFloat, fn, "d");
        check_shape(d, {N, K / kGroup}, fn, "d");
        check_tensor(m, at::kFloat, fn, "m");
        check_shape(m, {N, K / kGroup}, fn, "m");
    }

    q41_matrix raw() const {
        return {packed.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), static_cast<int>(N)};
    }

    at::Tensor gemm(const at::Tensor &x) const {  // x [R, K] -> [R, N]
        check_rows(x, K, "Q41Matrix.gemm");
        auto y = at::empty({x.size(0), N}, x.options());
        q41_gemm(x.data_ptr<float>(), x.size(0), K, packed.data_ptr<uint8_t>(), d.data_ptr<float>(),
                 m.data_ptr<float>(), N, y.data_ptr<float>(), threads());
        return y;
    }
};

// Q8_0 weights in the int8 kernel's layout: codes int8 [N/16, K/32, 8, 16, 4], d fp32 and bias int32 [N/16, K/32, 16].
struct Int8Matrix {
    at::Tensor codes, d, bias;
    int64_t N, K;

    Int8Matrix(at::Tensor codes_, at::Tensor d_, at::Tensor bias_)
        : codes(std::move(codes_)), d(std::move(d_)), bias(std::move(bias_)) {
        const char *fn = "Int8Matrix";
        check_tensor(codes, at::kChar, fn, "codes");
        TORCH_CHECK_VALUE(codes.dim() == 5 && codes.size(2) == 8 && codes.size(3) == 16 && codes.size(4) == 4, fn,
                          ": codes must be [N/16, K/32, 8, 16, 4], got ", codes.sizes());
        N = codes.size(0) * 16, K = codes.size(1) * kGroup;
        TORCH_CHECK_VALUE(N % 32 == 0 && N > 0, fn, ": N must be a multiple of 32, got ", N);
        check_tensor(d, at::kFloat, fn, "d");
        check_shape(d, {N / 16, K / kGroup, 16}, fn, "d");
        check_tensor(bias, at::kInt, fn, "bias");
        check_shape(bias, {N / 16, K / kGroup, 16}, fn, "bias");
    }

    int8_matrix raw() const {
        return {codes.data_ptr<int8_t>(), d.data_ptr<float>(), bias.data_ptr<int32_t>(), static_cast<int>(N)};
    }

    at::Tensor gemm(const at::Tensor &x) const {  // x [R, K] -> [R, N], x rounded to int8 per group
        check_rows(x, K, "Int8Matrix.gemm");
        auto y = at::empty({x.size(0), N}, x.options());
        check_memory(q8_int8_gemm(x.data_ptr<float>(), x.size(0), K, codes.data_ptr<int8_t>(), d.data_ptr<float>(),
                                  bias.data_ptr<int32_t>(), N, y.data_ptr<float>(), threads()),
                     "Int8Matrix.gemm");
        return y;
    }
};

// ---- K-quant matrices (kquant.cpp): x is rounded to int8 once per call (`quantize_rows_q8k`) and may then feed
// several matrices (a fused projection's segments) through `gemm_into`, each writing its columns of one output.
// Any number of rows: prefill runs here too, each row computed as at decode time.

constexpr int64_t kSuper = 256;  // weights per K-quant block

#ifdef SPECDISTILL_AVX2
constexpr bool kAmxBuilt = false;  // the AVX2 build: no AMX forms; its int8 dot products are AVX2's (avx2_isa.h)
bool vnni_cpu() { return true; }
#else
constexpr bool kAmxBuilt = true;
bool vnni_cpu() { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"); }
#endif

void check_vnni(const char *fn) {
    TORCH_CHECK(vnni_cpu(), fn, ": needs AVX512-VNNI, which this CPU lacks");
}

void check_amx_built(const char *fn) {
    TORCH_CHECK(kAmxBuilt, fn, ": the library's AVX2 build has no AMX forms");
}

// x fp32 [R, K] -> (q int8 [R, K], d fp32 [R, K/256], sums int32 [R, K/16])
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_q8k_op(const at::Tensor &x) {
    const char *fn = "quantize_rows_q8k";
    check_vnni(fn);
    check_tensor(x, at::kFloat, fn, "x");
    TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) >= 1 && x.size(1) % kSuper == 0 && x.size(1) > 0, fn,
                      ": x must be [R >= 1, K] with K a multiple of 256, got ", x.sizes());
    int64_t R = x.size(0), K = x.size(1);
    auto q = at::empty({R, K}, x.options().dtype(at::kChar));
    auto d = at::empty({R, K / kSuper}, x.options());
    auto sums = at::empty({R, K / 16}, x.options().dtype(at::kInt));
    quantize_rows_q8k(x.data_ptr<float>(), R, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<int32_t>());
    return {q, d, sums};
}

q8k_rows checked_rows(const at::Tensor &q, const at::Tensor &d, const at::Tensor &sums, int64_t K, const char *fn) {
    check_tensor(q, at::kChar, fn, "q");
    TORCH_CHECK_VALUE(q.dim() == 2 && q.size(0) >= 1 && q.size(1) == K, fn, ": q must be [R >= 1, ", K, "], got ",
                      q.sizes());
    int64_t R = q.size(0);
    check_tensor(d, at::kFloat, fn, "d");
    check_shape(d, {R, K / kSuper}, fn, "d");
    check_tensor(sums, at::kInt, fn, "sums");
    check_shape(sums, {R, K / 16}, fn, "sums");
    return {q.data_ptr<int8_t>(), d.data_ptr<float>(), sums.data_ptr<int32_t>(), static_cast<int>(R),
            static_cast<int>(K)};
}

// y fp32 [R, W] contiguous with this matrix's N columns from `column` on inside it
void check_output(const at::Tensor &y, int64_t R, int64_t N, int64_t column, const char *fn) {
    check_tensor(y, at::kFloat, fn, "y");
    TORCH_CHECK_VALUE(y.dim() == 2 && y.size(0) == R && column >= 0 && column + N <= y.size(1), fn,
                      ": y must be [", R, ", >= column + ", N, "] with column >= 0, got ", y.sizes(), " and column ",
                      column);
}

// tile_rows (0: never; else the fewest rows a call runs on AMX-INT8 tiles, at least 16): only where the caller found
// AMX-INT8 on the CPU and was given the tile state by Linux (models.kernels.amx_int8_unavailable).
int checked_tile_rows(int64_t tile_rows, const char *fn) {
    TORCH_CHECK_VALUE(tile_rows == 0 || (tile_rows >= 16 && tile_rows <= (1 << 20)), fn,
                      ": tile_rows must be 0 or at least 16, got ", tile_rows);
    if (tile_rows != 0) check_amx_built(fn);
    return static_cast<int>(tile_rows);
}

// The shared part of both K-quant matrices: the blocked shape [N/16, K/256, ...] read off a tensor, N and K.
struct KQuantShape {
    int64_t N = 0, K = 0;

    void read(const at::Tensor &t, at::IntArrayRef inner, const char *fn, const char *name) {
        TORCH_CHECK_VALUE(t.dim() == 2 + static_cast<int64_t>(inner.size()) && t.size(0) > 0 && t.size(1) > 0 &&
                              t.sizes().slice(2) == inner,
                          fn, ": ", name, " must be [N/16, K/256, ", inner, "], got ", t.sizes());
        N = t.size(0) * 16, K = t.size(1) * kSuper;
    }
};

struct Q4KMatrix : KQuantShape {
    at::Tensor codes, sc, m, d, dmin;

    Q4KMatrix(at::Tensor codes_, at::Tensor sc_, at::Tensor m_, at::Tensor d_, at::Tensor dmin_)
        : codes(std::move(codes_)), sc(std::move(sc_)), m(std::move(m_)), d(std::move(d_)), dmin(std::move(dmin_)) {
        const char *fn = "Q4KMatrix";
        check_vnni(fn);
        check_tensor(codes, at::kByte, fn, "codes");
        read(codes, {8, 4, 64}, fn, "codes");
        check_tensor(sc, at::kByte, fn, "sc");
        check_shape(sc, {N / 16, K / kSuper, 8, 16}, fn, "sc");
        check_tensor(m, at::kByte, fn, "m");
        check_shape(m, {N / 16, K / kSuper, 4, 16, 2}, fn, "m");
        check_tensor(d, at::kFloat, fn, "d");
        check_shape(d, {N / 16, K / kSuper, 16}, fn, "d");
        check_tensor(dmin, at::kFloat, fn, "dmin");
        check_shape(dmin, {N / 16, K / kSuper, 16}, fn, "dmin");
    }

    void gemm_into(const at::Tensor &q, const at::Tensor &dx, const at::Tensor &sums, at::Tensor &y,
                   int64_t column, int64_t tile_rows) const {
        const char *fn = "Q4KMatrix.gemm_into";
        q8k_rows x = checked_rows(q, dx, sums, K, fn);
        check_output(y, x.R, N, column, fn);
        check_memory(q4k_gemm(x, raw(), y.data_ptr<float>() + column, static_cast<int>(y.size(1)), threads(),
                              checked_tile_rows(tile_rows, fn)),
                     fn);
    }

    q4k_matrix raw() const {
        return {codes.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), m.data_ptr<uint8_t>(), d.data_ptr<float>(),
                dmin.data_ptr<float>(), static_cast<int>(N)};
    }
};

struct Q6KMatrix : KQuantShape {
    at::Tensor low, high, sc, d;

    Q6KMatrix(at::Tensor low_, at::Tensor high_, at::Tensor sc_, at::Tensor d_)
        : low(std::move(low_)), high(std::move(high_)), sc(std::move(sc_)), d(std::move(d_)) {
        const char *fn = "Q6KMatrix";
        check_vnni(fn);
        check_tensor(low, at::kByte, fn, "low");
        read(low, {8, 4, 64}, fn, "low");
        check_tensor(high, at::kByte, fn, "high");
        check_shape(high, {N / 16, K / kSuper, 8, 2, 64}, fn, "high");
        check_tensor(sc, at::kChar, fn, "sc");
        check_shape(sc, {N / 16, K / kSuper, 16, 16}, fn, "sc");
        check_tensor(d, at::kFloat, fn, "d");
        check_shape(d, {N / 16, K / kSuper, 16}, fn, "d");
    }

    void gemm_into(const at::Tensor &q, const at::Tensor &dx, const at::Tensor &sums, at::Tensor &y,
                   int64_t column, int64_t tile_rows) const {
        const char *fn = "Q6KMatrix.gemm_into";
        q8k_rows x = checked_rows(q, dx, sums, K, fn);
        check_output(y, x.R, N, column, fn);
        q6k_gemm(x, raw(), y.data_ptr<float>() + column, static_cast<int>(y.size(1)), threads(),
                 checked_tile_rows(tile_rows, fn));
    }

    q6k_matrix raw() const {
        return {low.data_ptr<uint8_t>(), high.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(),
                static_cast<int>(N)};
    }
};

// A GGUF's blocks of 32 in kquant.cpp's layouts, each with fp16 steps d [N/16, K/32, 16]: Q5_0 low uint8
// [N/16, K/32, 4, 64] and high uint8 [N/16, K/32, 64]; Q8_0 codes uint8 [N/16, K/32, 8, 64]. `gemm` rounds x per group
// of 32 (as Int8Matrix does) and computes what Int8Matrix computes over the same codes.
struct Q8_0Shape {
    at::Tensor d;
    int64_t N = 0, K = 0;

    void read(const at::Tensor &codes, at::IntArrayRef inner, const char *fn, const char *name) {
        TORCH_CHECK_VALUE(codes.dim() == 2 + static_cast<int64_t>(inner.size()) && codes.size(0) > 0 &&
                              codes.size(1) > 0 && codes.sizes().slice(2) == inner,
                          fn, ": ", name, " must be [N/16, K/32, ", inner, "], got ", codes.sizes());
        N = codes.size(0) * 16, K = codes.size(1) * kGroup;
        check_tensor(d, at::kHalf, fn, "d");
        check_shape(d, {N / 16, K / kGroup, 16}, fn, "d");
    }

    const uint16_t *steps() const { return reinterpret_cast<const uint16_t *>(d.data_ptr<at::Half>()); }

    template <typename Matrix, void (*Gemm)(const q8_0_rows &, Matrix, float *, int, int)>
    at::Tensor rows_times(const at::Tensor &x, Matrix w, const char *fn) const {  // x [R, K] -> [R, N]
        check_rows(x, K, fn);
        const int64_t R = x.size(0);
        auto q = at::empty({R, K}, x.options().dtype(at::kChar));
        auto dx = at::empty({R, K / kGroup}, x.options());
        auto sums = at::empty({R, K / kGroup}, x.options().dtype(at::kInt));
        auto y = at::empty({R, N}, x.options());
        quantize_rows_q8_0(x.data_ptr<float>(), R, K, q.data_ptr<int8_t>(), dx.data_ptr<float>(),
                           sums.data_ptr<int32_t>());
        const q8_0_rows rows = {q.data_ptr<int8_t>(), dx.data_ptr<float>(), sums.data_ptr<int32_t>(),
                                static_cast<int>(R), static_cast<int>(K)};
        Gemm(rows, w, y.data_ptr<float>(), static_cast<int>(N), threads());
        return y;
    }
};

struct Q50Matrix : Q8_0Shape {
    at::Tensor low, high;

    Q50Matrix(at::Tensor low_, at::Tensor high_, at::Tensor d_) : low(std::move(low_)), high(std::move(high_)) {
        const char *fn = "Q50Matrix";
        check_vnni(fn);
        d = std::move(d_);
        check_tensor(low, at::kByte, fn, "low");
        read(low, {4, 64}, fn, "low");
        check_tensor(high, at::kByte, fn, "high");
        check_shape(high, {N / 16, K / kGroup, 64}, fn, "high");
    }

    q50_matrix raw() const {
        return {low.data_ptr<uint8_t>(), high.data_ptr<uint8_t>(), steps(), static_cast<int>(N)};
    }

    at::Tensor gemm(const at::Tensor &x) const { return rows_times<q50_matrix, q50_gemm>(x, raw(), "Q50Matrix.gemm"); }
};

struct Q80Matrix : Q8_0Shape {
    at::Tensor codes;

    Q80Matrix(at::Tensor codes_, at::Tensor d_) : codes(std::move(codes_)) {
        const char *fn = "Q80Matrix";
        check_vnni(fn);
        d = std::move(d_);
        check_tensor(codes, at::kByte, fn, "codes");
        read(codes, {8, 64}, fn, "codes");
    }

    q80_matrix raw() const { return {codes.data_ptr<uint8_t>(), steps(), static_cast<int>(N)}; }

    at::Tensor gemm(const at::Tensor &x) const {
        return rows_times<q80_matrix, gguf_q80_gemm>(x, raw(), "Q80Matrix.gemm");
    }
};

// A projection over a K-quant GGUF's blocks (kq_linear): its parts (Q4KMatrix, Q6KMatrix, Q50Matrix, Q80Matrix)
// side by side in output order, all over the same K, and a bias or None. `gemm` takes any number of rows (prefill
// too); the fused layers (layer_rows_attention / layer_rows_down) take it as they take a Q41Matrix.
struct KQuantProjection {
    std::vector<py::object> parts;  // keeps the matrices, and so their tensors, alive
    std::vector<kq_segment> segments;
    at::Tensor bias;  // [N] fp32, or undefined
    int64_t N = 0, K = 0;
    int tile_rows = 0;

    KQuantProjection(std::vector<py::object> parts_, c10::optional<at::Tensor> bias_, int64_t tile_rows_)
        : parts(std::move(parts_)) {
        const char *fn = "KQuantProjection";
        tile_rows = checked_tile_rows(tile_rows_, fn);
        TORCH_CHECK_VALUE(!parts.empty(), fn, ": parts must hold at least one matrix");
        for (size_t i = 0; i < parts.size(); i++) add(parts[i], i == 0, fn);
        if (bias_.has_value() && bias_->defined()) {
            bias = *bias_;
            check_tensor(bias, at::kFloat, fn, "bias");
            check_shape(bias, {N}, fn, "bias");
        }
    }

    void add(const py::object &part, bool first, const char *fn) {
        kq_segment s = {};
        int64_t k = 0;
        if (py::isinstance<Q4KMatrix>(part)) {
            auto &w = part.cast<const Q4KMatrix &>();
            s.kind = KQ_Q4K, s.q4k = w.raw(), s.N = static_cast<int>(w.N), k = w.K;
        } else if (py::isinstance<Q6KMatrix>(part)) {
            auto &w = part.cast<const Q6KMatrix &>();
            s.kind = KQ_Q6K, s.q6k = w.raw(), s.N = static_cast<int>(w.N), k = w.K;
        } else if (py::isinstance<Q50Matrix>(part)) {
            auto &w = part.cast<const Q50Matrix &>();
            s.kind = KQ_Q50, s.q50 = w.raw(), s.N = static_cast<int>(w.N), k = w.K;
        } else if (py::isinstance<Q80Matrix>(part)) {
            auto &w = part.cast<const Q80Matrix &>();
            s.kind = KQ_Q80, s.q80 = w.raw(), s.N = static_cast<int>(w.N), k = w.K;
        } else {
            TORCH_CHECK_TYPE(false, fn, ": a part must be a Q4KMatrix, Q6KMatrix, Q50Matrix or Q80Matrix, got ",
                             py::str(part.get_type()).cast<std::string>());
        }
        TORCH_CHECK_VALUE(first || k == K, fn, ": parts over different K: ", K, " and ", k);
        K = k, s.column = static_cast<int>(N), N += s.N;
        segments.push_back(s);
    }

    kq_linear raw() const {
        return {segments.data(), static_cast<int>(segments.size()), static_cast<int>(N), static_cast<int>(K),
                bias.defined() ? bias.data_ptr<float>() : nullptr, tile_rows};
    }

    at::Tensor gemm(const at::Tensor &x) const {  // x [R >= 1, K] -> [R, N]
        const char *fn = "KQuantProjection.gemm";
        check_tensor(x, at::kFloat, fn, "x");
        TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == K, fn, ": x must be [R >= 1, ", K,
                          "], got ", x.sizes());
        auto y = at::empty({x.size(0), N}, x.options());
        check_memory(kq_linear_rows(x.data_ptr<float>(), static_cast<int>(x.size(0)), raw(), y.data_ptr<float>(),
                                    threads()),
                     fn);
        return y;
    }
};

// ---- the other GEMM forms, over tensors -------------------------------------------------------------------------

at::Tensor q80_gemm_op(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &d) {
    // x [R, K]; codes int8 [N, K]; d fp32 [N, K/32] -> [R, N]
    const char *fn = "q80_gemm";
    check_tensor(codes, at::kChar, fn, "codes");
    TORCH_CHECK_VALUE(codes.dim() == 2 && codes.size(1) % kGroup == 0 && codes.size(0) % 2 == 0, fn,
                      ": codes must be [N, K], K a multiple of 32 and N of 2, got ", codes.sizes());
    int64_t N = codes.size(0), K = codes.size(1);
    check_tensor(d, at::kFloat, fn, "d");
    check_shape(d, {N, K / kGroup}, fn, "d");
    check_rows(x, K, fn);
    auto y = at::empty({x.size(0), N}, x.options());
    q80_gemm(x.data_ptr<float>(), x.size(0), K, codes.data_ptr<int8_t>(), d.data_ptr<float>(), N,
             y.data_ptr<float>(), threads());
    return y;
}

// The AMX forms: codes in the tile unit's order, steps (and minima) fp16 [N/16, K/32, 16]; N % 32 == 0.
at::Tensor amx_gemm_op(const char *fn, const at::Tensor &x, const at::Tensor &codes, const at::Tensor &d,
                       const at::Tensor *m) {
    check_amx_built(fn);
    bool q41 = m != nullptr;
    check_tensor(codes, q41 ? at::kByte : at::kChar, fn, "codes");
    int64_t inner = q41 ? 8 : 16;  // Q4_1: 8 pair rows of 32 bytes; Q8_0: 16 rows of 32 codes
    TORCH_CHECK_VALUE(codes.dim() == 4 && codes.size(2) == inner && codes.size(3) == 32 && codes.size(0) % 2 == 0, fn,
                      ": codes must be [N/16, K/32, ", inner, ", 32] with N a multiple of 32, got ", codes.sizes());
    int64_t N = codes.size(0) * 16, K = codes.size(1) * kGroup;
    check_tensor(d, at::kHalf, fn, "d");
    check_shape(d, {N / 16, K / kGroup, 16}, fn, "d");
    if (q41) {
        check_tensor(*m, at::kHalf, fn, "m");
        check_shape(*m, {N / 16, K / kGroup, 16}, fn, "m");
    }
    check_rows(x, K, fn);
    auto y = at::empty({x.size(0), N}, x.options());
    auto d16 = reinterpret_cast<const uint16_t *>(d.data_ptr<at::Half>());
    int status = q41 ? q41_amx(x.data_ptr<float>(), x.size(0), K, codes.data_ptr<uint8_t>(), d16,
                               reinterpret_cast<const uint16_t *>(m->data_ptr<at::Half>()), N, y.data_ptr<float>(),
                               threads())
                     : q80_amx(x.data_ptr<float>(), x.size(0), K, codes.data_ptr<int8_t>(), d16, N,
                               y.data_ptr<float>(), threads());
    check_memory(status, fn);
    return y;
}

at::Tensor q41_amx_op(const at::Tensor &x, const at::Tensor &packed, const at::Tensor &d, const at::Tensor &m) {
    return amx_gemm_op("q41_amx", x, packed, d, &m);
}

at::Tensor q80_amx_op(const at::Tensor &x, const at::Tensor &codes, const at::Tensor &d) {
    return amx_gemm_op("q80_amx", x, codes, d, nullptr);
}

// ---- row operations and attention ------------------------------------------------------------------------------

at::Tensor rms_norm_rows_op(const at::Tensor &x, const at::Tensor &w, double eps) {  // x [..., D] -> [..., D]
    const char *fn = "rms_norm_rows";
    check_tensor(x, at::kFloat, fn, "x");
    TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 16 == 0, fn, ": x's last dimension must be a multiple of 16, got ",
                      x.sizes());
    int64_t D = x.size(-1);
    check_norm(w, D, fn, "weight");
    auto y = at::empty_like(x);
    rms_norm_rows(x.data_ptr<float>(), x.numel() / D, D, w.data_ptr<float>(), static_cast<float>(eps),
                  y.data_ptr<float>());
    return y;
}

std::tuple<at::Tensor, at::Tensor> rope_qk_op(const at::Tensor &qkv, int64_t H, int64_t Hkv, int64_t hd,
                                              const at::Tensor &cos, const at::Tensor &sin) {
    // qkv [..., N, (H + 2 Hkv) hd], cos and sin [..., N, hd] -> q [H, N, hd], k [Hkv, N, hd]
    const char *fn = "rope_qk";
    TORCH_CHECK_VALUE(H > 0 && Hkv > 0 && hd > 0 && hd % 32 == 0, fn, ": heads and kv_heads must be positive and ",
                      "head_dim a multiple of 32, got ", H, ", ", Hkv, ", ", hd);
    check_tensor(qkv, at::kFloat, fn, "qkv");
    int64_t width = (H + 2 * Hkv) * hd;
    TORCH_CHECK_VALUE(qkv.dim() >= 1 && qkv.size(-1) == width, fn, ": qkv's last dimension must be ", width, ", got ",
                      qkv.sizes());
    int64_t N = qkv.numel() / width;
    check_tensor(cos, at::kFloat, fn, "cos");
    check_tensor(sin, at::kFloat, fn, "sin");
    TORCH_CHECK_VALUE(cos.numel() == N * hd && sin.numel() == N * hd && cos.size(-1) == hd && sin.size(-1) == hd, fn,
                      ": cos and sin must hold [", N, ", ", hd, "], got ", cos.sizes(), " and ", sin.sizes());
    auto q = at::empty({H, N, hd}, qkv.options()), k = at::empty({Hkv, N, hd}, qkv.options());
    rope_qk(qkv.data_ptr<float>(), N, H, Hkv, hd, cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
            k.data_ptr<float>());
    return {q, k};
}

// keys and values [Hkv, T_max, hd] (rows of hd contiguous floats; a view of a longer buffer is read in place)
void check_cache(const at::Tensor &keys, const at::Tensor &values, int64_t Hkv, int64_t hd, const char *fn) {
    for (auto [t, name] : {std::pair{&keys, "keys"}, std::pair{&values, "values"}}) {
        TORCH_CHECK_VALUE(t->defined() && t->device().is_cpu(), fn, ": ", name, " must be a CPU tensor");
        TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, fn, ": ", name, " must be float, got ",
                         c10::toString(t->scalar_type()));
        TORCH_CHECK_VALUE(t->dim() == 3 && t->size(0) == Hkv && t->size(2) == hd && t->stride(2) == 1 &&
                              t->stride(1) == hd && t->stride(0) >= t->size(1) * hd,
                          fn, ": ", name, " must be [", Hkv, ", T, ", hd, "] with rows of ", hd,
                          " contiguous floats, got ", t->sizes(), " strides ", t->strides());
    }
    TORCH_CHECK_VALUE(keys.sizes() == values.sizes() && keys.strides() == values.strides(), fn,
                      ": keys and values must have the same shape and strides, got ", keys.sizes(), " ",
                      keys.strides(), " and ", values.sizes(), " ", values.strides());
}

void check_visible(const at::Tensor &visible, int64_t N, int64_t T, const char *fn) {
    check_tensor(visible, at::kBool, fn, "visible");
    check_shape(visible, {N, T}, fn, "visible");
}

struct AttentionShape {  // q [H, N, hd] over keys and values [Hkv, T, hd]
    int64_t H, N, hd, Hkv, T;
};

AttentionShape check_attention(const at::Tensor &q, const at::Tensor &keys, const at::Tensor &values, const char *fn) {
    check_tensor(q, at::kFloat, fn, "q");
    TORCH_CHECK_VALUE(q.dim() == 3 && q.size(2) % 16 == 0 && q.size(2) <= 256, fn,
                      ": q must be [H, N, hd] with hd a multiple of 16 up to 256, got ", q.sizes());
    int64_t H = q.size(0), N = q.size(1), hd = q.size(2);
    TORCH_CHECK_VALUE(keys.dim() == 3 && keys.size(0) > 0 && H % keys.size(0) == 0, fn,
                      ": keys must be [Hkv, T, hd] with Hkv dividing the ", H, " query heads, got ", keys.sizes());
    int64_t Hkv = keys.size(0), T = keys.size(1);
    check_cache(keys, values, Hkv, hd, fn);
    return {H, N, hd, Hkv, T};
}

at::Tensor attention_rows_op(const at::Tensor &q, const at::Tensor &keys, const at::Tensor &values,
                             const at::Tensor &visible, double scale, int64_t heads_together) {
    // q [H, N, hd], keys and values [Hkv, T, hd], visible bool [N, T] -> [N, H hd]; heads_together: how many query
    // heads of a key/value head one pass over its keys takes (1..MOST_HEADS; the same bits for each)
    const char *fn = "attention_rows";
    auto [H, N, hd, Hkv, T] = check_attention(q, keys, values, fn);
    check_visible(visible, N, T, fn);
    TORCH_CHECK_VALUE(1 <= heads_together && heads_together <= MOST_HEADS, fn, ": heads_together must be 1 to ",
                      MOST_HEADS, ", got ", heads_together);
    auto out = at::empty({N, H * hd}, q.options());
    check_memory(attention_rows(q.data_ptr<float>(), H, Hkv, N, hd, keys.data_ptr<float>(), values.data_ptr<float>(),
                                keys.stride(0), T, reinterpret_cast<const uint8_t *>(visible.data_ptr<bool>()),
                                static_cast<float>(scale), out.data_ptr<float>(), threads(), (int)heads_together),
                 fn);
    return out;
}

at::Tensor attention_spans_op(const at::Tensor &q, const at::Tensor &keys, const at::Tensor &values,
                              const at::Tensor &spans, double scale) {
    // q [H, N, hd], keys and values [Hkv, T, hd], spans int64 [N, 2]: row n sees keys [spans[n, 0], spans[n, 1])
    // -> [N, H hd]
    const char *fn = "attention_spans";
    auto [H, N, hd, Hkv, T] = check_attention(q, keys, values, fn);
    check_tensor(spans, at::kLong, fn, "spans");
    check_shape(spans, {N, 2}, fn, "spans");
    const int64_t *bounds = spans.data_ptr<int64_t>();
    for (int64_t n = 0; n < N; n++)
        TORCH_CHECK_VALUE(0 <= bounds[2 * n] && bounds[2 * n] < bounds[2 * n + 1] && bounds[2 * n + 1] <= T, fn,
                          ": row ", n, "'s span [", bounds[2 * n], ", ", bounds[2 * n + 1],
                          ") is empty or outside the ", T, " keys");
    auto out = at::empty({N, H * hd}, q.options());
    check_memory(attention_spans(q.data_ptr<float>(), H, Hkv, N, hd, keys.data_ptr<float>(), values.data_ptr<float>(),
                                 keys.stride(0), bounds, static_cast<float>(scale), out.data_ptr<float>(), threads()),
                 fn);
    return out;
}

// ---- a decoder layer's rows in two calls (decode.lean_decoder.FusedLayer) --------------------------------------

struct LayerShape {  // what the layer's matrices and the call's rows must agree on
    int64_t N, D, H, Hkv, hd;
};

template <typename Matrix>  // Q41Matrix or KQuantProjection
LayerShape check_layer(const at::Tensor &x, const Matrix &qkv, int64_t H, int64_t Hkv, int64_t hd, const Matrix &o,
                       const Matrix &gate_up, const char *fn) {
    check_tensor(x, at::kFloat, fn, "x");
    TORCH_CHECK_VALUE(x.dim() == 3 && x.size(0) == 1 && x.size(1) >= 1 && x.size(1) <= kMaxRows, fn,
                      ": x must be [1, 1..", kMaxRows, ", D], got ", x.sizes());
    int64_t N = x.size(1), D = x.size(2);
    TORCH_CHECK_VALUE(D % 16 == 0 && hd % 32 == 0 && H > 0 && Hkv > 0 && H % Hkv == 0 && hd <= 256, fn,
                      ": D must be a multiple of 16, head_dim of 32 (at most 256) and kv_heads must divide heads, got ",
                      "D ", D, ", head_dim ", hd, ", heads ", H, ", kv_heads ", Hkv);
    TORCH_CHECK_VALUE(qkv.K == D && qkv.N == (H + 2 * Hkv) * hd, fn, ": qkv must be [", (H + 2 * Hkv) * hd, ", ", D,
                      "], got [", qkv.N, ", ", qkv.K, "]");
    TORCH_CHECK_VALUE(o.K == H * hd && o.N == D, fn, ": o must be [", D, ", ", H * hd, "], got [", o.N, ", ", o.K, "]");
    TORCH_CHECK_VALUE(gate_up.K == D && gate_up.N % 2 == 0, fn, ": gate_up must be [2I, ", D, "], got [", gate_up.N,
                      ", ", gate_up.K, "]");
    return {N, D, H, Hkv, hd};
}

template <typename Matrix>
std::tuple<at::Tensor, at::Tensor> layer_rows_attention_op(
    const at::Tensor &x, const at::Tensor &norm_in, double eps_in, const Matrix &qkv, int64_t H, int64_t Hkv,
    int64_t hd, const at::Tensor &cos, const at::Tensor &sin, const at::Tensor &keys, const at::Tensor &values,
    int64_t start, const at::Tensor &visible, double scale, const Matrix &o, const at::Tensor &norm_post,
    double eps_post, const Matrix &gate_up, at::Tensor &work) {
    // x [1, N, D] -> (x + attention [1, N, D], gate_up(rms_norm(that)) [N, 2I]); the rows' keys and values written
    // to keys/values [Hkv, T_max, hd] at start..start+N-1; visible bool [N, T], T <= T_max
    const char *fn = "layer_rows_attention";
    auto s = check_layer(x, qkv, H, Hkv, hd, o, gate_up, fn);
    check_norm(norm_in, s.D, fn, "norm_in");
    check_norm(norm_post, s.D, fn, "norm_post");
    check_cache(keys, values, Hkv, hd, fn);
    TORCH_CHECK_VALUE(start >= 0 && start + s.N <= keys.size(1), fn, ": rows ", start, "..", start + s.N,
                      " do not fit a cache of ", keys.size(1));
    TORCH_CHECK_VALUE(visible.dim() == 2 && visible.size(1) >= start + s.N && visible.size(1) <= keys.size(1), fn,
                      ": visible must see at least the ", start + s.N, " keys written and at most the cache's ",
                      keys.size(1), ", got ", visible.sizes());
    check_visible(visible, s.N, visible.size(1), fn);
    for (auto [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
        check_tensor(*t, at::kFloat, fn, name);
        TORCH_CHECK_VALUE(t->numel() == s.N * hd && t->size(-1) == hd, fn, ": ", name, " must hold [", s.N, ", ", hd,
                          "], got ", t->sizes());
    }
    int64_t width = (H + 2 * Hkv) * hd;
    check_tensor(work, at::kFloat, fn, "work");
    TORCH_CHECK_VALUE(work.numel() >= s.N * (s.D + width + H * hd + Hkv * hd + H * hd), fn, ": work holds ",
                      work.numel(), " floats, ", s.N * (s.D + width + H * hd + Hkv * hd + H * hd), " needed");
    at::Tensor y = at::empty({1, s.N, s.D}, x.options()), both = at::empty({s.N, gate_up.N}, x.options());
    check_memory(layer_rows_attention(x.data_ptr<float>(), s.N, s.D, norm_in.data_ptr<float>(),
                                      static_cast<float>(eps_in), qkv.raw(), H, Hkv, hd, cos.data_ptr<float>(),
                                      sin.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
                                      keys.stride(0), start, visible.size(1),
                                      reinterpret_cast<const uint8_t *>(visible.data_ptr<bool>()),
                                      static_cast<float>(scale), o.raw(), norm_post.data_ptr<float>(),
                                      static_cast<float>(eps_post), gate_up.raw(), y.data_ptr<float>(),
                                      both.data_ptr<float>(), work.data_ptr<float>(), threads()),
                 fn);
    return {y, both};
}

template <typename Matrix>
void layer_rows_down_op(at::Tensor &y, const at::Tensor &activated, const Matrix &down, at::Tensor &work) {
    // y [1, N, D] += down(activated [N, I]), in place
    const char *fn = "layer_rows_down";
    check_tensor(y, at::kFloat, fn, "y");
    TORCH_CHECK_VALUE(y.dim() == 3 && y.size(0) == 1 && y.size(1) <= kMaxRows && y.size(2) == down.N, fn,
                      ": y must be [1, 1..", kMaxRows, ", ", down.N, "], got ", y.sizes());
    check_tensor(activated, at::kFloat, fn, "activated");
    check_shape(activated, {y.size(1), down.K}, fn, "activated");
    check_tensor(work, at::kFloat, fn, "work");
    TORCH_CHECK_VALUE(work.numel() >= y.size(1) * down.N, fn, ": work holds ", work.numel(), " floats, ",
                      y.size(1) * down.N, " needed");
    check_memory(layer_rows_down(y.data_ptr<float>(), y.size(1), down.N, activated.data_ptr<float>(), down.K,
                                 down.raw(), work.data_ptr<float>(), threads()),
                 fn);
}

// ---- the EAGLE-3 drafter's rows and head (decode.lean_eagle3.FusedRows) -----------------------------------------

at::Tensor eagle3_rows_op(const at::Tensor &embeds, const at::Tensor &states, const at::Tensor &norm_embed,
                          double eps_embed, const at::Tensor &norm_state, double eps_state, const Int8Matrix &qkv,
                          int64_t H, int64_t Hkv, int64_t hd, const at::Tensor &cos_table,
                          const at::Tensor &sin_table, const at::Tensor &positions, const at::Tensor &keys,
                          const at::Tensor &values, int64_t start, const at::Tensor &visible, double scale,
                          const Int8Matrix &o, const at::Tensor &norm_post, double eps_post,
                          const Int8Matrix &gate_up, const Int8Matrix &down) {
    // embeds, states [N, D]; positions int64 [N] into the tables [P, hd]; the rows' keys and values appended to
    // keys/values [Hkv, capacity, hd] at start..start+N-1; visible bool [N, start + N] -> out [N, D]
    const char *fn = "eagle3_rows";
    check_tensor(states, at::kFloat, fn, "states");
    TORCH_CHECK_VALUE(states.dim() == 2 && states.size(0) >= 1 && states.size(0) <= kMaxRows, fn,
                      ": states must be [1..", kMaxRows, ", D], got ", states.sizes());
    int64_t N = states.size(0), D = states.size(1), I = down.K;
    check_tensor(embeds, at::kFloat, fn, "embeds");
    check_shape(embeds, {N, D}, fn, "embeds");
    TORCH_CHECK_VALUE(D % 16 == 0 && I % 16 == 0 && hd % 32 == 0 && hd <= 256 && H > 0 && Hkv > 0 && H % Hkv == 0, fn,
                      ": D and I must be multiples of 16, head_dim of 32 (at most 256), kv_heads must divide heads");
    check_norm(norm_embed, D, fn, "norm_embed");
    check_norm(norm_state, D, fn, "norm_state");
    check_norm(norm_post, D, fn, "norm_post");
    TORCH_CHECK_VALUE(qkv.K == 2 * D && qkv.N == (H + 2 * Hkv) * hd && o.K == H * hd && o.N == D && gate_up.K == D &&
                          gate_up.N == 2 * I && down.N == D,
                      fn, ": the matrices do not fit D ", D, ", heads ", H, ", kv_heads ", Hkv, ", head_dim ", hd,
                      ", I ", I);
    for (auto [t, name] : {std::pair{&cos_table, "cos"}, std::pair{&sin_table, "sin"}}) {
        check_tensor(*t, at::kFloat, fn, name);
        TORCH_CHECK_VALUE(t->dim() == 2 && t->size(1) == hd, fn, ": ", name, " must be [P, ", hd, "], got ",
                          t->sizes());
    }
    TORCH_CHECK_VALUE(cos_table.sizes() == sin_table.sizes(), fn, ": cos and sin tables differ in shape");
    check_tensor(positions, at::kLong, fn, "positions");
    check_shape(positions, {N}, fn, "positions");
    auto p = positions.data_ptr<int64_t>();
    for (int64_t r = 0; r < N; r++)
        TORCH_CHECK_VALUE(p[r] >= 0 && p[r] < cos_table.size(0), fn, ": position ", p[r], " is outside the ",
                          cos_table.size(0), " rows of the rotary tables");
    check_cache(keys, values, Hkv, hd, fn);
    TORCH_CHECK_VALUE(start >= 0 && start + N <= keys.size(1), fn, ": rows ", start, "..", start + N,
                      " do not fit a cache of ", keys.size(1));
    check_visible(visible, N, start + N, fn);
    auto out = at::empty({N, D}, states.options());
    check_memory(eagle3_rows(embeds.data_ptr<float>(), states.data_ptr<float>(), N, D, norm_embed.data_ptr<float>(),
                             static_cast<float>(eps_embed), norm_state.data_ptr<float>(),
                             static_cast<float>(eps_state), qkv.raw(), H, Hkv, hd, cos_table.data_ptr<float>(),
                             sin_table.data_ptr<float>(), p, keys.data_ptr<float>(), values.data_ptr<float>(),
                             keys.stride(0), start, reinterpret_cast<const uint8_t *>(visible.data_ptr<bool>()),
                             static_cast<float>(scale), o.raw(), norm_post.data_ptr<float>(),
                             static_cast<float>(eps_post), gate_up.raw(), I, down.raw(), out.data_ptr<float>(),
                             threads()),
                 fn);
    return out;
}

std::tuple<at::Tensor, at::Tensor> eagle3_top_op(const at::Tensor &out, const at::Tensor &norm_out, double eps_out,
                                                 const Int8Matrix &head, int64_t topk) {
    // out [N, D] -> each row's topk log-probabilities under the head [N, topk] (descending) and their indices
    const char *fn = "eagle3_top";
    check_tensor(out, at::kFloat, fn, "out");
    TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) >= 1 && out.size(0) <= kMaxRows && out.size(1) == head.K &&
                          head.K % 16 == 0,
                      fn, ": out must be [1..", kMaxRows, ", ", head.K, "], got ", out.sizes());
    TORCH_CHECK_VALUE(topk >= 1 && topk <= head.N, fn, ": topk must be in 1..", head.N, ", got ", topk);
    check_norm(norm_out, head.K, fn, "norm_out");
    int64_t N = out.size(0);
    auto values = at::empty({N, topk}, out.options());
    auto indices = at::empty({N, topk}, out.options().dtype(at::kLong));
    check_memory(eagle3_top(out.data_ptr<float>(), N, head.K, norm_out.data_ptr<float>(), static_cast<float>(eps_out),
                            head.raw(), topk, values.data_ptr<float>(), indices.data_ptr<int64_t>(), threads()),
                 fn);
    return {values, indices};
}

// ---- the greedy head ---------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> q8_argmax_op(const at::Tensor &x, const Int8Matrix &head,
                                                const at::Tensor &slack) {
    // x [R, K] -> (each row's argmax int64 [R], -1 for a row with a NaN; outputs computed exactly int32 [R])
    const char *fn = "q8_argmax";
    check_rows(x, head.K, fn);
    check_tensor(slack, at::kFloat, fn, "slack");
    check_shape(slack, {head.N / 16, head.K / kGroup, 16}, fn, "slack");
    int64_t R = x.size(0);
    auto tokens = at::empty({R}, x.options().dtype(at::kLong));
    auto candidates = at::empty({R}, x.options().dtype(at::kInt));
    check_memory(q8_argmax(x.data_ptr<float>(), R, head.K, head.codes.data_ptr<int8_t>(), head.d.data_ptr<float>(),
                           head.bias.data_ptr<int32_t>(), slack.data_ptr<float>(), head.N,
                           tokens.data_ptr<int64_t>(), candidates.data_ptr<int32_t>(), threads()),
                 fn);
    return {tokens, candidates};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "specdistill's CPU kernels (AVX-512): see models/kernels/csrc/cpu_kernels.h";
    m.attr("MAX_ROWS") = kMaxRows;
    namespace py = pybind11;
    py::class_<Q41Matrix>(m, "Q41Matrix")
        .def(py::init<at::Tensor, at::Tensor, at::Tensor>(), py::arg("packed"), py::arg("d"), py::arg("m"))
        .def_readonly("N", &Q41Matrix::N)
        .def_readonly("K", &Q41Matrix::K)
        .def("gemm", &Q41Matrix::gemm, py::arg("x"));
    py::class_<Int8Matrix>(m, "Int8Matrix")
        .def(py::init<at::Tensor, at::Tensor, at::Tensor>(), py::arg("codes"), py::arg("d"), py::arg("bias"))
        .def_readonly("N", &Int8Matrix::N)
        .def_readonly("K", &Int8Matrix::K)
        .def("gemm", &Int8Matrix::gemm, py::arg("x"));
    py::class_<Q4KMatrix>(m, "Q4KMatrix")
        .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(), py::arg("codes"), py::arg("sc"),
             py::arg("m"), py::arg("d"), py::arg("dmin"))
        .def_readonly("N", &Q4KMatrix::N)
        .def_readonly("K", &Q4KMatrix::K)
        .def("gemm_into", &Q4KMatrix::gemm_into, py::arg("q"), py::arg("d"), py::arg("sums"), py::arg("y"),
             py::arg("column"), py::arg("tile_rows") = 0);
    py::class_<Q6KMatrix>(m, "Q6KMatrix")
        .def(py::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(), py::arg("low"), py::arg("high"),
             py::arg("sc"), py::arg("d"))
        .def_readonly("N", &Q6KMatrix::N)
        .def_readonly("K", &Q6KMatrix::K)
        .def("gemm_into", &Q6KMatrix::gemm_into, py::arg("q"), py::arg("d"), py::arg("sums"), py::arg("y"),
             py::arg("column"), py::arg("tile_rows") = 0);
    py::class_<Q50Matrix>(m, "Q50Matrix")
        .def(py::init<at::Tensor, at::Tensor, at::Tensor>(), py::arg("low"), py::arg("high"), py::arg("d"))
        .def_readonly("N", &Q50Matrix::N)
        .def_readonly("K", &Q50Matrix::K)
        .def("gemm", &Q50Matrix::gemm, py::arg("x"));
    py::class_<Q80Matrix>(m, "Q80Matrix")
        .def(py::init<at::Tensor, at::Tensor>(), py::arg("codes"), py::arg("d"))
        .def_readonly("N", &Q80Matrix::N)
        .def_readonly("K", &Q80Matrix::K)
        .def("gemm", &Q80Matrix::gemm, py::arg("x"));
    m.def("quantize_rows_q8k", &quantize_rows_q8k_op, py::arg("x"));
    m.def("q80_gemm", &q80_gemm_op, py::arg("x"), py::arg("codes"), py::arg("d"));
    m.def("q41_amx", &q41_amx_op, py::arg("x"), py::arg("packed"), py::arg("d"), py::arg("m"));
    m.def("q80_amx", &q80_amx_op, py::arg("x"), py::arg("codes"), py::arg("d"));
    m.def("amx_request", &amx_request);
    m.def("rms_norm_rows", &rms_norm_rows_op, py::arg("x"), py::arg("weight"), py::arg("eps"));
    m.def("rope_qk", &rope_qk_op, py::arg("qkv"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
          py::arg("cos"), py::arg("sin"));
    m.def("attention_rows", &attention_rows_op, py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("visible"),
          py::arg("scale"), py::arg("heads_together") = MOST_HEADS);
    m.def("attention_spans", &attention_spans_op, py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("spans"),
          py::arg("scale"));
    py::class_<KQuantProjection>(m, "KQuantProjection")
        .def(py::init<std::vector<py::object>, c10::optional<at::Tensor>, int64_t>(), py::arg("parts"),
             py::arg("bias"), py::arg("tile_rows") = 0)
        .def_readonly("tile_rows", &KQuantProjection::tile_rows)
        .def_readonly("N", &KQuantProjection::N)
        .def_readonly("K", &KQuantProjection::K)
        .def("gemm", &KQuantProjection::gemm, py::arg("x"));
    m.def("layer_rows_attention", &layer_rows_attention_op<Q41Matrix>);
    m.def("layer_rows_attention", &layer_rows_attention_op<KQuantProjection>);
    m.def("layer_rows_down", &layer_rows_down_op<Q41Matrix>);
    m.def("layer_rows_down", &layer_rows_down_op<KQuantProjection>);
    m.def("eagle3_rows", &eagle3_rows_op);
    m.def("eagle3_top", &eagle3_top_op);
    m.def("q8_argmax", &q8_argmax_op, py::arg("x"), py::arg("head"), py::arg("slack"));
}
