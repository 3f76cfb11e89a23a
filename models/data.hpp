// Real text, bytes as tokens. The corpus is every regular file of a directory (sorted by
// name, `.dat` index files skipped) or one file; its tail is held out for validation.
// A batch's position is a pure function of (seed, split, iteration, replica, micro-batch, row):
// resuming or replaying any micro-batch needs no loader state.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moevement::models {

enum class split : std::uint8_t { train, val };

class corpus {
 public:
  // Throws config_error("train.corpus") when the path is missing, unreadable or too short.
  static corpus load(const std::string& path, double val_fraction, int seq_len);
  // From memory (tests).
  corpus(std::vector<std::uint8_t> bytes, double val_fraction, int seq_len);

  std::span<const std::uint8_t> data(split s) const { return s == split::train ? train_ : val_; }
  std::size_t size() const { return train_.size() + val_.size(); }

 private:
  std::vector<std::uint8_t> train_, val_;
};

// tokens, targets [B,T]: row b is data[p .. p+T) and data[p+1 .. p+T+1) for a position p drawn
// from (seed, split, iteration, replica, micro_batch, b).
void fill_batch(const corpus& c, split s, std::uint64_t seed, std::int64_t iteration, int replica,
                int micro_batch, int b, int t, std::int32_t* tokens, std::int32_t* targets);

}  // namespace moevement::models
