// unique_function: a move-only std::function (C++23's move_only_function is not in C++20).
// Holds Asio completion handlers, which cannot be copied.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace moevement::actors {

template <class Signature>
class unique_function;

template <class R, class... Args>
class unique_function<R(Args...)> {
 public:
  unique_function() = default;
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, unique_function>>>
  unique_function(F&& f)  // NOLINT: implicit, like std::function
      : impl_(std::make_unique<model<std::decay_t<F>>>(std::forward<F>(f))) {}

  explicit operator bool() const { return impl_ != nullptr; }
  R operator()(Args... args) { return impl_->call(std::forward<Args>(args)...); }

 private:
  struct concept_t {
    virtual ~concept_t() = default;
    virtual R call(Args... args) = 0;
  };
  template <class F>
  struct model final : concept_t {
    explicit model(F&& f) : fn(std::move(f)) {}
    explicit model(const F& f) : fn(f) {}
    R call(Args... args) override { return fn(std::forward<Args>(args)...); }
    F fn;
  };
  std::unique_ptr<concept_t> impl_;
};

}  // namespace moevement::actors
