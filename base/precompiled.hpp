// The libraries' precompiled header (base/meson.build): the system headers most library files
// parse (libstdc++, fmt, Asio, Cap'n Proto), parsed once per build instead of once per file.
// No project header, so every file still includes everything it uses.
// (no #pragma once: g++ compiles this file as a main file, and warns on it there)

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

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
