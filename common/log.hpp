// Logging: human-readable lines on stderr through spdlog. Results go to stdout, never here.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace outcore::log {

// Routes the default logger to stderr with a short pattern and sets its level ("debug",
// "info", "warn", "error"). Called once by each tool's main; safe to call again.
void init(std::string_view level = "info");

using spdlog::debug;
using spdlog::error;
using spdlog::info;
using spdlog::warn;

}  // namespace outcore::log
