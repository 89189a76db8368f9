// The command-line tail shared by aio_bench and bench_aio.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
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
    return run();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace outcore::aio_bench
