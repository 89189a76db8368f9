// outcore: train transformer models larger than device memory and host RAM.
#include "tools/outcore/cli_main.hpp"

int main(int argc, char** argv) { return outcore::cli::run_main(argc, argv); }
