// result<T>: the expected-style return type of hot paths (g++ 12 has no std::expected).
// API boundaries throw instead; a result that holds an error throws it when read as a value.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace moevement {

// What went wrong, said so that the reader knows what to do next.
struct error {
  std::string message;
};

class bad_result_access : public std::runtime_error {
 public:
  explicit bad_result_access(const error& e) : std::runtime_error(e.message) {}
};

template <class T>
class result {
 public:
  result(T value) : state_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit
  result(error e) : state_(std::in_place_index<1>, std::move(e)) {}      // NOLINT: implicit

  bool ok() const { return state_.index() == 0; }
  explicit operator bool() const { return ok(); }

  T& value() & {
    if (!ok()) throw bad_result_access(std::get<1>(state_));
    return std::get<0>(state_);
  }
  const T& value() const& {
    if (!ok()) throw bad_result_access(std::get<1>(state_));
    return std::get<0>(state_);
  }
  T&& value() && {
    if (!ok()) throw bad_result_access(std::get<1>(state_));
    return std::get<0>(std::move(state_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  // Only valid when !ok().
  const error& err() const { return std::get<1>(state_); }

 private:
  std::variant<T, error> state_;
};

template <>
class result<void> {
 public:
  result() = default;
  result(error e) : error_(std::move(e)), ok_(false) {}  // NOLINT: implicit
  bool ok() const { return ok_; }
  explicit operator bool() const { return ok_; }
  void value() const {
    if (!ok_) throw bad_result_access(error_);
  }
  const error& err() const { return error_; }

 private:
  error error_;
  bool ok_ = true;
};

}  // namespace moevement
