#include "engine/zero/step_bounds.hpp"

#include <algorithm>

namespace outcore::zero {

double StepTimes::bound_s() const { return std::max({compute_s, pcie_s, drive_s}); }

std::string StepTimes::bound() const {
  if (compute_s >= pcie_s && compute_s >= drive_s) return "compute";
  return pcie_s >= drive_s ? "PCIe" : "drive";
}

StepTimes step_times(const Plan& plan, const model::LlamaModel& model, const LinkRates& rates) {
  StepTimes t;
  const model::ModelOptions& o = model.options();
  const double tokens = static_cast<double>(plan.tokens_per_micro_batch) *
                        static_cast<double>(plan.micro_batches_per_step);
  const double recompute = o.activation_checkpointing ? 4.0 / 3.0 : 1.0;
  t.flops = model.config().train_flops_per_token(o.seq_len) * tokens * recompute;
  t.compute_s = rates.gemm_flops > 0 ? t.flops / rates.gemm_flops : 0;
  const double copied = static_cast<double>(plan.per_step.h2d + plan.per_step.d2h);
  t.pcie_s = rates.pcie_bytes > 0 ? copied / rates.pcie_bytes : 0;
  const double nr = static_cast<double>(plan.per_step.nvme_read);
  const double nw = static_cast<double>(plan.per_step.nvme_write);
  if (nr + nw > 0 && (rates.drive_read_bytes <= 0 || rates.drive_write_bytes <= 0)) {
    t.drive_known = false;
  } else if (nr + nw > 0) {
    t.drive_s = nr / rates.drive_read_bytes + nw / rates.drive_write_bytes;
  }
  return t;
}

}  // namespace outcore::zero
