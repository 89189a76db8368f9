// The CPU compute backend: the host kernels of kernels.hpp, OpenBLAS, and oneDNN for bf16 GEMMs
// and for the fp32 GEMMs of attention's kv heads run in parallel (bf16_gemm.hpp), on host
// memory. Both CPU devices run the same operations, so they train to the same bits.
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cpu/bf16_gemm.hpp"
#include "engine/device/cpu/kernels.hpp"
#include "engine/device/device.hpp"
#include "engine/device/kernel_math.hpp"

namespace outcore::device {
namespace {

class CpuBackend final : public ComputeBackend {
 public:
  std::string name() const override { return "cpu"; }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
  }
  void upload(void* dst, const void* host, size_t bytes) override { copy(dst, host, bytes); }
  void download(void* host, const void* src, size_t bytes) override { copy(host, src, bytes); }
  const float* constant(std::span<const float> host) override { return host.data(); }
  const int32_t* stage_ids(const int32_t* host, int64_t, int) override { return host; }
  void finish() override {}

  void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc) override {
    // In attention's kv heads run in parallel (SerialGemms): each on its thread alone.
    if (cpu::serial_gemms_here())
      return cpu::gemm_f32_serial(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    cpu::gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  // bf16 operands, fp32 accumulation: oneDNN on bf16 hardware, else widened for sgemm
  // (bf16_gemm.hpp).
  void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const void* a, int64_t lda, const void* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) override {
    cpu::gemm_bf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  // The element-wise, row-wise and column-wise kernels below run on oneTBB's threads in ranges
  // that change no bit (in_ranges): an element's or a row's result depends on it alone, and a
  // column's (RMSNorm's weight gradient, the embedding's gradient) sums every row in order.
  void to_fp32(const void* src, DType dtype, float* dst, int64_t n) override {
    const size_t es = dtype_size(dtype);
    in_ranges(n, 1, [&](int64_t i, int64_t m) {
      cpu::to_fp32(static_cast<const std::byte*>(src) + i * es, dtype, dst + i, m);
    });
  }
  void from_fp32(const float* src, void* dst, DType dtype, int64_t n) override {
    const size_t es = dtype_size(dtype);
    in_ranges(n, 1, [&](int64_t i, int64_t m) {
      cpu::from_fp32(src + i, static_cast<std::byte*>(dst) + i * es, dtype, m);
    });
  }
  void add_inplace(float* y, const float* x, int64_t n) override {
    in_ranges(n, 1, [&](int64_t i, int64_t m) { cpu::add_inplace(y + i, x + i, m); });
  }
  void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale) override {
    in_ranges(rows, cols,
              [&](int64_t r, int64_t m) { cpu::scale_rows(x + r * ld, m, cols, ld, scale + r); });
  }
  void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim,
                       float* y, float* rstd, void* y_bf16) override {
    in_ranges(rows, dim, [&](int64_t r, int64_t m) {
      cpu::rmsnorm_forward(x + r * dim, w, eps, m, dim, y == nullptr ? nullptr : y + r * dim,
                           rstd + r,
                           y_bf16 == nullptr ? nullptr : static_cast<uint16_t*>(y_bf16) + r * dim);
    });
  }
  void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                        int64_t rows, int64_t dim, float* dx, float* dw) override {
    // Two passes read the rows twice: worth it from about 2^20 elements (cpu_kernels_bench on
    // 2 threads, against the one pass: 1.2x at 4096 x 512, 1.5x at 4096 x 2048 and 4096 x 4096,
    // 0.94-1.04x at 256 x 512 and 1024 x 512).
    if (rows * dim < (int64_t{1} << 20))
      return cpu::rmsnorm_backward(dy, x, w, rstd, rows, dim, dx, dw);
    // Each row's coefficient, then dx and dw by columns, each column summing its rows in order.
    std::vector<float> coef(static_cast<size_t>(rows));
    in_ranges(rows, dim, [&](int64_t r, int64_t m) {
      cpu::rmsnorm_backward_coef(dy + r * dim, x + r * dim, w, rstd + r, m, dim, coef.data() + r);
    });
    in_column_ranges(dim, rows, [&](int64_t j, int64_t m) {
      cpu::rmsnorm_backward_columns(dy + j, x + j, w + j, rstd, coef.data(), rows, dim, m, dx + j,
                                    dw + j);
    });
  }
  void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin, bool inverse, void* x_bf16) override {
    const int64_t width = heads * head_dim;
    in_ranges(rows, width, [&](int64_t r, int64_t m) {
      cpu::rope(x + r * width, m, seq, heads, head_dim, cos, sin, inverse,
                x_bf16 == nullptr ? nullptr : static_cast<uint16_t*>(x_bf16) + r * width, r);
    });
  }
  void swiglu_forward(const float* g, const float* u, float* a, int64_t n, void* a_bf16) override {
    in_ranges(n, 1, [&](int64_t i, int64_t m) {
      cpu::swiglu_forward(g + i, u + i, a == nullptr ? nullptr : a + i, m,
                          a_bf16 == nullptr ? nullptr : static_cast<uint16_t*>(a_bf16) + i);
    });
  }
  void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                       int64_t n, void* dg_bf16, void* du_bf16) override {
    auto* dg16 = static_cast<uint16_t*>(dg_bf16);
    auto* du16 = static_cast<uint16_t*>(du_bf16);
    in_ranges(n, 1, [&](int64_t i, int64_t m) {
      cpu::swiglu_backward(
          da + i, g + i, u + i, dg == nullptr ? nullptr : dg + i, du == nullptr ? nullptr : du + i,
          m, dg16 == nullptr ? nullptr : dg16 + i, du16 == nullptr ? nullptr : du16 + i);
    });
  }

  void causal_softmax_forward(float* scores, float* lse, int64_t rows, int64_t keys,
                              int64_t first_query, float* inv_sum) override {
    in_ranges(rows, keys, [&](int64_t first, int64_t count) {
      for (int64_t i = first; i < first + count; ++i) {
        float* row = scores + i * keys;
        const int64_t n = kmath::causal_keys(first_query + i);
        lse[i] = inv_sum != nullptr ? cpu::softmax_numerators(row, n, inv_sum + i)
                                    : cpu::softmax_inplace(row, n);
        std::fill(row + n, row + keys, 0.0f);
      }
    });
  }

  void causal_softmax_backward(float* scores, float* dp, const float* lse, int64_t rows,
                               int64_t keys, int64_t first_query, const float* delta) override {
    in_ranges(rows, keys, [&](int64_t first, int64_t count) {
      for (int64_t i = first; i < first + count; ++i) {
        float* pr = scores + i * keys;
        float* dr = dp + i * keys;
        const int64_t n = kmath::causal_keys(first_query + i);
        cpu::exp_shift(pr, lse[i], n);
        std::fill(pr + n, pr + keys, 0.0f);
        const float dd = delta != nullptr ? delta[i] : cpu::dot(pr, dr, n);
        for (int64_t j = 0; j < n; ++j) dr[j] = kmath::softmax_grad(pr[j], dr[j], dd);
        std::fill(dr + n, dr + keys, 0.0f);
      }
    });
  }
  void attention_delta(const Attention& a, const void* attn, const void* dattn,
                       float* delta) override {
    if (a.dtype != DType::BF16) throw InvalidArgument("attention_delta: bf16 operands only");
    const auto* o = static_cast<const uint16_t*>(attn);
    const auto* d = static_cast<const uint16_t*>(dattn);
    const int64_t Q = a.nh * a.hd;
    // Rows (b, h, t) in ranges: each row's dot on its own.
    in_ranges(a.B * a.nh * a.T, a.hd, [&](int64_t first, int64_t count) {
      for (int64_t i = first; i < first + count; ++i) {
        const int64_t t = i % a.T, h = i / a.T % a.nh, b = i / (a.T * a.nh);
        const int64_t at = (b * a.T + t) * Q + h * a.hd;
        delta[i] = kmath::bf16_row_dot(o + at, d + at, a.hd);
      }
    });
  }

  // The kv heads of every sequence in parallel on oneTBB's threads, each on score blocks of its
  // thread's own and with its GEMMs on that thread alone (SerialGemms: fp32 on oneDNN, not
  // OpenBLAS), so the bits are those of any other number of threads. In bf16 each group's k and
  // v, and each head's q (dattn), are first copied into dense [T, head size] matrices, and its
  // outputs computed there and copied out: the default's GEMMs, on the same values in the same
  // order, without each of them copying its strided operands (gemm_bf16 does, for oneDNN's
  // fast kernels) again for every block. fp32 takes the operands as they are.
  void attention_forward(const Attention& a, const void* q, const void* k, const void* v,
                         float* lse, float* attn, float* scores, void* lowp,
                         void* attn_bf16) override {
    if (a.dtype == DType::F32 && attn_bf16 == nullptr) {
      for_each_group(a, false, [&](int64_t b, int64_t g, GroupScratch& s) {
        attention_forward_group(a, b, g, q, k, v, lse, attn, s.scores.data(), nullptr, nullptr);
      });
      return;
    }
    if (a.dtype != DType::BF16 || lowp == nullptr)
      return ComputeBackend::attention_forward(a, q, k, v, lse, attn, scores, lowp, attn_bf16);
    const int64_t Q = a.nh * a.hd, group = a.nh / a.nkv;
    const Attention head = one_head(a);
    for_each_group(a, false, [&](int64_t b, int64_t g, GroupScratch& s) {
      gather_kv(a, b, g, k, v, s);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const int64_t q_at = b * a.T * Q + h * a.hd;
        gather(static_cast<const uint16_t*>(q) + q_at, Q, s.q.data(), a.T, a.hd);
        attention_forward_group(head, 0, 0, s.q.data(), s.k.data(), s.v.data(),
                                lse + (b * a.nh + h) * a.T, s.out.data(), s.scores.data(),
                                s.p16.data(), s.rows.data());
        scatter(s.out.data(), attn + q_at, Q, a.T, a.hd);
      }
    });
    if (attn_bf16 != nullptr) from_fp32(attn, attn_bf16, DType::BF16, a.B * a.T * a.nh * a.hd);
  }
  void attention_backward(const Attention& a, const void* q, const void* k, const void* v,
                          const float* lse, const void* attn, const void* dattn, float* dq,
                          float* dk, float* dv, float* scores, float* dprob, void* lowp) override {
    if (a.dtype == DType::F32) {
      for_each_group(a, true, [&](int64_t b, int64_t g, GroupScratch& s) {
        attention_backward_group(a, b, g, q, k, v, lse, dattn, nullptr, dq, dk, dv, s.scores.data(),
                                 s.dprob.data(), nullptr, nullptr);
      });
      return;
    }
    if (a.dtype != DType::BF16 || lowp == nullptr)
      return ComputeBackend::attention_backward(a, q, k, v, lse, attn, dattn, dq, dk, dv, scores,
                                                dprob, lowp);
    const float* delta = attention_backward_delta(a, attn, dattn, lowp);
    const int64_t Q = a.nh * a.hd, KV = a.nkv * a.hd, group = a.nh / a.nkv;
    const Attention head = one_head(a);
    for_each_group(a, true, [&](int64_t b, int64_t g, GroupScratch& s) {
      const int64_t kv_at = gather_kv(a, b, g, k, v, s);
      gather(dk + kv_at, KV, s.dk.data(), a.T, a.hd);  // added into, as the default adds
      gather(dv + kv_at, KV, s.dv.data(), a.T, a.hd);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const int64_t q_at = b * a.T * Q + h * a.hd, rows_at = (b * a.nh + h) * a.T;
        gather(static_cast<const uint16_t*>(q) + q_at, Q, s.q.data(), a.T, a.hd);
        gather(static_cast<const uint16_t*>(dattn) + q_at, Q, s.dattn.data(), a.T, a.hd);
        attention_backward_group(head, 0, 0, s.q.data(), s.k.data(), s.v.data(), lse + rows_at,
                                 s.dattn.data(), delta + rows_at, s.out.data(), s.dk.data(),
                                 s.dv.data(), s.scores.data(), s.dprob.data(), s.p16.data(),
                                 s.ds16.data());
        scatter(s.out.data(), dq + q_at, Q, a.T, a.hd);
      }
      scatter(s.dk.data(), dk + kv_at, KV, a.T, a.hd);
      scatter(s.dv.data(), dv + kv_at, KV, a.T, a.hd);
    });
  }

  void cross_entropy(float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float coef,
                     bool grad, float* row_loss, void* grad_bf16) override {
    in_ranges(rows, vocab, [&](int64_t first, int64_t count) {
      cross_entropy_rows(logits, targets, first, first + count, vocab, coef, grad, row_loss,
                         grad_bf16);
    });
  }
  static void cross_entropy_rows(float* logits, const int32_t* targets, int64_t first, int64_t last,
                                 int64_t vocab, float coef, bool grad, float* row_loss,
                                 void* grad_bf16) {
    for (int64_t r = first; r < last; ++r) {
      float* row = logits + r * vocab;
      const int32_t t = targets[r];
      if (kmath::xent_ignored(t)) {
        row_loss[r] = 0.0f;
        if (grad) std::fill(row, row + vocab, 0.0f);
      } else if (!grad) {
        row_loss[r] = kmath::xent_loss(cpu::log_sum_exp(row, vocab), row[t]);
      } else {
        const float target_logit = row[t];
        row_loss[r] = kmath::xent_loss(cpu::softmax_inplace(row, vocab), target_logit);
        for (int64_t j = 0; j < vocab; ++j) row[j] = kmath::xent_scale(row[j], coef);
        row[t] = kmath::xent_target(row[t], coef);
      }
      // The row's gradient, rounded while it is in cache.
      if (grad && grad_bf16 != nullptr)
        cpu::from_fp32(row, static_cast<uint16_t*>(grad_bf16) + r * vocab, DType::BF16, vocab);
    }
  }

  void embedding_forward(const void* table, DType dtype, const int32_t* ids, int64_t n,
                         int64_t hidden, float* out) override {
    const size_t esize = dtype_size(dtype);
    in_ranges(n, hidden, [&](int64_t first, int64_t count) {
      for (int64_t i = first; i < first + count; ++i) {
        const void* src =
            static_cast<const std::byte*>(table) + static_cast<size_t>(ids[i]) * hidden * esize;
        if (dtype == DType::F32)
          std::memcpy(out + i * hidden, src, sizeof(float) * hidden);
        else
          cpu::to_fp32(src, dtype, out + i * hidden, hidden);
      }
    });
  }

  void embedding_backward(const int32_t* ids, const float* dy, int64_t n, int64_t hidden,
                          float* grad) override {
    // By columns, each adding every token's row in order (a repeated id adds in token order).
    in_column_ranges(hidden, n, [&](int64_t first, int64_t count) {
      for (int64_t i = 0; i < n; ++i) {
        float* row = grad + static_cast<int64_t>(ids[i]) * hidden + first;
        const float* d = dy + i * hidden + first;
        for (int64_t j = 0; j < count; ++j) row[j] += d[j];
      }
    });
  }

 private:
  static constexpr int64_t kRangeElements = int64_t{1} << 16;
  // fn(first, count) over [0, n) items of `width` elements each: on this thread where there are
  // fewer than two ranges' worth (2^16 elements a range), else on oneTBB's threads, in ranges
  // of a multiple of 64 items, so that every range but the last is whole vectors and the last
  // holds the same tail as one range would: the results are those of fn(0, n), bit for bit.
  template <class Fn>
  static void in_ranges(int64_t n, int64_t width, Fn fn) {
    const int64_t per_range =
        std::max<int64_t>(64, (kRangeElements / std::max<int64_t>(1, width) + 63) / 64 * 64);
    const int64_t ranges = (n + per_range - 1) / per_range;
    if (ranges < 2) {
      if (n > 0) fn(0, n);
      return;
    }
    tbb::parallel_for(int64_t{0}, ranges, [&](int64_t i) {
      const int64_t first = i * per_range;
      fn(first, std::min(per_range, n - first));
    });
  }
  // fn(first, count) over [0, cols) columns of `rows` rows: on this thread where that is fewer
  // than two ranges' worth of elements, else in as many ranges as there are threads, each a
  // multiple of 64 columns but the last: long runs of each row for the prefetchers.
  template <class Fn>
  static void in_column_ranges(int64_t cols, int64_t rows, Fn fn) {
    if (cols * rows < 2 * kRangeElements) {
      if (cols > 0) fn(0, cols);
      return;
    }
    const int64_t threads = tbb::this_task_arena::max_concurrency();
    const int64_t per_range =
        std::max<int64_t>(64, (cols + threads * 64 - 1) / (threads * 64) * 64);
    tbb::parallel_for(int64_t{0}, (cols + per_range - 1) / per_range, [&](int64_t i) {
      const int64_t first = i * per_range;
      fn(first, std::min(per_range, cols - first));
    });
  }
  // A thread's scratch for attention groups: score blocks and their bf16 roundings, the
  // forward's 1 / sum of a block's rows or the backward's score-gradient blocks, and the dense
  // [T, head size] copies of a group's operands and outputs.
  struct GroupScratch {
    std::vector<float> scores, dprob, rows, out, dk, dv;
    std::vector<uint16_t> p16, ds16, q, k, v, dattn;
    size_t bytes() const {
      size_t n = 0;
      for (const auto* f : {&scores, &dprob, &rows, &out, &dk, &dv}) n += f->capacity() * 4;
      for (const auto* h : {&p16, &ds16, &q, &k, &v, &dattn}) n += h->capacity() * 2;
      return n;
    }
  };
  static constexpr size_t kKeptScratchBytes = size_t{64} << 20;
  // One sequence and one head of a's shape: a group's dense copies, computed by the default.
  static Attention one_head(const Attention& a) {
    Attention h = a;
    h.B = h.nh = h.nkv = 1;
    return h;
  }
  // The rows x cols matrix at src (leading dimension ld) packed into dst, and back.
  template <typename T>
  static void gather(const T* src, int64_t ld, T* dst, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * cols, src + r * ld, cols * sizeof(T));
  }
  // Group g of sequence b's k and v (bf16) into the scratch's dense copies; returns where the
  // group's columns start in k, v, dk and dv.
  static int64_t gather_kv(const Attention& a, int64_t b, int64_t g, const void* k, const void* v,
                           GroupScratch& s) {
    const int64_t KV = a.nkv * a.hd, kv_at = b * a.T * KV + g * a.hd;
    gather(static_cast<const uint16_t*>(k) + kv_at, KV, s.k.data(), a.T, a.hd);
    gather(static_cast<const uint16_t*>(v) + kv_at, KV, s.v.data(), a.T, a.hd);
    return kv_at;
  }
  template <typename T>
  static void scatter(const T* src, T* dst, int64_t ld, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ld, src + r * cols, cols * sizeof(T));
  }
  // fn(b, g, scratch) for every (sequence, kv head) of `a`, in parallel, with the scratch of the
  // forward or the backward.
  template <class Fn>
  static void for_each_group(const Attention& a, bool backward, Fn fn) {
    const auto block = static_cast<size_t>(a.block * a.T);
    const auto matrix = static_cast<size_t>(a.T * a.hd);
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, a.B * a.nkv, 1),
                      [&](const tbb::blocked_range<int64_t>& r) {
                        thread_local GroupScratch s;
                        s.scores.resize(block);
                        if (backward) s.dprob.resize(block);
                        if (a.dtype == DType::BF16) {  // and the dense copies
                          s.p16.resize(block);
                          for (auto* m : {&s.q, &s.k, &s.v}) m->resize(matrix);
                          s.out.resize(matrix);
                          if (backward) {
                            s.ds16.resize(block);
                            s.dattn.resize(matrix);
                            s.dk.resize(matrix);
                            s.dv.resize(matrix);
                          } else {
                            s.rows.resize(static_cast<size_t>(a.block));
                          }
                        }
                        const cpu::SerialGemms serial;
                        for (int64_t t = r.begin(); t < r.end(); ++t) fn(t / a.nkv, t % a.nkv, s);
                        // Long sequences' scratch (about 20 bytes per head element and 12 per
                        // score of a block, on every thread) is not kept between calls.
                        if (s.bytes() > kKeptScratchBytes) s = GroupScratch{};
                      });
  }
};

// The CPU backend on a discrete CpuDevice, run as a GPU's would be: every device pointer an
// operation takes is turned into the device's read-write alias (CpuDevice::host_view) when it is
// queued, and the operation runs later, in order, on a compute stream of the device (its own
// thread), each after CpuDevice::compute_delay_us. Operations return once queued; download()
// and finish() wait. What reads the results, or frees or rewrites the inputs, must wait for an
// event recorded on stream() after them, as on a GPU.
class DiscreteCpuBackend final : public ComputeBackend {
 public:
  explicit DiscreteCpuBackend(CpuDevice& device)
      : dev_(device),
        delay_us_(device.compute_delay_us()),
        stream_(device.create_stream("compute")) {}
  std::string name() const override { return dev_.name(); }

  void copy(void* dst, const void* src, size_t bytes) override {
    run([this, d = v(dst), s = v(src), bytes] { cpu_.copy(d, s, bytes); });
  }
  void zero(void* dst, size_t bytes) override {
    run([this, d = v(dst), bytes] { cpu_.zero(d, bytes); });
  }
  void upload(void* dst, const void* host, size_t bytes) override {
    // `host` is not read after the call returns: its bytes travel with the operation.
    auto bytes_of = std::make_shared<std::vector<std::byte>>(
        static_cast<const std::byte*>(host), static_cast<const std::byte*>(host) + bytes);
    run([this, d = v(dst), bytes_of] { cpu_.copy(d, bytes_of->data(), bytes_of->size()); });
  }
  void download(void* host, const void* src, size_t bytes) override {
    run([this, host, s = v(src), bytes] { cpu_.copy(host, s, bytes); });
    stream_->synchronize();
  }
  const float* constant(std::span<const float> host) override { return host.data(); }
  // `host` itself: it must stay unchanged until the operations reading it have run.
  const int32_t* stage_ids(const int32_t* host, int64_t, int) override { return host; }
  void finish() override { stream_->synchronize(); }
  Stream* stream() override { return stream_.get(); }

  void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc) override {
    run([=, this, a = v(a), b = v(b), c = v(c)] {
      cpu_.gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    });
  }
  void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                 const void* a, int64_t lda, const void* b, int64_t ldb, float beta, float* c,
                 int64_t ldc) override {
    run([=, this, a = v(a), b = v(b), c = v(c)] {
      cpu_.gemm_bf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    });
  }
  void to_fp32(const void* src, DType dtype, float* dst, int64_t n) override {
    run([=, this, src = v(src), dst = v(dst)] { cpu_.to_fp32(src, dtype, dst, n); });
  }
  void from_fp32(const float* src, void* dst, DType dtype, int64_t n) override {
    run([=, this, src = v(src), dst = v(dst)] { cpu_.from_fp32(src, dst, dtype, n); });
  }
  void add_inplace(float* y, const float* x, int64_t n) override {
    run([=, this, y = v(y), x = v(x)] { cpu_.add_inplace(y, x, n); });
  }
  void scale_rows(float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale) override {
    run([=, this, x = v(x), scale = v(scale)] { cpu_.scale_rows(x, rows, cols, ld, scale); });
  }
  void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim,
                       float* y, float* rstd, void* y_bf16) override {
    run([=, this, x = v(x), w = v(w), y = v(y), rstd = v(rstd), y_bf16 = v(y_bf16)] {
      cpu_.rmsnorm_forward(x, w, eps, rows, dim, y, rstd, y_bf16);
    });
  }
  void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                        int64_t rows, int64_t dim, float* dx, float* dw) override {
    run([=, this, dy = v(dy), x = v(x), w = v(w), rstd = v(rstd), dx = v(dx), dw = v(dw)] {
      cpu_.rmsnorm_backward(dy, x, w, rstd, rows, dim, dx, dw);
    });
  }
  void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin, bool inverse, void* x_bf16) override {
    run([=, this, x = v(x), cos = v(cos), sin = v(sin), x_bf16 = v(x_bf16)] {
      cpu_.rope(x, rows, seq, heads, head_dim, cos, sin, inverse, x_bf16);
    });
  }
  void swiglu_forward(const float* g, const float* u, float* a, int64_t n, void* a_bf16) override {
    run([=, this, g = v(g), u = v(u), a = v(a), a_bf16 = v(a_bf16)] {
      cpu_.swiglu_forward(g, u, a, n, a_bf16);
    });
  }
  void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                       int64_t n, void* dg_bf16, void* du_bf16) override {
    run([=, this, da = v(da), g = v(g), u = v(u), dg = v(dg), du = v(du), dg_bf16 = v(dg_bf16),
         du_bf16 = v(du_bf16)] { cpu_.swiglu_backward(da, g, u, dg, du, n, dg_bf16, du_bf16); });
  }
  void causal_softmax_forward(float* scores, float* lse, int64_t rows, int64_t keys,
                              int64_t first_query, float* inv_sum) override {
    run([=, this, scores = v(scores), lse = v(lse), inv_sum = v(inv_sum)] {
      cpu_.causal_softmax_forward(scores, lse, rows, keys, first_query, inv_sum);
    });
  }
  void causal_softmax_backward(float* scores, float* dp, const float* lse, int64_t rows,
                               int64_t keys, int64_t first_query, const float* delta) override {
    run([=, this, scores = v(scores), dp = v(dp), lse = v(lse), delta = v(delta)] {
      cpu_.causal_softmax_backward(scores, dp, lse, rows, keys, first_query, delta);
    });
  }
  // The CPU backend's attention, kv heads in parallel, as one operation: the same bits as on the
  // host-accessible device. What it would refuse goes to the default, which refuses it here,
  // before anything is queued.
  void attention_forward(const Attention& a, const void* q, const void* k, const void* val,
                         float* lse, float* attn, float* scores, void* lowp,
                         void* attn_bf16) override {
    const bool valid =
        a.dtype == DType::BF16 ? lowp != nullptr : a.dtype == DType::F32 && attn_bf16 == nullptr;
    if (!valid)
      return ComputeBackend::attention_forward(a, q, k, val, lse, attn, scores, lowp, attn_bf16);
    run([=, this, q = v(q), k = v(k), vv = v(val), lse = v(lse), attn = v(attn), scores = v(scores),
         lowp = v(lowp), attn_bf16 = v(attn_bf16)] {
      cpu_.attention_forward(a, q, k, vv, lse, attn, scores, lowp, attn_bf16);
    });
  }
  void attention_backward(const Attention& a, const void* q, const void* k, const void* val,
                          const float* lse, const void* attn, const void* dattn, float* dq,
                          float* dk, float* dv, float* scores, float* dprob, void* lowp) override {
    const bool valid =
        a.dtype == DType::BF16 ? lowp != nullptr && attn != nullptr : a.dtype == DType::F32;
    if (!valid)
      return ComputeBackend::attention_backward(a, q, k, val, lse, attn, dattn, dq, dk, dv, scores,
                                                dprob, lowp);
    run([=, this, q = v(q), k = v(k), vv = v(val), lse = v(lse), attn = v(attn), dattn = v(dattn),
         dq = v(dq), dk = v(dk), dv = v(dv), scores = v(scores), dprob = v(dprob), lowp = v(lowp)] {
      cpu_.attention_backward(a, q, k, vv, lse, attn, dattn, dq, dk, dv, scores, dprob, lowp);
    });
  }
  void attention_delta(const Attention& a, const void* attn, const void* dattn,
                       float* delta) override {
    if (a.dtype != DType::BF16) throw InvalidArgument("attention_delta: bf16 operands only");
    run([=, this, attn = v(attn), dattn = v(dattn), delta = v(delta)] {
      cpu_.attention_delta(a, attn, dattn, delta);
    });
  }
  void cross_entropy(float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float coef,
                     bool grad, float* row_loss, void* grad_bf16) override {
    run([=, this, logits = v(logits), targets = v(targets), row_loss = v(row_loss),
         grad_bf16 = v(grad_bf16)] {
      cpu_.cross_entropy(logits, targets, rows, vocab, coef, grad, row_loss, grad_bf16);
    });
  }
  void embedding_forward(const void* table, DType dtype, const int32_t* ids, int64_t n,
                         int64_t hidden, float* out) override {
    run([=, this, table = v(table), ids = v(ids), out = v(out)] {
      cpu_.embedding_forward(table, dtype, ids, n, hidden, out);
    });
  }
  void embedding_backward(const int32_t* ids, const float* dy, int64_t n, int64_t hidden,
                          float* grad) override {
    run([=, this, ids = v(ids), dy = v(dy), grad = v(grad)] {
      cpu_.embedding_backward(ids, dy, n, hidden, grad);
    });
  }

 private:
  template <typename T>
  T* v(T* p) const {
    return static_cast<T*>(dev_.host_view(p));
  }
  template <typename Fn>
  void run(Fn fn) {
    stream_->enqueue([delay = delay_us_, fn = std::move(fn)] {
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      fn();
    });
  }

  const CpuDevice& dev_;
  const uint32_t delay_us_;
  CpuBackend cpu_;
  std::unique_ptr<Stream> stream_;  // last: destroyed first, after its queued operations ran
};

}  // namespace

std::shared_ptr<ComputeBackend> cpu_backend() {
  static const std::shared_ptr<ComputeBackend> backend = std::make_shared<CpuBackend>();
  return backend;
}

std::shared_ptr<ComputeBackend> make_cpu_backend(CpuDevice& device) {
  if (device.host_accessible()) return cpu_backend();
  return std::make_shared<DiscreteCpuBackend>(device);
}

}  // namespace outcore::device
