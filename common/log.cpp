#include "common/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace outcore::log {

void init(std::string_view level) {
  static auto logger = [] {
    auto l = spdlog::stderr_color_mt("outcore");
    l->set_pattern("%^%l%$: %v");
    spdlog::set_default_logger(l);
    return l;
  }();
  logger->set_level(spdlog::level::from_str(std::string(level)));
}

}  // namespace outcore::log
