// bf16-weight linear for x86 CPUs with AVX2+FMA but no bf16 dot products (model/avx2_bf16.py builds it).
//
// y = x @ w^T (+ bias): bf16 in and out, fp32 products and sums, one rounding to bf16 at the end, as F.linear's
// bf16 path does. The weight is stored in groups of 32 output columns, each k-row of a group one 64-byte cache
// line (zero-padded), and read once per call whatever the number of rows: one sequential stream per thread, as
// a GEMV reads. Up to 6 rows (a verify pass) it is widened to fp32 in registers as it streams; past 6, each group
// is widened once into a scratch buffer that serves every 6-row tile. Every output column's sum runs k = 0..K-1
// in order whatever the tile, so a row gets the same bits in a pass of any length.
//
// Only the kernels carry target("avx2,fma"): the module itself loads on any x86 CPU, and Python calls into it
// only where the CPU has both.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int NR = 16;     // output columns per tile panel (two ymm registers of fp32 sums per row)
constexpr int GROUP = 2;   // panels stored interleaved: one k-row of a group is 32 bf16, one 64-byte cache line
constexpr int GW = NR * GROUP;
constexpr int MR = 6;      // rows per tile: 12 accumulators + 2 weight vectors + 1 broadcast in 16 ymm registers

#define DS_AVX2 __attribute__((target("avx2,fma")))

DS_AVX2 inline __m256 load_bf16(const uint16_t *p) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet).
DS_AVX2 inline __m128i to_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), _mm256_castps_si256(nan));
    r = _mm256_srli_epi32(r, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <bool F32>
DS_AVX2 inline __m256 load_w(const void *w, int64_t i) {
    if constexpr (F32) return _mm256_loadu_ps(static_cast<const float *>(w) + i);
    else return load_bf16(static_cast<const uint16_t *>(w) + i);
}

// ROWS rows x PANELS panels of 16 columns, from panel j0 of a group (w: the group, GW values per k). Every
// column's sum runs k = 0..K-1 from zero whatever the tile, which gives a row the same bits in a pass of any
// length. F32: the group was widened to fp32 already. Columns at or past N are padding and are not stored.
template <int ROWS, int PANELS, bool F32>
DS_AVX2 inline void tile(int64_t K, const float *x, const void *w, int j0, const float *bias, int64_t n0, int64_t N,
                         uint16_t *y) {
    __m256 acc[ROWS][2 * PANELS];
#pragma GCC unroll 8
    for (int i = 0; i < ROWS; i++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * PANELS; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
#pragma GCC unroll 8
        for (int j = 0; j < PANELS; j++) {
            int64_t at = k * GW + (j0 + j) * NR;
            __m256 w0 = load_w<F32>(w, at), w1 = load_w<F32>(w, at + 8);
#pragma GCC unroll 8
            for (int i = 0; i < ROWS; i++) {
                __m256 xb = _mm256_broadcast_ss(x + i * K + k);
                acc[i][2 * j] = _mm256_fmadd_ps(xb, w0, acc[i][2 * j]);
                acc[i][2 * j + 1] = _mm256_fmadd_ps(xb, w1, acc[i][2 * j + 1]);
            }
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < PANELS; j++) {
        int64_t n = n0 + (j0 + j) * NR, ncols = std::min<int64_t>(NR, N - n);
        if (ncols <= 0) break;
        __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
        if (bias) {
            float tmp[NR] = {0};
            std::memcpy(tmp, bias + n, ncols * sizeof(float));
            b0 = _mm256_loadu_ps(tmp);
            b1 = _mm256_loadu_ps(tmp + 8);
        }
#pragma GCC unroll 8
        for (int i = 0; i < ROWS; i++) {
            uint16_t out[NR];
            _mm_storeu_si128(reinterpret_cast<__m128i *>(out), to_bf16(_mm256_add_ps(acc[i][2 * j], b0)));
            _mm_storeu_si128(reinterpret_cast<__m128i *>(out + 8), to_bf16(_mm256_add_ps(acc[i][2 * j + 1], b1)));
            std::memcpy(y + i * N + n, out, ncols * sizeof(uint16_t));
        }
    }
}

// 1..6 rows on a whole group. Up to 3 rows one tile covers the group, so each cache line of the weight is read
// once, in order; 4..6 rows take a second pass over the half-lines the first one brought into cache.
template <bool F32>
DS_AVX2 inline void group_tiles(int64_t rows, int64_t K, const float *x, const void *w, const float *bias,
                                int64_t n0, int64_t N, uint16_t *y) {
    switch (rows) {
        case 1: tile<1, 2, F32>(K, x, w, 0, bias, n0, N, y); return;
        case 2: tile<2, 2, F32>(K, x, w, 0, bias, n0, N, y); return;
        case 3: tile<3, 2, F32>(K, x, w, 0, bias, n0, N, y); return;
        case 4: for (int j = 0; j < GROUP; j++) tile<4, 1, F32>(K, x, w, j, bias, n0, N, y); return;
        case 5: for (int j = 0; j < GROUP; j++) tile<5, 1, F32>(K, x, w, j, bias, n0, N, y); return;
        default: for (int j = 0; j < GROUP; j++) tile<6, 1, F32>(K, x, w, j, bias, n0, N, y); return;
    }
}

// One group for all M rows. Up to 6 rows (a verify pass) the bf16 weights are widened in registers as they
// stream; past 6 the group is widened once into ``scratch`` (K x 32 fp32, in L1/L2) and serves every 6-row tile.
DS_AVX2 void group(int64_t M, int64_t K, int64_t N, const float *x, const uint16_t *wp, const float *bias,
                   int64_t g, float *scratch, uint16_t *y) {
    const uint16_t *w = wp + g * K * GW;
    int64_t n0 = g * GW;
    if (M <= MR) return group_tiles<false>(M, K, x, w, bias, n0, N, y);
    for (int64_t i = 0; i < K * GW; i += 8) _mm256_storeu_ps(scratch + i, load_bf16(w + i));
    for (int64_t m = 0; m < M; m += MR)
        group_tiles<true>(std::min<int64_t>(MR, M - m), K, x + m * K, scratch, bias, n0, N, y + m * N);
}

}  // namespace

// w (N x K bf16) -> ceil(N/32) groups of K rows of 32 columns (2 panels of 16), zero-padded: what `linear` reads.
torch::Tensor pack(torch::Tensor w) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.device().is_cpu(), "pack: w must be a 2-D "
                "bf16 CPU tensor");
    w = w.contiguous();
    int64_t N = w.size(0), K = w.size(1), ng = (N + GW - 1) / GW;
    auto wp = torch::zeros({ng * K * GW}, w.options());
    const auto *src = reinterpret_cast<const uint16_t *>(w.data_ptr<at::BFloat16>());
    auto *dst = reinterpret_cast<uint16_t *>(wp.data_ptr<at::BFloat16>());
    at::parallel_for(0, ng, 1, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; g++)
            for (int64_t c = 0; c < GW && g * GW + c < N; c++)
                for (int64_t k = 0; k < K; k++) dst[(g * K + k) * GW + c] = src[(g * GW + c) * K + k];
    });
    return wp;
}

// y (M x N bf16) = x (M x K bf16) @ w^T + bias (fp32, or an empty tensor for none); wp from `pack`.
torch::Tensor linear(torch::Tensor x, torch::Tensor wp, torch::Tensor bias, int64_t N) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.device().is_cpu(), "linear: x must be a 2-D "
                "bf16 CPU tensor");
    int64_t M = x.size(0), K = x.size(1), ng = (N + GW - 1) / GW;
    TORCH_CHECK(wp.numel() == ng * K * GW, "linear: packed weight does not match x's width and N");
    TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.scalar_type() == torch::kFloat32),
                "linear: bias must be N fp32 values or empty");
    auto xf = x.to(torch::kFloat32).contiguous();
    auto bc = bias.contiguous();
    auto y = torch::empty({M, N}, x.options());
    const float *xp = xf.data_ptr<float>();
    const float *bp = bc.numel() ? bc.data_ptr<float>() : nullptr;
    const auto *w = reinterpret_cast<const uint16_t *>(wp.data_ptr<at::BFloat16>());
    auto *out = reinterpret_cast<uint16_t *>(y.data_ptr<at::BFloat16>());
    at::parallel_for(0, ng, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(M > MR ? K * GW : 0);
        for (int64_t g = begin; g < end; g++) group(M, K, N, xp, w, bp, g, scratch.data(), out);
    });
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("pack", &pack, "pack a bf16 weight into interleaved groups of 32 columns");
    m.def("linear", &linear, "bf16 linear on packed groups, fp32 sums");
}
