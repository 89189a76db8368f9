// The outcore command's entry point, in the command library (outcore_cli) so that the shipped
// binary and the tests' binary with test hooks share one compiled copy.
#pragma once

namespace outcore::cli {

// Sets up the process (cleanup at exit, SIGXFSZ ignored, the early stop handler, OpenBLAS's
// kernels, logging, the environment's settings), parses argv and runs the subcommand given.
// Returns the process's exit code: 0 success, 1 failure while running, 2 bad input, 130 stopped.
int run_main(int argc, char** argv);

}  // namespace outcore::cli
