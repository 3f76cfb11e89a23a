#include "engine/stage_registry.hpp"

#include <stdexcept>

namespace moevement::engine {

stage_registry stage_registry::with_builtins() {
  stage_registry r;
  r.add(
      "moe", [](const stage_setup& s) { return make_moe_stage(s); }, {},
      stage_traits{.expert_parallel = true});
  return r;
}

void stage_registry::add(const std::string& name, stage_factory factory, stage_spawner spawner,
                         stage_traits traits) {
  if (name.empty() ||
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_") != std::string::npos) {
    throw std::invalid_argument("stage type name '" + name +
                                "' must be lower-case letters, digits and _");
  }
  if (!types_.emplace(name, stage_type{std::move(factory), std::move(spawner), traits}).second) {
    throw std::invalid_argument("stage type '" + name + "' is already registered");
  }
}

const stage_factory& stage_registry::find(const std::string& name) const {
  return type(name).model;
}

const stage_spawner& stage_registry::spawner(const std::string& name) const {
  return type(name).spawn;
}

const stage_traits& stage_registry::traits(const std::string& name) const {
  return type(name).traits;
}

void stage_registry::check_expert_parallel(const std::string& name, int ep) const {
  if (ep <= 1 || traits(name).expert_parallel) return;
  throw models::config_error("parallel.ep",
                             "stage type \"" + name +
                                 "\" has no experts to shard (it is not registered with "
                                 "stage_traits::expert_parallel); use parallel.ep = 1");
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
