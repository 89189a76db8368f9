// Drive and compute bounds of a training step (see step_bounds.hpp).
#include "bench/zero/step_bounds.hpp"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/common/scratch.hpp"
#include "common/aligned_buffer.hpp"
#include "common/dtype.hpp"
#include "common/error.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/device.hpp"
#include "engine/zero/zero.hpp"

namespace outcore::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

constexpr int kSpans = 4;

// Reads `read_spans` spans from the start of `file` and writes `write_spans` spans after
// them, kSpans spans in flight, the next one a read while the reads' share of the spans
// submitted so far is at most their share of the pass. Returns the seconds it took.
double run_pass(aio::Engine& engine, const aio::File& file, std::span<std::byte> buffer,
                uint64_t span, uint64_t read_spans, uint64_t write_spans) {
  const uint64_t total = read_spans + write_spans;
  uint64_t reads = 0, writes = 0;
  std::array<aio::Ticket, kSpans> tickets;
  auto submit = [&](int slot) {
    const std::span<std::byte> part = buffer.subspan(slot * span, span);
    const bool read = reads < read_spans &&
                      (writes == write_spans || reads * total <= (reads + writes) * read_spans);
    tickets[slot] = read ? engine.submit_read(file, reads++ * span, part)
                         : engine.submit_write(file, (read_spans + writes++) * span, part);
  };
  const auto t0 = Clock::now();
  try {
    for (int s = 0; s < kSpans && reads + writes < total; ++s) submit(s);
    for (int s = 0; tickets[s].valid(); s = (s + 1) % kSpans) {
      engine.wait(tickets[s]);
      tickets[s] = {};
      if (reads + writes < total) submit(s);
    }
  } catch (...) {
    engine.wait_all();  // never leave requests running on the buffer
    throw;
  }
  return seconds_since(t0);
}

}  // namespace

DriveRates measure_drive(const fs::path& dir, uint64_t file_bytes, uint64_t span_bytes,
                         double read_fraction, const aio::Options& options) {
  if (span_bytes == 0 || span_bytes % kIoAlignment != 0 || file_bytes / span_bytes < 2 ||
      !(read_fraction >= 0 && read_fraction <= 1))
    throw InvalidArgument(fmt::format(
        "measure_drive: span {} B (a non-zero multiple of 4096), file {} B (at least 2 spans), "
        "read fraction {}",
        span_bytes, file_bytes, read_fraction));
  const uint64_t spans = file_bytes / span_bytes;
  DriveRates r{.file_bytes = spans * span_bytes, .span_bytes = span_bytes};
  // A file of its own, unlinked once open: a user's file is never touched, nothing is left.
  aio::File file = open_unlinked_scratch_file(dir, "drive_reference",
                                              {.access = aio::Access::kReadWrite, .direct = true});
  file.preallocate(r.file_bytes);
  AlignedBuffer buffer(kSpans * span_bytes);
  std::memset(buffer.data(), 0x5a, buffer.size());  // not zeros: nothing may elide the writes
  aio::Engine engine(options);
  const std::span<std::byte> bufs[] = {{buffer.data(), buffer.size()}};
  engine.register_buffers(bufs);
  const std::span<std::byte> buf(buffer.data(), buffer.size());
  const double gb = static_cast<double>(r.file_bytes) / 1e9;
  // Writes first: the read pass then finds blocks written, not holes.
  r.write_gbps = gb / run_pass(engine, file, buf, span_bytes, 0, spans);
  r.read_gbps = gb / run_pass(engine, file, buf, span_bytes, spans, 0);
  const auto read_spans = static_cast<uint64_t>(read_fraction * static_cast<double>(spans) + 0.5);
  r.mixed_gbps = gb / run_pass(engine, file, buf, span_bytes, read_spans, spans - read_spans);
  engine.unregister_buffers();
  file.close();
  return r;
}

IoBound io_bound(const DriveRates& rates, uint64_t read_bytes, uint64_t write_bytes) {
  const double read_s = static_cast<double>(read_bytes) / 1e9 / rates.read_gbps;
  const double write_s = static_cast<double>(write_bytes) / 1e9 / rates.write_gbps;
  return {.serial_s = read_s + write_s,
          .overlapped_s = std::max(read_s, write_s),
          .mixed_s = static_cast<double>(read_bytes + write_bytes) / 1e9 / rates.mixed_gbps};
}

ComputeTimes measure_compute(const model::LlamaModel& model, device::Device& dev,
                             int64_t micro_batches, int reps, bool cpu_checkpointing) {
  if (reps < 1) throw InvalidArgument(fmt::format("measure_compute: reps {} (>= 1)", reps));
  const model::ModelLayout& layout = model.layout();
  const int embed = 0, layer = 1, head = model.num_units() - 1;
  const DType dtype = model.options().param_dtype;
  // Parameters and fp32 gradients of the three units timed, on `dev`.
  std::vector<device::DeviceBuffer> params, grads;
  const std::unique_ptr<device::Stream> copy = dev.create_stream("bench-upload");
  for (int u : {embed, layer, head}) {
    const size_t n = layout.units[u].padded_numel;
    std::vector<float> init(n);
    model::init_params(layout, u, 1, 0, n, init.data());
    std::vector<std::byte> host(n * dtype_size(dtype));
    model::convert_from_fp32(init.data(), host.data(), dtype, n);
    params.push_back(dev.alloc(host.size(), "bench parameters"));
    copy->copy_h2d(params.back().data(), host.data(), host.size());
    copy->synchronize();
    grads.push_back(dev.alloc(n * sizeof(float), "bench gradients"));
  }
  model::ActivationBuffers acts(model, dev, cpu_checkpointing);
  const int64_t vocab = model.config().vocab_size;
  std::vector<int32_t> tokens(static_cast<size_t>(model.tokens()));
  std::vector<int32_t> targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 7919) % vocab);
    targets[i] = static_cast<int32_t>((i * 104729 + 1) % vocab);
  }
  const bool tied = model.config().tie_word_embeddings;
  float* g_embed = grads[0].as<float>();
  // The head reads the decoder's output: the values it would see behind any layer count.
  float* hidden = acts.unit_input(layer + 1);
  std::vector<double> embed_s, decoder_s, head_s;
  for (int rep = 0; rep <= reps; ++rep) {
    auto t = Clock::now();
    model.forward(
        embed,
        {.params = params[0].data(), .tokens = tokens.data(), .output = acts.unit_input(layer)});
    double e = seconds_since(t);
    t = Clock::now();
    model.forward(layer, {.params = params[1].data(),
                          .input = acts.unit_input(layer),
                          .output = hidden,
                          .saved = acts.saved(layer),
                          .scratch = acts.scratch()});
    double d = seconds_since(t);
    t = Clock::now();
    model.backward(head, {.params = params[2].data(),
                          .tied_params = tied ? params[0].data() : nullptr,
                          .targets = targets.data(),
                          .input = hidden,
                          .grad_input = acts.grad(),
                          .grads = grads[2].as<float>(),
                          .tied_grads = tied ? g_embed : nullptr,
                          .scratch = acts.scratch()});
    const double h = seconds_since(t);
    t = Clock::now();
    model.backward(layer, {.params = params[1].data(),
                           .input = acts.unit_input(layer),
                           .grad_output = acts.grad(),
                           .grad_input = acts.grad(),
                           .grads = grads[1].as<float>(),
                           .saved = acts.saved(layer),
                           .scratch = acts.scratch()});
    d += seconds_since(t);
    t = Clock::now();
    model.backward(embed, {.params = params[0].data(),
                           .tokens = tokens.data(),
                           .grad_output = acts.grad(),
                           .grads = g_embed});
    e += seconds_since(t);
    if (rep == 0) continue;  // warm-up
    embed_s.push_back(e);
    decoder_s.push_back(d);
    head_s.push_back(h);
  }
  return {.embed_s = median(embed_s),
          .decoder_s = median(decoder_s),
          .head_s = median(head_s),
          .layers = model.config().num_hidden_layers,
          .micro_batches = micro_batches};
}

std::optional<std::pair<int64_t, int64_t>> recommend_shape(
    const model::LlamaConfig& mc, int64_t seq, DType param_dtype, device::Device& dev,
    device::Device& compute_dev, uint64_t budget, const fs::path& nvme, double ref_gib,
    zero::GradientPlacement grads, const config::Config& base, zero::LinkRates& rates) {
  const DType compute = config::compute_dtype(base);
  if (!dev.host_accessible()) {
    // Copies of 256 MiB, or a quarter of a smaller budget, which they are charged to.
    size_t bytes = size_t{256} << 20;
    if (budget > 0) bytes = std::min<size_t>(bytes, std::max<uint64_t>(budget / 4, 1 << 20));
    rates.pcie_bytes = device::copy_bytes_per_second(dev, bytes);
  }
  fs::create_directories(nvme);
  const DriveRates drive = measure_drive(nvme, static_cast<uint64_t>(ref_gib * (1ull << 30)),
                                         32ull << 20, 0.5, zero::aio_options(base.aio));
  rates.drive_read_bytes = drive.read_gbps * 1e9;
  rates.drive_write_bytes = drive.write_gbps * 1e9;
  model::ModelOptions mo{.micro_batch = 1,
                         .seq_len = seq,
                         .param_dtype = param_dtype,
                         .compute_dtype = compute,
                         .activation_checkpointing = true};
  mo.head_chunk_rows = model::head_rows_on(mc, mo, dev, budget);
  zero::measure_compute_rates(compute_dev, model::LlamaModel(mc, mo), rates);
  const zero::PlanOptions po{.device_limit_bytes = budget,
                             .gradients = grads,
                             .device_host_accessible = dev.host_accessible(),
                             .device_in_host_memory = dev.kind() == device::DeviceKind::Cpu};
  const std::optional<zero::ShapeChoice> c = zero::choose_shape(
      base, mc, mo, po, budget, model::head_sizing_bytes(budget, dev.total_memory_bytes()), rates);
  std::printf(
      "rates: GEMM %.1f TFLOP/s (%s), attention %.1f TFLOP/s, PCIe %.1f GB/s, drive read %.2f "
      "GB/s, write %.2f GB/s\n",
      rates.gemm_flops / 1e12, std::string(dtype_name(compute)).c_str(),
      rates.attention_flops / 1e12, rates.pcie_bytes / 1e9, drive.read_gbps, drive.write_gbps);
  if (!c) return std::nullopt;
  std::printf(
      "shape (as outcore estimate recommends%s): micro-batch %lld x accumulation %lld = %lld "
      "tokens per step; planned compute %.2f s, PCIe %.2f s, drive %.2f s\n",
      c->hides ? ", the transfers under compute" : "; none hides the transfers, the closest",
      static_cast<long long>(c->micro), static_cast<long long>(c->gas),
      static_cast<long long>(c->micro * c->gas * seq), c->times.compute_s, c->times.pcie_s,
      c->times.drive_s);
  std::fflush(stdout);
  return std::make_pair(c->micro, c->gas);
}

double cpu_seconds() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

}  // namespace outcore::bench
