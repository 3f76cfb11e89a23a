// stage_actor's validation rounds: each batch through the pipeline on every stage's replica 0,
// the last stage's loss to the coordinator (docs/engine.md).
#include <algorithm>

#include "engine/stage_actor.hpp"

namespace moevement::engine {

namespace {

using asio::awaitable;
using transport::read_descriptor;

}  // namespace

awaitable<void> stage_actor::validate(wire::Validate::Reader m) {
  if (!setup_.first() || setup_.replica != 0 || m.getBatches() != setup_.train.val_batches) {
    ++dropped_;
    co_return;
  }
  const std::uint64_t round = m.getRound();
  const std::span<const float> none;  // the first stage reads its own batch
  for (int i = 0; i < m.getBatches() && !failed_; ++i) co_await validate_one(round, i, none);
}

awaitable<void> stage_actor::val_activation(wire::ValActivation::Reader m) {
  const int i = m.getIndex();
  auto d = read_descriptor(m.getTensor());
  if (setup_.first() || i < 0 || i >= setup_.train.val_batches || !d.ok() ||
      d->length != bf_ * sizeof(float)) {
    ++dropped_;
    co_return;
  }
  const std::uint64_t round = m.getRound();
  if (!co_await pull(*d, in_->val)) co_return;
  co_await validate_one(round, i, in_->val);
}

// Validation batch i on this stage: its loss to the coordinator (last stage) or its activation
// down the pipeline.
awaitable<void> stage_actor::validate_one(std::uint64_t round, int i, std::span<const float> x) {
  stage_output out;
  std::string error;
  co_await compute([&] {
    try {
      out = model_->validate(i, x);
    } catch (const std::exception& e) {  // an expert exchange stopped (a peer lost)
      error = e.what();
      return;
    }
    if (!setup_.last() && out.activation.size() == bf_) {
      auto slot = region_floats(val_out_).subspan(std::size_t(i) * bf_, bf_);
      std::copy(out.activation.begin(), out.activation.end(), slot.begin());
    }
  });
  if (!error.empty()) {
    fail("validation: " + error);
    co_return;
  }
  if (setup_.last()) {
    const double loss = out.loss;
    (void)tell<wire::ValLoss>(coordinator_, [&](wire::ValLoss::Builder b) {
      b.setRound(round);
      b.setIndex(i);
      b.setLoss(loss);
    });
  } else {
    const auto d = val_out_.describe(std::size_t(i) * bf_ * sizeof(float), bf_ * sizeof(float));
    (void)tell<wire::ValActivation>(next_, [&](wire::ValActivation::Builder b) {
      b.setRound(round);
      b.setIndex(i);
      transport::write_descriptor(b.initTensor(), d);
    });
  }
}

}  // namespace moevement::engine
