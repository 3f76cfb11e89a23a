#include "engine/expert_router.hpp"

#include <fmt/format.h>
#include <asio/post.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace moevement::engine {

using transport::read_descriptor;

expert_router::expert_router(actors::actor_system& system, bulk_io& io, const stage_setup& setup)
    : system_(system),
      rank_(setup.replica % setup.train.expert_parallel),
      ep_(setup.train.expert_parallel),
      experts_(setup.model.experts),
      c_(setup.model.d_model),
      max_floats_(std::size_t(setup.train.micro_batch_size) * std::size_t(setup.train.seq_len) *
                  std::size_t(setup.model.top_k) * std::size_t(setup.model.d_model)) {
  const std::size_t bytes = std::size_t(ep_) * max_floats_ * sizeof(float);
  rows_out_ = io.allocate(bytes);
  answers_out_ = io.allocate(bytes);
  rows_in_.assign(std::size_t(ep_), std::vector<float>(max_floats_));
  answers_in_.assign(std::size_t(ep_), std::vector<float>(max_floats_));
  awaited_.resize(std::size_t(ep_));
  backwards_.assign(std::size_t(ep_), 0);
  expected_backwards_ = setup.train.micro_batches;  // times the layers: attach()
  shape_ = {rank_, ep_, experts_, c_, max_floats_, 0, 0, setup.train.micro_batches};
}

void expert_router::attach(models::expert_shard* shard) {
  shard_ = shard;
  shape_.first_layer = shard->range().first_layer;
  shape_.last_layer = shard->range().last_layer;
  std::lock_guard lk(mu_);
  expected_backwards_ *= shard->layers();
}

bool expert_router::complete() const {
  std::lock_guard lk(mu_);
  return complete_held();
}

bool expert_router::complete_held() const {
  return std::all_of(backwards_.begin(), backwards_.end(),
                     [&](int n) { return n >= expected_backwards_; });
}

void expert_router::drain() {
  for (;;) {
    std::vector<request> todo;
    {
      std::unique_lock lk(mu_);
      const compute_watch::peer_wait waiting(watch_.get());
      cv_.wait(lk, [&] {
        return stopped_ || complete_held() ||
               std::any_of(requests_.begin(), requests_.end(),
                           [&](const request& q) { return q.mb < 0 || q.epoch <= epoch_; });
      });
      if (stopped_) throw exchange_stopped(why_);
      if (complete_held()) return;
      todo = take_servable();
    }
    for (const request& r : todo) serve(r);
  }
}

void expert_router::backward_done(int source) {
  bool now = false;
  {
    std::lock_guard lk(mu_);
    const int n = ++backwards_[std::size_t(source)];
    now = n == expected_backwards_ && std::all_of(backwards_.begin(), backwards_.end(),
                                                  [&](int b) { return b >= expected_backwards_; });
  }
  if (now && on_complete_) on_complete_();
}

std::span<float> expert_router::slot(const transport::bulk_region& region, int k) const {
  auto bytes = region.memory();
  auto* f = reinterpret_cast<float*>(bytes.data());
  return {f + std::size_t(k) * max_floats_, max_floats_};
}

void expert_router::forward(int layer, int mb, std::span<const int> offsets,
                            std::span<const float> xs, std::span<float> ye, bool training) {
  exchange(layer, mb, false, training, offsets, xs, ye);
}

void expert_router::backward(int layer, int mb, std::span<const int> offsets,
                             std::span<const float> d_ye, std::span<float> d_xs) {
  exchange(layer, mb, true, true, offsets, d_ye, d_xs);
}

void expert_router::exchange(int layer, int mb, bool backward, bool training,
                             std::span<const int> offsets, std::span<const float> in,
                             std::span<float> out) {
  if (shard_ == nullptr) throw std::logic_error("expert_router: no shard attached");
  if (offsets.size() != std::size_t(experts_) + 1 || in.size() != out.size()) {
    throw std::invalid_argument("expert_router: offsets or tensors do not fit the experts");
  }
  const int per = experts_ / ep_;
  // what owner k gets: its experts' row counts, and where their rows are
  std::vector<request> to(static_cast<std::size_t>(ep_));
  std::vector<std::size_t> first(static_cast<std::size_t>(ep_));
  const std::uint64_t seq = ++seq_;
  {
    std::lock_guard lk(mu_);
    if (stopped_) throw exchange_stopped(why_);
    for (int k = 0; k < ep_; ++k) {
      request& r = to[std::size_t(k)];
      r = {rank_, layer, mb, backward, training ? epoch_ : 0, seq, {}, 0};
      for (int j = k * per; j < (k + 1) * per; ++j) r.rows.push_back(offsets[j + 1] - offsets[j]);
      first[std::size_t(k)] = std::size_t(offsets[k * per]) * std::size_t(c_);
      r.floats = std::size_t(offsets[(k + 1) * per] - offsets[k * per]) * std::size_t(c_);
      if (r.floats > max_floats_) throw std::invalid_argument("expert_router: too many rows");
      if (k != rank_) {
        awaited_[std::size_t(k)] = {true, false, layer, mb, backward, r.epoch, seq, r.floats, {}};
      }
    }
  }
  for (int k = 0; k < ep_; ++k) {
    if (k == rank_) continue;
    const request& r = to[std::size_t(k)];
    const auto src = in.subspan(first[std::size_t(k)], r.floats);
    std::copy(src.begin(), src.end(), slot(rows_out_, k).begin());
    send_rows(k, r);
  }
  {  // this replica's own experts: here
    const request& r = to[std::size_t(rank_)];
    const auto mine_in = in.subspan(first[std::size_t(rank_)], r.floats);
    const auto mine_out = out.subspan(first[std::size_t(rank_)], r.floats);
    if (backward) {
      shard_->backward(rank_, layer, mb, mine_in, mine_out);
      backward_done(rank_);
    } else {
      shard_->forward(rank_, layer, mb, r.rows, mine_in, mine_out, training);
    }
  }
  int left = ep_ - 1;
  while (left > 0) {
    std::vector<request> todo;
    std::vector<int> arrived;
    {
      std::unique_lock lk(mu_);
      const auto ready = [&] {
        if (stopped_) return true;
        for (const auto& a : awaited_) {
          if (a.waiting && a.arrived) return true;
        }
        return std::any_of(requests_.begin(), requests_.end(),
                           [&](const request& q) { return q.mb < 0 || q.epoch <= epoch_; });
      };
      const auto t0 = std::chrono::steady_clock::now();
      {
        const compute_watch::peer_wait waiting(watch_.get());
        cv_.wait(lk, ready);
      }
      wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (stopped_) throw exchange_stopped(why_);
      for (int k = 0; k < ep_; ++k) {
        auto& a = awaited_[std::size_t(k)];
        if (!a.waiting || !a.arrived) continue;
        if (!a.error.empty()) {
          const std::string why =
              fmt::format("EP rank {} refused this replica's rows: {}", k, a.error);
          for (auto& other : awaited_) other = {};  // nothing of this exchange is awaited now
          throw std::runtime_error(why);
        }
        arrived.push_back(k);
        a = {};
      }
      todo = take_servable();
    }
    for (const request& r : todo) serve(r);
    for (const int k : arrived) {
      const request& r = to[std::size_t(k)];
      const auto& src = answers_in_[std::size_t(k)];
      std::copy(src.begin(), src.begin() + std::ptrdiff_t(r.floats),
                out.begin() + std::ptrdiff_t(first[std::size_t(k)]));
      --left;
    }
  }
}

std::vector<expert_router::request> expert_router::take_servable() {
  std::vector<request> out;
  std::deque<request> keep;
  for (auto& r : requests_) {
    if (r.mb >= 0 && r.epoch < epoch_) continue;  // an aborted iteration's
    if (r.mb < 0 || r.epoch == epoch_) {
      out.push_back(std::move(r));
    } else {
      keep.push_back(std::move(r));  // a later iteration's, before this replica began it
    }
  }
  requests_ = std::move(keep);
  return out;
}

void expert_router::serve(const request& r) {
  const auto in = std::span<const float>(rows_in_[std::size_t(r.source)]).first(r.floats);
  const auto out = slot(answers_out_, r.source).first(r.floats);
  try {
    if (r.backward) {
      shard_->backward(r.source, r.layer, r.mb, in, out);
    } else {
      shard_->forward(r.source, r.layer, r.mb, r.rows, in, out, r.mb >= 0);
    }
  } catch (const std::exception& e) {
    // rows that fit the message but not this shard (a backward without its forward, a forward
    // held already): the source's exchange fails with the reason, this one goes on
    count_refused();
    send_output(r, e.what());
    return;
  }
  send_output(r, {});
  if (r.backward) backward_done(r.source);
}

void expert_router::begin_epoch(std::uint64_t epoch) {
  {
    std::lock_guard lk(mu_);
    epoch_ = epoch;
    std::fill(backwards_.begin(), backwards_.end(), 0);
  }
  serve_pending();
}

void expert_router::serve_pending() {
  for (;;) {
    std::vector<request> todo;
    {
      std::lock_guard lk(mu_);
      if (stopped_) return;
      todo = take_servable();
    }
    if (todo.empty()) return;
    for (const request& r : todo) serve(r);
  }
}

void expert_router::stop(const std::string& why) {
  std::lock_guard lk(mu_);
  if (!stopped_) why_ = why;
  stopped_ = true;
  cv_.notify_all();
}

void expert_router::resume() {
  std::lock_guard lk(mu_);
  stopped_ = false;
  why_.clear();
  for (auto& a : awaited_) a = {};
  // Requests of the aborted iteration are still served: an EP peer that has not taken its
  // Abort yet may be waiting for them (and serves this one's likewise). The next epoch drops
  // what is left.
}

void expert_router::send_rows(int owner, const request& r) {
  asio::post(system_.io(), [self = shared_from_this(), owner, r] {
    if (std::size_t(owner) >= self->peers_.size()) return;
    (void)self->system_.tell<wire::ExpertRows>(
        self->peers_[std::size_t(owner)],
        [&](wire::ExpertRows::Builder b) {
          b.setEpoch(r.epoch);
          b.setLayer(r.layer);
          b.setMicroBatch(r.mb);
          b.setBackward(r.backward);
          b.setSource(r.source);
          b.setSeq(r.seq);
          if (!r.backward) {
            auto l = b.initRows(static_cast<unsigned>(r.rows.size()));
            for (unsigned i = 0; i < r.rows.size(); ++i) l.set(i, r.rows[i]);
          }
          if (r.floats == 0) return;  // no rows for this owner: no tensor (none is empty)
          transport::write_descriptor(
              b.initTensor(),
              self->rows_out_.describe(std::size_t(owner) * self->max_floats_ * sizeof(float),
                                       r.floats * sizeof(float)));
        },
        self->self_);
  });
}

void expert_router::send_output(const request& r, const std::string& error) {
  asio::post(system_.io(), [self = shared_from_this(), r, error] {
    if (std::size_t(r.source) >= self->peers_.size()) return;
    (void)self->system_.tell<wire::ExpertOutput>(
        self->peers_[std::size_t(r.source)],
        [&](wire::ExpertOutput::Builder b) {
          b.setEpoch(r.epoch);
          b.setLayer(r.layer);
          b.setMicroBatch(r.mb);
          b.setBackward(r.backward);
          b.setOwner(self->rank_);
          b.setSeq(r.seq);
          if (!error.empty()) {
            b.setError(error);
            return;
          }
          if (r.floats == 0) return;
          transport::write_descriptor(
              b.initTensor(),
              self->answers_out_.describe(std::size_t(r.source) * self->max_floats_ * sizeof(float),
                                          r.floats * sizeof(float)));
        },
        self->self_);
  });
}

bool expert_rows_fit(const expert_request& r, std::size_t bytes, const expert_router_shape& s) {
  const std::size_t row_bytes = std::size_t(s.c) * sizeof(float);
  if (r.source < 0 || r.source >= s.ep || r.source == s.rank || r.layer < s.first_layer ||
      r.layer >= s.last_layer || r.mb < -1 || r.mb >= s.micro_batches || bytes % row_bytes != 0 ||
      bytes / sizeof(float) > s.max_floats) {
    return false;
  }
  if (r.backward) return r.mb >= 0 && r.rows.empty();
  if (r.rows.size() != std::size_t(s.experts / s.ep)) return false;
  std::size_t total = 0;
  for (const int n : r.rows) {
    if (n < 0) return false;
    total += std::size_t(n);
  }
  return total * row_bytes == bytes;
}

std::span<float> expert_router::rows_buffer(int source) {
  return rows_in_.at(std::size_t(source));
}

void expert_router::rows_arrived(request r) {
  {
    std::lock_guard lk(mu_);
    // A source sends again only once it has every answer, or gave its exchange up (stopped):
    // what it sent before is nobody's now.
    std::erase_if(requests_, [&](const request& q) { return q.source == r.source; });
    requests_.push_back(std::move(r));
    cv_.notify_all();
  }
  if (wake_) wake_();
}

std::optional<std::span<float>> expert_router::output_buffer(const answer& a) {
  std::lock_guard lk(mu_);
  if (a.owner < 0 || a.owner >= ep_ || a.owner == rank_) return std::nullopt;
  const auto& w = awaited_[std::size_t(a.owner)];
  if (!w.matches(a) || w.floats * sizeof(float) != a.bytes) return std::nullopt;
  return std::span<float>(answers_in_[std::size_t(a.owner)]).first(w.floats);
}

void expert_router::output_arrived(const answer& a) {
  std::lock_guard lk(mu_);
  if (a.owner < 0 || a.owner >= ep_ || a.owner == rank_) return;
  auto& w = awaited_[std::size_t(a.owner)];
  if (!w.matches(a)) return;  // given up while its tensor came
  w.arrived = true;
  cv_.notify_all();
}

void expert_router::output_failed(const answer& a, const std::string& why) {
  std::lock_guard lk(mu_);
  if (a.owner < 0 || a.owner >= ep_ || a.owner == rank_) return;
  auto& w = awaited_[std::size_t(a.owner)];
  if (!w.matches(a)) return;
  w.arrived = true;
  w.error = why.empty() ? "no reason given" : why;
  cv_.notify_all();
}

// ---- the router actor

namespace {

// A message's tensor; none (an empty descriptor) when it has no rows: the transport refuses
// descriptors of zero bytes, so such a message carries none.
result<transport::bulk_descriptor> tensor_of(bool has,
                                             ::moevement::wire::BulkDescriptor::Reader r) {
  if (!has) return transport::bulk_descriptor{};
  return read_descriptor(r);
}

}  // namespace

expert_router_actor::expert_router_actor(std::shared_ptr<expert_router> router, bulk_io& io)
    : router_(std::move(router)), io_(io) {
  on<wire::ExpertRows>(&expert_router_actor::rows);
  on<wire::ExpertOutput>(&expert_router_actor::output);
}

asio::awaitable<void> expert_router_actor::on_down(actors::actor_ref who, actors::exit_reason) {
  const auto& peers = router_->peers();
  const auto it = std::find(peers.begin(), peers.end(), who);
  if (it == peers.end()) co_return;
  router_->stop(fmt::format("expert parallelism: EP rank {} (node {}) was lost", it - peers.begin(),
                            who.node));
}

asio::awaitable<void> expert_router_actor::rows(wire::ExpertRows::Reader m) {
  expert_router::request r;
  r.source = m.getSource();
  r.layer = m.getLayer();
  r.mb = m.getMicroBatch();
  r.backward = m.getBackward();
  r.epoch = m.getEpoch();
  r.seq = m.getSeq();
  const auto rows = m.getRows();
  if (rows.size() > 1u << 16) {
    router_->count_refused();
    co_return;
  }
  for (const int n : rows) r.rows.push_back(n);
  const auto d = tensor_of(m.hasTensor(), m.getTensor());
  if (!d.ok() || !router_->check_rows(r, d->length)) {
    router_->count_refused();
    co_return;
  }
  r.floats = d->length / sizeof(float);
  if (r.floats > 0) {
    const auto into = router_->rows_buffer(r.source).first(r.floats);
    auto pulled = co_await io_.pull(*d, std::as_writable_bytes(into), router_);
    if (!pulled.ok()) {
      router_->stop(fmt::format("expert parallelism: pulling the rows of EP rank {} failed: {}",
                                r.source, pulled.err().message));
      co_return;
    }
  }
  router_->rows_arrived(std::move(r));
}

asio::awaitable<void> expert_router_actor::output(wire::ExpertOutput::Reader m) {
  expert_router::answer a;
  a.owner = m.getOwner();
  a.layer = m.getLayer();
  a.mb = m.getMicroBatch();
  a.backward = m.getBackward();
  a.epoch = m.getEpoch();
  a.seq = m.getSeq();
  if (m.getError().size() > 0) {
    constexpr std::size_t most = 1000;  // of a peer's text, for the stage's failure message
    const std::string why(m.getError().cStr(), std::min<std::size_t>(m.getError().size(), most));
    router_->output_failed(a, why);
    co_return;
  }
  const auto d = tensor_of(m.hasTensor(), m.getTensor());
  if (!d.ok()) {
    router_->count_refused();
    co_return;
  }
  a.bytes = d->length;
  const auto into = router_->output_buffer(a);
  if (!into) {  // not awaited (stale), or of another shape
    router_->count_refused();
    co_return;
  }
  if (!into->empty()) {
    auto pulled = co_await io_.pull(*d, std::as_writable_bytes(*into), router_);
    if (!pulled.ok()) {
      router_->stop(fmt::format("expert parallelism: pulling the answer of EP rank {} failed: {}",
                                a.owner, pulled.err().message));
      co_return;
    }
  }
  router_->output_arrived(a);
}

}  // namespace moevement::engine
