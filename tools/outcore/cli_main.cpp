// The outcore command's main (tools/outcore/main.cpp calls it): the process's settings, then
// every subcommand registered and the one given run.
#include "tools/outcore/cli_main.hpp"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <new>
#include <string>

#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "tools/blas/blas_kernels.hpp"
#include "tools/env_settings.hpp"
#include "tools/outcore/commands.hpp"
#include "tools/outcore/stop_signals.hpp"
#include "tools/outcore/train_session.hpp"

namespace outcore::cli {

int run_main(int argc, char** argv) {
  // Before anything is opened: a closed stderr would otherwise be the stop watcher's pipe, and
  // the first message a signal to it.
  outcore::open_missing_standard_streams();
  // A process ended by exit() while files are registered for cleanup (a data-parallel rank
  // whose launcher is gone: OpenMPI exits it) removes them first; a normal end has removed
  // and unregistered them already.
  std::atexit([] { outcore::cleanup::remove_registered_files(outcore::cleanup::Scope::kAll); });
  // A write past the file-size limit (ulimit -f) fails with EFBIG, reported and cleaned up as
  // any other failed write is, instead of SIGXFSZ ending the process in the middle of it.
  std::signal(SIGXFSZ, SIG_IGN);
  outcore::cli::catch_early_mpirun_stop();
  outcore::tools::select_blas_kernels(argv);
  outcore::tools::select_openmp_waiting(argv);
  outcore::log::init("info");
  outcore::tools::apply_environment_settings();
  CLI::App app{"outcore: out-of-core training of Llama-family models with DeepSpeed configs"};
  app.require_subcommand(1);
  int rc = 0;
  outcore::cli::add_config_command(app, rc);
  outcore::cli::add_train_command(app, rc);
  outcore::cli::add_demo_command(app, rc);
  outcore::cli::add_estimate_command(app, rc);
  outcore::cli::add_export_command(app, rc);
  outcore::cli::add_doctor_command(app, rc);
  outcore::cli::add_tokenize_command(app, rc);
  // An option given an empty value ("--save-dir ''") is a mistake, never "not given".
  const CLI::Validator not_empty(
      [](std::string& value) { return value.empty() ? std::string("an empty value") : ""; }, "");
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
    for (CLI::Option* opt : sub->get_options()) {
      if (opt->get_expected_min() > 0) opt->check(not_empty);
      // One option given both ways ("export CKPT OUT --out OUT2"): say so, not CLI11's
      // "At Most 1 required but received 2".
      if (opt->get_positional() && !opt->get_lnames().empty() && opt->get_expected_max() == 1) {
        auto seen = std::make_shared<int>(0);
        const std::string both = fmt::format("given twice: the argument {} and --{} are one option",
                                             opt->get_name(true), opt->get_lnames().front());
        opt->check(CLI::Validator(
            [seen, both](std::string&) { return ++*seen > 1 ? both : std::string(); }, ""));
      }
    }
  // A usage mistake reads as every other error does: one line starting "error: ".
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("error: {}\nRun with --help for more information.\n", e.what());
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help exits 0; every usage mistake is bad input: exit 2.
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const outcore::ConfigError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const outcore::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    return report_filesystem_error(e, "");
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "error: out of memory: an allocation the command needed was refused (by the "
                 "machine's free memory, or ulimit -v)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  // Results go to stdout: a full disk or a closed file there fails the command, never exit 0
  // with the results lost.
  std::cout.flush();
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout) {
    const int err = errno;
    std::fprintf(stderr, "error: writing the results to standard output failed%s%s\n",
                 err != 0 ? ": " : "", err != 0 ? std::strerror(err) : "");
    return rc != 0 ? rc : 1;
  }
  return rc;
}

}  // namespace outcore::cli
