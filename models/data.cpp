#include "models/data.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "models/config.hpp"
#include "models/rng.hpp"

namespace moevement::models {

namespace fs = std::filesystem;

namespace {
std::vector<std::uint8_t> read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw config_error("train.corpus", fmt::format("cannot read '{}'", p.string()));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
}  // namespace

corpus corpus::load(const std::string& path, double val_fraction, int seq_len) {
  std::error_code ec;
  const fs::path root(path);
  if (!fs::exists(root, ec)) {
    throw config_error("train.corpus",
                       fmt::format("'{}' does not exist (install Debian's fortunes package, or "
                                   "point train.corpus at a text file or directory)",
                                   path));
  }
  std::vector<std::uint8_t> bytes;
  if (fs::is_directory(root, ec)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(root)) {
      // regular files only: fortunes has .u8 symlinks to the same text and .dat indexes
      if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat") continue;
      files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      const auto b = read_file(f);
      bytes.insert(bytes.end(), b.begin(), b.end());
    }
  } else {
    bytes = read_file(root);
  }
  return corpus(std::move(bytes), val_fraction, seq_len);
}

corpus::corpus(std::vector<std::uint8_t> bytes, double val_fraction, int seq_len) {
  const auto n_val = static_cast<std::size_t>(double(bytes.size()) * val_fraction);
  const std::size_t need = std::size_t(seq_len) + 2;
  if (n_val < need || bytes.size() - n_val < need) {
    throw config_error("train.corpus",
                       fmt::format("{} bytes are too few for sequences of {} (train.seq_len) with "
                                   "a validation fraction of {}",
                                   bytes.size(), seq_len, val_fraction));
  }
  train_.assign(bytes.begin(), bytes.end() - std::ptrdiff_t(n_val));
  val_.assign(bytes.end() - std::ptrdiff_t(n_val), bytes.end());
}

void fill_batch(const corpus& c, split s, std::uint64_t seed, std::int64_t iteration, int replica,
                int micro_batch, int b, int t, std::int32_t* tokens, std::int32_t* targets) {
  const auto data = c.data(s);
  const std::uint64_t positions = data.size() - std::size_t(t) - 1;
  const auto key =
      make_key({seed, 0x64617461 /*"data"*/, std::uint64_t(s), std::uint64_t(iteration),
                std::uint64_t(replica), std::uint64_t(micro_batch)});
  for (int i = 0; i < b; ++i) {
    const std::uint64_t p = random_bits(key, std::uint64_t(i)) % positions;
    for (int j = 0; j < t; ++j) {
      tokens[i * t + j] = data[p + j];
      targets[i * t + j] = data[p + j + 1];
    }
  }
}

}  // namespace moevement::models
