// Subcommands of the `outcore` tool. Each add_*_command registers one subcommand on `app`;
// when it is chosen, its callback runs it and stores the process exit code in `rc`
// (0 success, 1 runtime failure, 2 bad input). Errors thrown as outcore::Error are printed
// by main as one line on stderr.
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
