// docs/configuration.md must list every engine key (parallel.*, checkpoint.*, cluster.*,
// engine.*) that resolve_job accepts, with the default that engine/job_config.hpp has.
#include <gtest/gtest.h>

#include <set>

#include "engine/job_config.hpp"
#include "tests/support/config_reference.hpp"

namespace moevement::engine {
namespace {

using test_support::parse_literal;
using test_support::read_reference;

bool engine_section(const std::string& key) {
  for (const char* s : {"parallel.", "checkpoint.", "cluster.", "engine."}) {
    if (key.starts_with(s)) return true;
  }
  return false;
}

TEST(engine_config_doc, every_engine_key_is_documented) {
  std::set<std::string> documented;
  for (const auto& d : read_reference()) documented.insert(d.key);
  for (const auto& key : job_config_keys()) {
    EXPECT_TRUE(documented.count(key)) << key << " is accepted but not in docs/configuration.md";
  }
}

TEST(engine_config_doc, every_documented_engine_key_exists_with_its_default) {
  const auto keys = job_config_keys();
  const std::set<std::string> accepted(keys.begin(), keys.end());
  const job_config defaults = resolve_job({});
  int checked = 0;
  for (const auto& d : read_reference()) {
    if (!engine_section(d.key)) continue;
    EXPECT_TRUE(accepted.count(d.key)) << d.key << " is documented but resolve_job rejects it";
    if (!accepted.count(d.key)) continue;
    // Setting the documented default must change nothing.
    job_config got;
    try {
      got = resolve_job({{d.key, parse_literal(d.default_text)}});
    } catch (const models::config_error& e) {
      ADD_FAILURE() << d.key << ": the documented default `" << d.default_text
                    << "` is rejected: " << e.what();
      continue;
    }
    EXPECT_EQ(got, defaults) << d.key << ": docs say `" << d.default_text
                             << "`, engine/job_config.hpp says otherwise";
    ++checked;
  }
  EXPECT_EQ(checked, int(keys.size())) << "not every engine key has a documented default";
}

}  // namespace
}  // namespace moevement::engine
