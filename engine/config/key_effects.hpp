// Internal to engine/config and its tests: what every key of the config does in outcore.
//
// Each leaf key that config::to_json prints is either honoured (it changes what outcore does;
// `note` names the test that shows it: "<file>: <Suite.Test>") or has no effect in outcore
// (`note` says why); a no-effect key set to anything but its default draws one warning naming
// its path and the reason (parse_config), so nothing a user sets is silently dropped.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "engine/config/config.hpp"

namespace outcore::config::detail {

struct KeyEffect {
  std::string_view path;  // dotted JSON path as to_json prints it ("zero_optimization.stage")
  bool honoured;
  std::string_view note;  // honoured: the behaviour test; otherwise: why it has no effect
};

std::span<const KeyEffect> key_effects();

// Warnings (path, message) for every no-effect key whose value in `cfg` differs from the
// default; "auto" never warns (it means the default). The optimizer's lr and betas, which a
// scheduler overrides, warn whenever `file` (the parsed config, if given) writes them.
std::vector<ConfigIssue> keys_without_effect(const Config& cfg,
                                             const nlohmann::ordered_json* file = nullptr);

}  // namespace outcore::config::detail
