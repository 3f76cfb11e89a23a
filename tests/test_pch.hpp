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

// Asio and Cap'n Proto: the actor layer's headers include them, and nearly every test reaches
// the actor layer; parsing them once per build instead of once per test file is most of what
// a test file costs to compile (system headers: no project header here still).
#include <capnp/message.h>
#include <kj/exception.h>
#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/steady_timer.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>
