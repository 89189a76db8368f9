// `outcore doctor [--nvme-path DIR] [--pinned-mb N]`: checks this machine for training and prints
// one line per check with its verdict. Exit 0 when nothing needed fails, 1 when a check fails,
// 2 for bad arguments.
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>

#include "tools/outcore/commands.hpp"
#include "tools/outcore/doctor.hpp"
#include "tools/outcore/number_arg.hpp"

namespace outcore::cli {
namespace {

struct DoctorArgs {
  std::string nvme_path;
  std::string pinned_mb = "1024";
};

// The largest --pinned-mb: 1 PiB.
constexpr int64_t kMaxPinnedMb = int64_t{1} << 30;

const char* verdict_name(doctor::Verdict v) {
  switch (v) {
    case doctor::Verdict::kOk:
      return "ok";
    case doctor::Verdict::kWarn:
      return "warn";
    case doctor::Verdict::kFail:
      return "FAIL";
    case doctor::Verdict::kNone:
      return "none";
  }
  return "?";
}

int run_doctor(const DoctorArgs& a) {
  doctor::Options o;
  o.nvme_path = a.nvme_path;
  int64_t pinned_mb = 0;
  std::string allowed = parse_number_arg(a.pinned_mb, pinned_mb);
  if (allowed.empty() && (pinned_mb < 0 || pinned_mb > kMaxPinnedMb))
    allowed = fmt::format("allowed: a whole number of MiB from 0 to {}", kMaxPinnedMb);
  if (!allowed.empty()) {
    std::fprintf(stderr, "error: --pinned-mb: got \"%s\"; %s\n", a.pinned_mb.c_str(),
                 allowed.c_str());
    return 2;
  }
  o.pinned_bytes = static_cast<uint64_t>(pinned_mb) << 20;
  std::vector<doctor::Line> lines = doctor::host_checks(o);
  bool gpu = false;
  for (doctor::Line& l : doctor::gpu_checks()) {
    gpu = gpu || l.verdict != doctor::Verdict::kNone;
    lines.push_back(std::move(l));
  }
  int fails = 0, warns = 0;
  std::fputs(fmt::format("{:<24} {:<7} {}\n", "check", "verdict", "detail").c_str(), stdout);
  for (const doctor::Line& l : lines) {
    fails += l.verdict == doctor::Verdict::kFail;
    warns += l.verdict == doctor::Verdict::kWarn;
    std::fputs(fmt::format("{:<24} {:<7} {}\n", l.check, verdict_name(l.verdict), l.detail).c_str(),
               stdout);
  }
  std::fputs(
      fmt::format("verdict: {} ({} failed, {} warnings){}\n", fails != 0 ? "NOT READY" : "ready",
                  fails, warns, gpu ? "" : "; no GPU: training runs on the simulated device")
          .c_str(),
      stdout);
  return fails != 0 ? 1 : 0;
}

}  // namespace

void add_doctor_command(CLI::App& app, int& rc) {
  auto o = std::make_shared<DoctorArgs>();
  CLI::App* cmd = app.add_subcommand("doctor",
                                     "Check this machine for training: CPU, io_uring, swap path, "
                                     "host memory, locked memory, GPUs");
  cmd->add_option("--nvme-path", o->nvme_path,
                  "swap directory to check (O_DIRECT, free space); not checked when absent");
  cmd->add_option("--pinned-mb", o->pinned_mb,
                  "pinned pool size in MiB to compare RLIMIT_MEMLOCK with (default 1024)");
  cmd->callback([o, &rc] { rc = run_doctor(*o); });
}

}  // namespace outcore::cli
