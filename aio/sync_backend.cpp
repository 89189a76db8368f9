// IoBackend doing plain pread/pwrite at submit(): a reference for tests and a fallback where
// io_uring is unavailable.
#include <unistd.h>

#include <cerrno>
#include <vector>

#include "aio/aio.hpp"

namespace outcore::aio {
namespace {

class SyncQueue final : public IoQueue {
 public:
  explicit SyncQueue(unsigned depth) : depth_(depth) {
    prepared_.reserve(depth);
    done_.reserve(depth);
  }

  bool prepare(const IoRequest& r) override {
    if (prepared_.size() + done_.size() >= depth_) return false;
    prepared_.push_back(r);
    return true;
  }

  int submit() override {
    int n = static_cast<int>(prepared_.size());
    for (const IoRequest& r : prepared_) done_.push_back({r.user_data, transfer(r)});
    prepared_.clear();
    return n;
  }

  int reap(std::span<IoCompletion> out, std::chrono::nanoseconds) override {
    size_t n = std::min(out.size(), done_.size());
    for (size_t i = 0; i < n; ++i) out[i] = done_[i];
    done_.erase(done_.begin(), done_.begin() + static_cast<std::ptrdiff_t>(n));
    return static_cast<int>(n);
  }

 private:
  static int32_t transfer(const IoRequest& r) {
    ssize_t rc;
    do {
      rc = r.write ? ::pwrite(r.fd, r.buf, r.len, static_cast<off_t>(r.offset))
                   : ::pread(r.fd, r.buf, r.len, static_cast<off_t>(r.offset));
    } while (rc < 0 && errno == EINTR);
    return rc < 0 ? -errno : static_cast<int32_t>(rc);
  }

  unsigned depth_;
  std::vector<IoRequest> prepared_;
  std::vector<IoCompletion> done_;
};

class SyncBackend final : public IoBackend {
 public:
  std::unique_ptr<IoQueue> make_queue(unsigned depth) override {
    return std::make_unique<SyncQueue>(depth);
  }
  std::string name() const override { return "sync"; }
};

}  // namespace

std::unique_ptr<IoBackend> make_sync_backend() { return std::make_unique<SyncBackend>(); }

}  // namespace outcore::aio
