// Subcommands of the `outcore` tool. Each add_*_command registers one subcommand on `app`;
// when it is chosen, its callback runs it and stores the process exit code in `rc`
// (0 success, 1 runtime failure, 2 bad input). Errors thrown as outcore::Error are printed
// by main as one line on stderr.
//
// What every command keeps: exit 0 success, 2 bad input (usage, config, data, a plan that does
// not fit, a path that cannot be used as given), 1 failure while running, 130 after a stop
// request (train_session.hpp). An option given an empty value is refused, and so are flags that
// would have no effect. Outputs that would overwrite an input, or lie where a save or a swap
// directory writes, are refused (train_session.hpp's checks). `demo` replaces only the files its
// work directory's .outcore-demo marker records with their digest. Under mpirun the ranks
// compare their settings before allocating anything (ranks_agree), and a failing rank ends the
// job (fail_job).
#pragma once

#include <CLI/CLI.hpp>

namespace outcore::cli {

void add_config_command(CLI::App& app, int& rc);
void add_train_command(CLI::App& app, int& rc);
void add_demo_command(CLI::App& app, int& rc);
void add_estimate_command(CLI::App& app, int& rc);
void add_export_command(CLI::App& app, int& rc);
void add_doctor_command(CLI::App& app, int& rc);
void add_tokenize_command(CLI::App& app, int& rc);

}  // namespace outcore::cli
