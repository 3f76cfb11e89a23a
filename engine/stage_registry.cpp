#include "engine/stage_registry.hpp"

#include <stdexcept>

namespace moevement::engine {

stage_registry stage_registry::with_builtins() {
  stage_registry r;
  r.add("moe", [](const stage_setup& s) { return make_moe_stage(s); });
  return r;
}

void stage_registry::add(const std::string& name, stage_factory factory, stage_spawner spawner) {
  if (name.empty() ||
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos) {
    throw std::invalid_argument("stage type name '" + name +
                                "' must be lower-case letters, digits and _");
  }
  if (!types_.emplace(name, stage_type{std::move(factory), std::move(spawner)}).second) {
    throw std::invalid_argument("stage type '" + name + "' is already registered");
  }
}

const stage_factory& stage_registry::find(const std::string& name) const {
  return type(name).model;
}

const stage_spawner& stage_registry::spawner(const std::string& name) const {
  return type(name).spawn;
}

const stage_registry::stage_type& stage_registry::type(const std::string& name) const {
  auto it = types_.find(name);
  if (it == types_.end()) {
    std::string known;
    for (const auto& [n, f] : types_) known += (known.empty() ? "" : ", ") + n;
    throw models::config_error("engine.stage",
                               "unknown stage type '" + name + "' (registered: " + known + ")");
  }
  return it->second;
}

std::vector<std::string> stage_registry::names() const {
  std::vector<std::string> out;
  for (const auto& [n, f] : types_) out.push_back(n);
  return out;
}

}  // namespace moevement::engine
