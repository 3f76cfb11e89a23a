// The tests' precompiled header (tests/meson.build): what nearly every test file parses, so
// it is parsed once per build instead of once per test executable. Only GoogleTest,
// libstdc++ and fmt; no project header, so a test still includes everything it uses.
// (no #pragma once: g++ compiles this file as a main file, and warns on it there)

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
