// Checks of every Comm collective against values computed independently from the rank
// arithmetic, shared by the LocalComm test and the mpirun worker. Each check returns the
// list of mismatches (empty when the collective behaved).
#pragma once

#include <string>
#include <vector>

#include "engine/comm/comm.hpp"

namespace outcore::comm::testing {

// Runs every collective with shard sizes that do not divide evenly into anything, both out
// of place and in place, and the argument errors. Collective: every rank must call it.
std::vector<std::string> check_all_collectives(Comm& comm);

}  // namespace outcore::comm::testing
