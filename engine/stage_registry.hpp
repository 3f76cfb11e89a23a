// Stage types by name: the config's `engine.stage` selects one. The built-in "moe" is the MoE
// transformer (make_moe_stage); a program with custom stages builds a registry with its own
// types added and hands it to the launcher (examples/custom_stage). No global registry: the
// worker processes are the same program, so they build the same one.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/stage_model.hpp"

namespace moevement::engine {

using stage_factory = std::function<std::unique_ptr<stage_model>(const stage_setup&)>;

class stage_registry {
 public:
  // With the built-in types ("moe").
  static stage_registry with_builtins();

  // Throws std::invalid_argument when the name is taken or not [a-z0-9_]+.
  void add(const std::string& name, stage_factory factory);
  // Throws models::config_error("engine.stage") naming the registered types.
  const stage_factory& find(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, stage_factory> types_;
};

}  // namespace moevement::engine
