#include "tools/outcore/launch.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <span>

#include "common/error.hpp"
#include "common/log.hpp"
#include "engine/comm/local_comm.hpp"
#ifdef OUTCORE_HAVE_MPI
#include "engine/comm/mpi_comm.hpp"
#endif
#if defined(OUTCORE_HAVE_NCCL_COMM) && defined(OUTCORE_HAVE_MPI)
#include "engine/comm/nccl_comm.hpp"
#define OUTCORE_LAUNCH_NCCL 1
#endif

namespace outcore::cli {

std::optional<DeviceChoice> choose_device(const std::string& choice) {
  if (choice != "auto" && choice != "cpu" && choice != "cuda") {
    std::fprintf(stderr, "error: --device: got \"%s\"; allowed: auto, cpu, cuda\n", choice.c_str());
    return std::nullopt;
  }
  const device::ProbeResult probe = device::probe();
  if (choice == "cpu") return DeviceChoice{.description = "the simulated device"};
  if (choice == "auto" && !probe.available)
    return DeviceChoice{.description = "the simulated device (" + probe.summary() + ")"};
  if (!probe.available) {
    std::fprintf(stderr, "error: --device cuda: %s\n", probe.summary().c_str());
    return std::nullopt;
  }
  int local_rank = 0;
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    if (const char* v = std::getenv(var); v != nullptr) {
      local_rank = std::max(0, std::atoi(v));
      break;
    }
  }
  const device::GpuInfo& gpu = probe.gpus[local_rank % probe.gpus.size()];
  return DeviceChoice{.kind = device::DeviceKind::Cuda,
                      .gpu = gpu.ordinal,
                      .description = "cuda:" + std::to_string(gpu.ordinal) + " (" + gpu.name + ")"};
}

bool started_by_mpi_launcher() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(var) != nullptr) return true;
  return false;
}

namespace {

// NcclComm for the engine, bootstrapped through an MpiComm; the control Comm stays MpiComm.
std::optional<Ranks> open_nccl_ranks() {
#ifdef OUTCORE_LAUNCH_NCCL
  Ranks r;
  try {
    r.bootstrap = std::make_unique<comm::MpiComm>();
    r.engine = std::make_unique<comm::NcclComm>(*r.bootstrap);
    r.control = std::make_unique<comm::MpiComm>();
  } catch (const Error& e) {
    std::fprintf(stderr, "error: --comm nccl: %s\n", e.what());
    return std::nullopt;
  }
  return r;
#else
  std::fprintf(stderr,
               "error: --comm nccl: this outcore was built without NCCL (it needs the CUDA "
               "toolkit with NCCL and OpenMPI at build time)\n");
  return std::nullopt;
#endif
}

}  // namespace

std::optional<Ranks> open_ranks(const std::string& choice, bool cuda_device) {
  if (choice != "auto" && choice != "local" && choice != "mpi" && choice != "nccl") {
    std::fprintf(stderr, "error: --comm: got \"%s\"; allowed: auto, local, mpi, nccl\n",
                 choice.c_str());
    return std::nullopt;
  }
  if (choice == "nccl" && !cuda_device) {
    std::fprintf(stderr,
                 "error: --comm nccl: training does not use NCCL in this release (the ranks' "
                 "collectives run on pinned host memory, on a GPU too); use --comm mpi\n");
    return std::nullopt;
  }
#ifdef OUTCORE_LAUNCH_NCCL
  const bool nccl_built = true;
#else
  const bool nccl_built = false;
#endif
  if (choice == "nccl" || (choice == "auto" && cuda_device && nccl_built)) {
    return open_nccl_ranks();
  }
  const bool mpi = choice == "mpi" || (choice == "auto" && started_by_mpi_launcher());
  Ranks r;
  if (!mpi) {
    // Under a launcher of several processes each trains alone: N copies of one run, not one run
    // over N ranks (and a rank given another --comm waits for this one for good).
    const char* size = std::getenv("OMPI_COMM_WORLD_SIZE");
    if (size == nullptr) size = std::getenv("PMI_SIZE");
    if (choice == "local" && size != nullptr && std::atoi(size) > 1)
      log::warn(
          "--comm local: this process was started by an MPI launcher of {} processes and trains "
          "alone, as a world of one (each process given --comm local does the same); give every "
          "process --comm auto or mpi to train as one run over them",
          size);
    r.engine = std::make_unique<comm::LocalComm>();
    r.control = std::make_unique<comm::LocalComm>();
    return r;
  }
#ifdef OUTCORE_HAVE_MPI
  try {
    r.engine = std::make_unique<comm::MpiComm>();
    r.control = std::make_unique<comm::MpiComm>();
  } catch (const Error& e) {
    std::fprintf(stderr, "error: --comm mpi: %s\n", e.what());
    return std::nullopt;
  }
  return r;
#else
  std::fprintf(stderr,
               "error: --comm %s: this outcore was built without MPI (install libopenmpi-dev and "
               "rebuild)%s\n",
               choice.c_str(),
               choice == "auto" ? "; it was started by an MPI launcher (force --comm local to "
                                  "run each process alone)"
                                : "");
  return std::nullopt;
#endif
}

const char* outcore_version() { return OUTCORE_VERSION; }

namespace {

// "name\0value\0" for every pair, in order.
std::string serialize(const std::vector<std::pair<std::string, std::string>>& pairs) {
  std::string s;
  for (const auto& [k, v] : pairs) {
    s += k;
    s += '\0';
    s += v;
    s += '\0';
  }
  return s;
}

std::vector<std::pair<std::string, std::string>> deserialize(const std::string& s) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t k_end = s.find('\0', pos);
    const size_t v_end = k_end == std::string::npos ? k_end : s.find('\0', k_end + 1);
    if (v_end == std::string::npos) break;
    out.emplace_back(s.substr(pos, k_end - pos), s.substr(k_end + 1, v_end - k_end - 1));
    pos = v_end + 1;
  }
  return out;
}

// A value as the report shows it: whole up to 80 characters, else 77 of them from a little
// before `differ` (where the ranks' values first differ), "..." where some are left out.
std::string shown(const std::string* v, size_t differ) {
  if (v == nullptr) return "(not set)";
  if (v->size() <= 80) return "\"" + *v + "\"";
  const size_t begin = std::min(differ > 10 ? differ - 10 : 0, v->size() - 77);
  return "\"" + std::string(begin > 0 ? "..." : "") + v->substr(begin, 77) +
         (begin + 77 < v->size() ? "..." : "") + "\"";
}

}  // namespace

bool ranks_agree(comm::Comm& control,
                 const std::vector<std::pair<std::string, std::string>>& mine) {
  if (control.world_size() == 1) return true;
  const std::vector<std::string> all = comm::all_gather_strings(control, serialize(mine));
  if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; }))
    return true;
  // Every rank computes the same report; rank 0 prints it.
  std::vector<std::map<std::string, std::string>> maps;
  std::vector<std::string> keys;  // in rank 0's order, then any only others have
  for (const std::string& s : all) {
    maps.emplace_back();
    for (auto& [k, v] : deserialize(s)) {
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
      maps.back().emplace(std::move(k), std::move(v));
    }
  }
  std::vector<std::string> diffs;
  for (const std::string& k : keys) {
    auto value = [&](size_t r) -> const std::string* {
      auto it = maps[r].find(k);
      return it == maps[r].end() ? nullptr : &it->second;
    };
    std::string detail;
    bool differs = false;
    size_t differ = std::string::npos;  // the first character where a rank's value differs
    for (size_t r = 0; r < maps.size(); ++r) {
      const std::string *v = value(r), *v0 = value(0);
      if ((v == nullptr) != (v0 == nullptr) || (v != nullptr && *v != *v0)) differs = true;
      if (v != nullptr && v0 != nullptr && *v != *v0)
        differ = std::min(
            differ,
            static_cast<size_t>(
                std::mismatch(v->begin(), v->begin() + std::min(v->size(), v0->size()), v0->begin())
                    .first -
                v->begin()));
    }
    for (size_t r = 0; r < maps.size(); ++r)
      detail += fmt::format("{}rank {}: {}", r == 0 ? "" : ", ", r,
                            shown(value(r), differ == std::string::npos ? 0 : differ));
    if (differs) diffs.push_back(fmt::format("{} ({})", k, detail));
  }
  if (control.rank() == 0) {
    std::string shown_diffs;
    for (size_t i = 0; i < diffs.size() && i < 5; ++i)
      shown_diffs += (i == 0 ? "" : "; ") + diffs[i];
    if (diffs.size() > 5) shown_diffs += fmt::format("; and {} more", diffs.size() - 5);
    std::fprintf(stderr,
                 "error: the ranks were started with different settings: %s. Start every rank "
                 "with the same command line, config, model and data.\n",
                 shown_diffs.c_str());
  }
  return false;
}

}  // namespace outcore::cli
