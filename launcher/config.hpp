// The TOML config file and `--set key=value` overrides, as a flat map of dotted keys that each
// layer consumes its own sections from (models: model.* and train.*; the engine: its own).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "models/config.hpp"

namespace moevement::launcher {

// Reads a TOML file into dotted keys. Nested tables become "a.b.c"; the i-th table (from 0) of
// an array of tables [[a]] becomes "a.i.KEY"; values must be booleans, integers, floats or
// strings (no other arrays). Throws std::runtime_error with the file, line and key on error.
models::config_map load_config_file(const std::string& path);

// Applies one "key=value" override. The value is typed like TOML: true/false, an integer, a
// float, or else a string (quotes optional). A key absent from the file is added.
void apply_override(models::config_map& map, std::string_view assignment);

// Sections `moevement train` accepts and ignores (they belong to the distributed engine), so
// that one config file serves both `train` and `launch`.
bool is_engine_section(std::string_view key);

// What one micro-batch needs at the least on the stage that holds the head: its logits and
// one residual stream, in fp32 (B x T x (vocab + d_model) x 4 bytes). A lower bound: what a
// config needs beyond it is not checked here.
std::uint64_t micro_batch_floor_bytes(const models::model_config& model,
                                      const models::train_config& train);
// Throws models::config_error naming train.micro_batch_size when that floor exceeds
// `host_bytes` (0: this host's physical memory): an error before anything starts, not an
// out-of-memory kill later.
void check_host_memory(const models::model_config& model, const models::train_config& train,
                       std::uint64_t host_bytes = 0);

// The integer value of a command-line flag, in [lo, hi]; throws std::invalid_argument naming
// the flag otherwise.
long flag_number(const std::string& flag, const std::string& value, long lo, long hi);

}  // namespace moevement::launcher
