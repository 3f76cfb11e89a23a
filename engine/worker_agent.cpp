#include "engine/worker_agent.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>

#include "engine/job_config.hpp"
#include "engine/stage_actor.hpp"

namespace moevement::engine {

namespace {
using actors::read_ref;
using actors::write_ref;
constexpr auto join_timeout = std::chrono::seconds(30);
}  // namespace

worker_agent::worker_agent(transport::ucx_link& link, const stage_registry& registry,
                           std::function<void(int, const std::string&)> on_exit)
    : link_(link), registry_(registry), on_exit_(std::move(on_exit)) {
  on<wire::Assign>(&worker_agent::assign);
  on<wire::Shutdown>(&worker_agent::shutdown);
}

void worker_agent::say_hello(actors::actor_ref coordinator, const std::string& host) {
  const auto port = link_.port();
  (void)tell<wire::WorkerHello>(coordinator, [&](wire::WorkerHello::Builder b) {
    b.setNode(system().node());
    b.setHost(host);
    b.setPort(port);
    write_ref(b.initAgent(), self());
    b.setPid(::getpid());
  });
}

asio::awaitable<void> worker_agent::assign(wire::Assign::Reader m) {
  if (assigned_) co_return;
  assigned_ = true;
  const int stage = m.getStage(), replica = m.getReplica();
  const actors::actor_ref coordinator = read_ref(m.getCoordinator());
  const transport::node_id me = system().node();
  auto report = [&](const actors::actor_ref& ref, const std::string& err) {
    (void)tell<wire::StageReady>(coordinator, [&](wire::StageReady::Builder b) {
      b.setNode(me);
      b.setStage(stage);
      b.setReplica(replica);
      write_ref(b.initActor(), ref);
      b.setError(err);
    });
  };
  // Every peer's address first, so that heartbeats reach every member once we join.
  for (auto p : m.getPeers()) {
    if (p.getNode() == me || p.getNode() == system().config().head) continue;
    if (p.getHost().size() > 255) continue;
    link_.add_peer(p.getNode(), p.getHost(), p.getPort());
  }
  auto cfg = read_config(m.getConfig());
  if (!cfg.ok()) {
    report({}, "bad config from the coordinator: " + cfg.err().message);
    co_return;
  }
  auto joined = co_await system().join(join_timeout);
  if (!joined.ok()) {
    report({}, "joining the cluster failed: " + joined.err().message);
    co_return;
  }
  if (stage < 0) {  // a spare: idle until recovery needs it
    report({}, "");
    co_return;
  }
  try {
    job_config job = resolve_job(std::move(*cfg));
    if (stage >= job.pp || replica < 0 || replica >= job.dp) {
      report({}, fmt::format("role stage {} replica {} is outside pp={} dp={}", stage, replica,
                             job.pp, job.dp));
      co_return;
    }
    stage_setup setup;
    setup.model = job.model;
    setup.train = job.train;
    setup.stage = stage;
    setup.stages = job.pp;
    setup.replica = replica;
    setup.replicas = job.dp;
    // Building a stage (initialising its weights, loading the corpus) can take seconds: on a
    // thread of its own, so that this node's heartbeats go on meanwhile.
    const stage_factory& factory = registry_.find(job.stage_type);
    std::unique_ptr<stage_model> model;
    std::string build_error;
    {
      asio::thread_pool builder(1);
      auto build = [&]() -> asio::awaitable<void> {
        try {
          model = factory(setup);
        } catch (const std::exception& e) {
          build_error = e.what();
        }
        co_return;
      };
      co_await asio::co_spawn(builder.get_executor(), std::move(build), asio::use_awaitable);
    }
    if (!build_error.empty()) {
      report({}, build_error);
      co_return;
    }
    bulk_ = std::make_unique<bulk_io>(link_);
    stage_ = system().spawn<stage_actor>(std::move(setup), std::move(model), *bulk_, coordinator,
                                         nullptr);
    report(stage_, "");
  } catch (const std::exception& e) {
    report({}, e.what());
  }
}

asio::awaitable<void> worker_agent::shutdown(wire::Shutdown::Reader) {
  if (on_exit_) on_exit_(0, "shutdown requested by the coordinator");
  co_return;
}

}  // namespace moevement::engine
