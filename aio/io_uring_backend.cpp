// IoBackend on io_uring (liburing): one ring per queue, created by and used from one thread.
#include <liburing.h>

#include <cerrno>
#include <vector>

#include "aio/aio.hpp"

namespace outcore::aio {
namespace {

constexpr unsigned kFileSlots = 64;

class UringQueue final : public IoQueue {
 public:
  explicit UringQueue(unsigned depth) {
    // SINGLE_ISSUER and COOP_TASKRUN fit the one-thread-per-ring model and save an IPI per
    // completion; older kernels refuse them, so fall back to a plain ring.
    io_uring_params p{};
    p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
    int rc = io_uring_queue_init_params(depth, &ring_, &p);
    if (rc == -EINVAL) {
      p = {};
      rc = io_uring_queue_init_params(depth, &ring_, &p);
    }
    if (rc < 0) throw IoError("io_uring", -rc, "io_uring_queue_init");
  }
  ~UringQueue() override { io_uring_queue_exit(&ring_); }

  bool prepare(const IoRequest& r) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) return false;
    int fd = r.fixed_file >= 0 ? r.fixed_file : r.fd;
    if (r.buf_index >= 0) {
      if (r.write) {
        io_uring_prep_write_fixed(sqe, fd, r.buf, r.len, r.offset, r.buf_index);
      } else {
        io_uring_prep_read_fixed(sqe, fd, r.buf, r.len, r.offset, r.buf_index);
      }
    } else if (r.write) {
      io_uring_prep_write(sqe, fd, r.buf, r.len, r.offset);
    } else {
      io_uring_prep_read(sqe, fd, r.buf, r.len, r.offset);
    }
    if (r.fixed_file >= 0) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, r.user_data);
    return true;
  }

  int submit() override { return io_uring_submit(&ring_); }

  int reap(std::span<IoCompletion> out, std::chrono::nanoseconds timeout) override {
    io_uring_cqe* cqe = nullptr;
    int rc;
    if (timeout.count() < 0) {
      rc = io_uring_wait_cqe(&ring_, &cqe);
    } else if (timeout.count() == 0) {
      rc = io_uring_peek_cqe(&ring_, &cqe);
    } else {
      __kernel_timespec ts{};
      ts.tv_sec = timeout.count() / 1000000000;
      ts.tv_nsec = timeout.count() % 1000000000;
      rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
    }
    if (rc == -EAGAIN || rc == -ETIME || rc == -EINTR) return 0;
    if (rc < 0) return rc;
    unsigned head;
    unsigned n = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      if (n == out.size()) break;
      out[n].user_data = io_uring_cqe_get_data64(cqe);
      out[n].res = cqe->res;
      ++n;
    }
    io_uring_cq_advance(&ring_, n);
    return static_cast<int>(n);
  }

  int register_buffers(std::span<const std::span<std::byte>> bufs) override {
    unregister_buffers();
    std::vector<iovec> iov;
    iov.reserve(bufs.size());
    for (auto b : bufs) iov.push_back({b.data(), b.size()});
    int rc = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    buffers_registered_ = rc == 0;
    return rc;
  }

  int unregister_buffers() override {
    if (!buffers_registered_) return 0;
    buffers_registered_ = false;
    return io_uring_unregister_buffers(&ring_);
  }

  int register_file(int slot, int fd) override {
    if (slot < 0 || slot >= static_cast<int>(kFileSlots)) return -EINVAL;
    if (!files_registered_) {
      int rc = io_uring_register_files_sparse(&ring_, kFileSlots);
      if (rc < 0) return rc;
      files_registered_ = true;
    }
    int rc = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1);
    return rc < 0 ? rc : 0;
  }

 private:
  io_uring ring_{};
  bool buffers_registered_ = false;
  bool files_registered_ = false;
};

class UringBackend final : public IoBackend {
 public:
  std::unique_ptr<IoQueue> make_queue(unsigned depth) override {
    return std::make_unique<UringQueue>(depth);
  }
  std::string name() const override { return "io_uring"; }
};

}  // namespace

std::unique_ptr<IoBackend> make_io_uring_backend() { return std::make_unique<UringBackend>(); }

}  // namespace outcore::aio
