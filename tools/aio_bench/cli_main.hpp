// The command-line tail shared by aio_bench and bench_aio.
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>

#include "tools/aio_bench/scratch.hpp"

namespace outcore::aio_bench {

// Parses argv into `app`, then returns run(). Exit codes: --help 0; a usage mistake or a
// UsageError 2; any other exception 1. Each error is one line on stderr prefixed with `name`.
template <typename Run>
int parse_and_run(CLI::App& app, const char* name, int argc, char** argv, Run&& run) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "%s: %s (see --help)\n", name, e.what());
    return 2;
  }
  try {
    const int rc = run();
    // Results that never reached their reader (a full disk, a closed pipe) are a failure.
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
      std::fprintf(stderr, "%s: cannot write the results to stdout: %s\n", name,
                   std::strerror(errno));
      return 1;
    }
    return rc;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace outcore::aio_bench
