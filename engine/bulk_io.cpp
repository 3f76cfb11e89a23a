#include "engine/bulk_io.hpp"

#include <asio/async_result.hpp>
#include <asio/use_awaitable.hpp>

namespace moevement::engine {

asio::awaitable<result<void>> bulk_io::pull(transport::bulk_descriptor from,
                                            std::span<std::byte> into, std::shared_ptr<void> keep) {
  if (into.size() != from.length) {
    co_return error{"pull: the descriptor names " + std::to_string(from.length) + " bytes where " +
                    std::to_string(into.size()) + " were expected"};
  }
  auto initiate = [this, from, into, keep = std::move(keep)](auto handler) mutable {
    // ucx_link's callback is a copyable std::function; the awaitable's handler is move-only.
    auto shared = std::make_shared<decltype(handler)>(std::move(handler));
    link_.pull(from, into, [shared, keep](result<void> r) mutable { (*shared)(std::move(r)); });
  };
  co_return co_await asio::async_initiate<decltype(asio::use_awaitable), void(result<void>)>(
      std::move(initiate), asio::use_awaitable);
}

}  // namespace moevement::engine
