// docs/configuration.md is the configuration reference: every key the parser accepts must be
// in it, and every literal default it states must be the default in models/config.hpp.
#include <gtest/gtest.h>

#include <set>

#include "models/config.hpp"
#include "tests/support/config_reference.hpp"

namespace moevement::models {
namespace {

using test_support::parse_literal;
using test_support::read_reference;

TEST(config_doc, every_key_the_parser_accepts_is_documented) {
  std::set<std::string> documented;
  for (const auto& d : read_reference()) documented.insert(d.key);
  for (const auto& key : config_keys()) {
    EXPECT_TRUE(documented.count(key)) << key << " is accepted but not in docs/configuration.md";
  }
}

TEST(config_doc, every_documented_model_and_train_key_exists_with_its_default) {
  const auto keys = config_keys();
  const std::set<std::string> accepted(keys.begin(), keys.end());
  int checked = 0;
  for (const auto& d : read_reference()) {
    if (!d.key.starts_with("model.") && !d.key.starts_with("train.")) continue;
    EXPECT_TRUE(accepted.count(d.key)) << d.key << " is documented but the parser rejects it";
    if (d.default_text == "preset" || d.key == "model.preset") continue;
    // Applying the documented default to the defaults must change nothing.
    config_map map{{d.key, parse_literal(d.default_text)}};
    model_config model;
    train_config train;
    apply_config(map, model, train);
    EXPECT_TRUE(model == model_config{} && train == train_config{})
        << d.key << ": docs say `" << d.default_text << "`, models/config.hpp says otherwise";
    ++checked;
  }
  EXPECT_GT(checked, 15) << "the reference tables were not found or not parsed";
}

}  // namespace
}  // namespace moevement::models
