// RMSNorm of float32 rows on a CPU with the bits of torch's own (`F.rms_norm`, i.e. transformers'
// LlamaRMSNorm), in one call instead of torch's seven operators (pow, sum, div, add, rsqrt, mul,
// mul: ~30 us a row of 576 at one thread, most of it operator overhead), and the residual add
// before it fused in (`add_rms_norm`).
//
// torch computes, per row x [n]:  s = sum(x * x) (its cascade sum, below), m = s / n,
// r = 1 / sqrt(m + eps), y = (x * r) * w, every step rounded to float32. The sum is
// ATen's `cascade_sum` for a contiguous inner reduction with float accumulators: the row read as
// n / L vectors of L lanes (L = ATen's float vector width on this CPU: 8 for AVX2, 16 for
// AVX-512), those vectors summed 4 interleaved chains at a time in levels of 16 (`multi_row_sum`,
// `row_sum`), the n % L tail elements added to 0, then the L lanes of the vector sum in order.
// `lanes` is given by the caller, which checks the bits against torch at first use
// (`dspark.models.fused_norm`). Compiled with -ffp-contract=off: no multiply-add is fused.
//
// Shapes: x, residual, out [rows, n] float32 contiguous; w [n] float32.

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kMaxLanes = 16;
constexpr int kIlp = 4;      // row_sum's interleaved chains
constexpr int kLevels = 4;   // multi_row_sum's levels

struct Lanes {
  float v[kMaxLanes];
};

inline int ceil_log2(int64_t x) {  // c10 utils::CeilLog2
  if (x <= 2) return 1;
  int bits = 0;
  for (uint64_t y = static_cast<uint64_t>(x) - 1; y; y >>= 1) ++bits;
  return bits;
}

// sum of sq[0 .. n) as ATen's vectorized_inner_sum with L lanes
template <int L>
float cascade_sum(const float* sq, int64_t n) {
  const int64_t nvec = n / L;
  const int64_t size = nvec / kIlp;  // multi_row_sum over `size` rows of kIlp vectors
  const int level_power = std::max(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  Lanes acc[kLevels][kIlp];
  for (auto& level : acc)
    for (auto& chain : level) std::fill(chain.v, chain.v + L, 0.f);
  auto add_vec = [&](Lanes& a, int64_t vec_index) {
    const float* p = sq + vec_index * L;
    for (int l = 0; l < L; ++l) a.v[l] += p[l];
  };
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], i * kIlp + k);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < L; ++l) {
          acc[j][k].v[l] += acc[j - 1][k].v[l];
          acc[j - 1][k].v[l] = 0.f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < kIlp; ++k) add_vec(acc[0][k], i * kIlp + k);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < L; ++l) acc[0][k].v[l] += acc[j][k].v[l];
  // row_sum: the vectors past size * kIlp into chain 0, then the chains in order
  for (int64_t v = size * kIlp; v < nvec; ++v) add_vec(acc[0][0], v);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < L; ++l) acc[0][0].v[l] += acc[0][k].v[l];
  float total = 0.f;
  for (int64_t e = nvec * L; e < n; ++e) total += sq[e];
  for (int l = 0; l < L; ++l) total += acc[0][0].v[l];
  return total;
}

template <int L>
void norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  std::vector<float> sq(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = out + r * n;
    for (int64_t e = 0; e < n; ++e) sq[e] = xr[e] * xr[e];
    const float mean = cascade_sum<L>(sq.data(), n) / static_cast<float>(n);
    const float root = std::sqrt(mean + eps);
    const float inv = 1.f / root;
    for (int64_t e = 0; e < n; ++e) {
      const float scaled = xr[e] * inv;
      yr[e] = scaled * w[e];
    }
  }
}

void check(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, what, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), what, ": x [rows, n] contiguous");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), what, ": w [n] contiguous");
}

void run(const float* x, const float* w, float* out, int64_t rows, int64_t n, double eps, int64_t lanes) {
  const float feps = static_cast<float>(eps);
  if (lanes == 8) {
    norm_rows<8>(x, w, out, rows, n, feps);
  } else {
    TORCH_CHECK(lanes == 16, "rms_norm: lanes must be 8 or 16");
    norm_rows<16>(x, w, out, rows, n, feps);
  }
}

// out = RMSNorm(x) * w
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, int64_t lanes) {
  check(x, w, "rms_norm");
  auto out = torch::empty_like(x);
  run(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps, lanes);
  return out;
}

// (h, RMSNorm(h) * w) with h = x + residual (the decoder layer's residual add, then its next norm)
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                        const torch::Tensor& w, double eps, int64_t lanes) {
  check(x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == torch::kFloat32 &&
              residual.is_contiguous() && residual.device().is_cpu(), "add_rms_norm: residual like x");
  auto h = torch::empty_like(x);
  const float* a = x.data_ptr<float>();
  const float* b = residual.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  for (int64_t e = 0; e < x.numel(); ++e) hp[e] = a[e] + b[e];
  auto out = torch::empty_like(x);
  run(hp, w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps, lanes);
  return {h, out};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows with torch's bits (lanes: ATen's float vector width)");
  m.def("add_rms_norm", &add_rms_norm, "h = x + residual, then (h, RMSNorm(h)), float32");
}
