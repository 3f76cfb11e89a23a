#include "engine/worker_agent.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>

#include "engine/job_config.hpp"
#include "engine/stage_actor.hpp"
#include "models/cuda/device.hpp"

namespace moevement::engine {

namespace {
using actors::read_ref;
using actors::write_ref;
constexpr auto join_timeout = std::chrono::seconds(30);

stage_setup setup_for(const job_config& job, int stage, int replica) {
  stage_setup setup;
  setup.model = job.model;
  setup.train = job.train;
  setup.stage = stage;
  setup.stages = job.pp;
  setup.replica = replica;
  setup.replicas = job.dp;
  return setup;
}
}  // namespace

void add_assigned_peers(transport::ucx_link& link, const actors::actor_system& system,
                        capnp::List<wire::Peer>::Reader peers) {
  for (auto p : peers) {
    if (p.getNode() == system.node() || p.getNode() == system.head()) continue;
    if (p.getHost().size() > 255) continue;
    link.add_peer(p.getNode(), p.getHost(), p.getPort());
  }
}

worker_agent::worker_agent(transport::ucx_link& link, const stage_registry& registry,
                           std::function<void(int, const std::string&)> on_exit,
                           checkpoint_factory checkpoints, fault_factory faults)
    : link_(link),
      registry_(registry),
      on_exit_(std::move(on_exit)),
      checkpoints_(std::move(checkpoints)),
      faults_(std::move(faults)) {
  on<wire::Assign>(&worker_agent::assign);
  on<wire::Restore>(&worker_agent::restore);
  on<wire::Shutdown>(&worker_agent::shutdown);
  on<wire::Judge, wire::Judged>(&worker_agent::judge);
  on<wire::StageProbe, wire::StageProbed>(&worker_agent::probe);
}

void worker_agent::say_hello(actors::actor_ref coordinator, const std::string& host,
                             const std::string& domain) {
  const auto port = link_.port();
  (void)tell<wire::WorkerHello>(coordinator, [&](wire::WorkerHello::Builder b) {
    b.setNode(system().node());
    b.setHost(host);
    b.setPort(port);
    write_ref(b.initAgent(), self());
    b.setPid(::getpid());
    b.setDomain(domain.empty() ? host : domain);
    if (assigned_) {  // to a standby head that took over: the role this worker holds
      b.setTaken(true);
      b.setStage(stage_index_);
      b.setReplica(stage_index_ >= 0 ? replica_ : -1);
      b.setGeneration(std::max(generation_, checkpoint_ ? checkpoint_->newest_generation() : 0));
    }
  });
}

void worker_agent::report(const actors::actor_ref& stage, const std::string& err,
                          bool snapshot_lost, std::int64_t mismatch_at) {
  const transport::node_id me = system().node();
  const actors::actor_ref ckpt =
      checkpoint_ && stage.valid() ? checkpoint_->agent() : actors::actor_ref{};
  const actors::actor_ref repl = checkpoint_ ? checkpoint_->replicator() : actors::actor_ref{};
  const actors::actor_ref exchange =
      checkpoint_ ? checkpoint_->group_exchange() : actors::actor_ref{};
  std::vector<op_size> sizes;
  double bandwidth = 0.0;
  if (checkpoint_ && stage.valid()) {
    sizes = checkpoint_->op_sizes();
    bandwidth = checkpoint_->snapshot_bandwidth();
  }
  (void)tell<wire::StageReady>(coordinator_, [&](wire::StageReady::Builder b) {
    b.setNode(me);
    b.setStage(stage_index_);
    b.setReplica(replica_);
    write_ref(b.initActor(), stage);
    b.setError(err);
    write_ref(b.initCheckpoint(), ckpt);
    write_ref(b.initReplicator(), repl);
    write_ref(b.initGroupExchange(), exchange);
    write_ref(b.initExperts(), stage.valid() ? experts_ : actors::actor_ref{});
    auto l = b.initOpSizes(static_cast<unsigned>(sizes.size()));
    for (unsigned i = 0; i < sizes.size(); ++i) {
      l[i].setComputeBytes(sizes[i].compute_bytes);
      l[i].setMasterBytes(sizes[i].master_bytes);
      l[i].setOptimBytes(sizes[i].optim_bytes);
    }
    b.setSnapshotBandwidth(bandwidth);
    b.setGeneration(generation_);
    b.setSnapshotLost(snapshot_lost);
    b.setReplayMismatch(mismatch_at >= 0);
    b.setMismatchIteration(mismatch_at);
    if (restored_ && checkpoint_) {
      const auto t = checkpoint_->last_restore();
      b.setPullSeconds(t.pull_s);
      b.setReplaySeconds(t.replay_s);
      b.setIterationsReplayed(t.iterations_replayed);
      b.setSlotsMapped(t.slots_mapped);
      b.setSlotsPulled(t.slots_pulled);
      b.setHandlesRefused(t.handles_refused);
      b.setCopiesRefused(t.copies_refused);
      b.setLogPieces(t.log_pieces);
      b.setReplayThreads(t.replay_threads);
    }
  });
}

// Building a stage (initialising its weights, loading the corpus) can take seconds: on a
// thread of its own, so that this node's heartbeats go on meanwhile.
// The checkpoint policy's own heavy set-up (worker_checkpoint::prepare) runs there too.
static asio::awaitable<std::unique_ptr<stage_model>> build_stage(const stage_factory& factory,
                                                                 const stage_setup& setup,
                                                                 worker_checkpoint* checkpoint,
                                                                 std::string& error) {
  std::unique_ptr<stage_model> model;
  asio::thread_pool builder(1);
  auto build = [&]() -> asio::awaitable<void> {
    try {
      model = factory(setup);
      if (checkpoint != nullptr) checkpoint->prepare(setup, *model);
    } catch (const std::exception& e) {
      error = e.what();
    }
    co_return;
  };
  co_await asio::co_spawn(builder.get_executor(), std::move(build), asio::use_awaitable);
  co_return model;
}

void worker_agent::start_stage(stage_setup setup, std::unique_ptr<stage_model> model,
                               bool replacement) {
  fault_hooks faults;
  if (faults_) faults = faults_(setup.stage, setup.replica, replacement);
  std::unique_ptr<stage_hooks> hooks;
  if (checkpoint_) {
    checkpoint_->set_copy_flip(faults.copy_flip);
    hooks = checkpoint_->make_hooks(setup, *model, coordinator_);
  }
  // Expert parallelism: the router's message half is an actor of its own (expert_router.hpp).
  std::shared_ptr<expert_router> router;
  if (setup.train.expert_parallel > 1) {
    router = std::make_shared<expert_router>(system(), *bulk_, setup);
    experts_ = system().spawn<expert_router_actor>(router, *bulk_).ref;
    router->set_actor(experts_);
  }
  // A replacement's operators were loaded, not initialised: its stage learns where it is from
  // its first Iterate (a standby head taking over asks it, engine/takeover.hpp).
  if (replacement) setup.initialize = false;
  stage_actor_args args{std::move(setup), std::move(model),  bulk_.get(),      coordinator_,
                        std::move(hooks), std::move(faults), std::move(router)};
  // The stage type's own actor class (stage_registry::add_actor), or the engine's.
  const stage_spawner& spawn = registry_.spawner(job_->stage_type);
  stage_ =
      spawn ? spawn(system(), std::move(args)) : system().spawn<stage_actor>(std::move(args)).ref;
  report(stage_, "");
}

asio::awaitable<void> worker_agent::assign(wire::Assign::Reader m) {
  // Only from the coordinator the message names, on the head (the sender's node is the one
  // that proved the job's token on its connection; the message's fields prove nothing).
  const actors::actor_ref from = read_ref(m.getCoordinator());
  if (!sender().valid() || sender() != from || from.node != system().head()) co_return;
  if (assigned_) {
    co_await taken_over(m);
    co_return;
  }
  assigned_ = true;
  const int stage = m.getStage(), replica = m.getReplica();
  stage_index_ = stage;
  replica_ = replica;
  coordinator_ = read_ref(m.getCoordinator());
  // Every peer's address first, so that heartbeats reach every member once we join.
  add_assigned_peers(link_, system(), m.getPeers());
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
  try {
    job_ = resolve_job(std::move(*cfg));
    bulk_ = std::make_unique<bulk_io>(link_);
    if (checkpoints_) checkpoint_ = checkpoints_(system(), *bulk_, *job_);
  } catch (const std::exception& e) {
    report({}, e.what());
    co_return;
  }
  co_await take_role(stage, replica, m.getResume());
}

asio::awaitable<void> worker_agent::take_role(int stage, int replica, bool resume) {
  stage_index_ = stage;
  replica_ = replica;
  try {
    if (stage < 0) {  // a spare: idle until recovery needs it
      if (job_->train.device == models::device::cuda) {
        // meanwhile the GPU's context, off the actor thread (heartbeats go on)
        prewarmed_ = std::async(std::launch::async, [] { models::cuda::prewarm(); });
      }
      report({}, "");
      co_return;
    }
    if (stage >= job_->pp || replica < 0 || replica >= job_->dp) {
      report({}, fmt::format("role stage {} replica {} is outside pp={} dp={}", stage, replica,
                             job_->pp, job_->dp));
      co_return;
    }
    if (resume) {  // its stage comes from the durable tier (a durable Restore)
      report({}, "");
      co_return;
    }
    stage_setup setup = setup_for(*job_, stage, replica);
    const stage_factory& factory = registry_.find(job_->stage_type);
    std::string build_error;
    auto model = co_await build_stage(factory, setup, checkpoint_.get(), build_error);
    if (!build_error.empty()) {
      report({}, build_error);
      co_return;
    }
    start_stage(std::move(setup), std::move(model), false);
  } catch (const std::exception& e) {
    report({}, e.what());
  }
}

asio::awaitable<void> worker_agent::taken_over(wire::Assign::Reader m) {
  // Only from a new head (a standby that took over), for the role this worker holds, with a
  // resume: the stage goes on from the durable tier (its durable Restore drops the running
  // one), under the new head's generations.
  // A spare may be given the role of a worker lost during the takeover: it holds that role
  // from now on (its reports say so), and its stage comes with the role's durable Restore.
  const actors::actor_ref from = read_ref(m.getCoordinator());  // (the sender: assign())
  const bool spare_given_a_role = stage_index_ < 0 && m.getStage() >= 0;
  if (job_ && takes_role_before_training(from == coordinator_, stage_index_, stage_.valid(),
                                         restored_, m.getStage())) {
    // The role of a worker lost before training started: this spare starts it instead (from
    // the initial state, or from disk with the others on a resume; take_role checks the role).
    co_await take_role(m.getStage(), m.getReplica(), m.getResume());
    co_return;
  }
  if (!job_ || from == coordinator_ || from.node != system().head() || !m.getResume() ||
      m.getStage() >= job_->pp || m.getReplica() >= job_->dp ||
      (spare_given_a_role && m.getReplica() < 0) ||
      (!spare_given_a_role &&
       (m.getStage() != stage_index_ || (stage_index_ >= 0 && m.getReplica() != replica_)))) {
    co_return;
  }
  coordinator_ = from;
  generation_ = 0;
  if (spare_given_a_role) {  // (its reports say the role it now holds)
    stage_index_ = m.getStage();
    replica_ = m.getReplica();
  }
  add_assigned_peers(link_, system(), m.getPeers());
  // The stage runs on: the new head asks it where it is and goes on from there when every
  // stage agrees (engine/takeover.hpp), else its durable Restore replaces it.
  if (auto* s = system().local_actor<stage_actor>(stage_)) {
    s->set_coordinator(from);
    if (checkpoint_) checkpoint_->set_coordinator(from);
    report(stage_, "");
    co_return;
  }
  report({}, "");
}

asio::awaitable<void> worker_agent::restore(wire::Restore::Reader m) {
  // Only from its own head's coordinator, to a worker that joined; one holding a role, only
  // for that role under a newer generation (takes_restore).
  if (!job_ || !checkpoint_ || sender() != coordinator_) co_return;
  const int stage = m.getStage(), replica = m.getReplica();
  const std::uint64_t generation = m.getGeneration();
  if (stage < 0 || stage >= job_->pp || replica < 0 || replica >= job_->dp) co_return;
  if (stage_index_ >= 0) {
    // A rollback to the durable tier, a recovery group replaying in parallel, and a region
    // that grew around a survivor restore survivors too: a stage given its role at the start
    // takes one (its running stage is dropped; the coordinator aborted the iteration and no
    // longer counts on it).
    if (!takes_restore(stage_index_, replica_, generation_, stage, replica, generation)) {
      co_return;
    }
    if (stage_.valid()) system().stop(stage_);      // never wired, or the survivor's old stage
    if (experts_.valid()) system().stop(experts_);  // its router goes with it
    experts_ = {};
    stage_ = {};
  }
  restored_ = true;
  generation_ = generation;
  stage_index_ = stage;
  replica_ = replica;
  stage_setup setup = setup_for(*job_, stage, replica);
  try {
    const stage_factory& factory = registry_.find(job_->stage_type);
    // The agent takes one message at a time: a newer generation's Restore waits behind this
    // one (a group replay of it ends when the coordinator announces the next generation to
    // this worker's group exchange), and what this one reports carries its own generation.
    auto model = co_await checkpoint_->restore(m, factory, setup);
    start_stage(std::move(setup), std::move(model), true);
  } catch (const snapshot_lost& e) {
    report({}, fmt::format("restoring stage {} replica {} failed: {}", stage, replica, e.what()),
           true);
  } catch (const replay_mismatch& e) {
    report({}, fmt::format("restoring stage {} replica {} failed: {}", stage, replica, e.what()),
           false, e.iteration());
  } catch (const std::exception& e) {
    report({}, fmt::format("restoring stage {} replica {} failed: {}", stage, replica, e.what()));
  }
}

asio::awaitable<void> worker_agent::probe(wire::StageProbe::Reader,
                                          wire::StageProbed::Builder out) {
  const auto* stage = stage_.valid() ? system().local_actor<stage_actor>(stage_) : nullptr;
  out.setHasStage(stage != nullptr);
  if (stage == nullptr) co_return;
  const compute_watch::view v = stage->watch()->read();
  out.setEpoch(v.epoch);
  out.setSeconds(v.for_s);
  switch (v.now) {
    case compute_watch::state::idle:
      out.setState(wire::ComputeState::IDLE);
      break;
    case compute_watch::state::computing:
      out.setState(wire::ComputeState::COMPUTING);
      break;
    case compute_watch::state::waiting:
      out.setState(wire::ComputeState::WAITING);
      break;
  }
  co_return;
}

asio::awaitable<void> worker_agent::judge(wire::Judge::Reader m, wire::Judged::Builder out) {
  if (!job_ || !checkpoint_ || stage_index_ >= 0 || restored_) {
    out.setError("this worker is not an idle spare");
    co_return;
  }
  const auto plan = m.getRestore();
  const int stage = plan.getStage(), replica = plan.getReplica();
  if (stage < 0 || stage >= job_->pp || replica < 0 || replica >= job_->dp ||
      plan.getFirstStage() != stage || plan.getLastStage() != stage || plan.getGroup().size() > 0 ||
      plan.getPipeline().size() > 0 || plan.getDurable()) {
    out.setError(fmt::format("a judge replays one stage of this job whole: stage {} replica {}",
                             stage, replica));
    co_return;
  }
  try {
    const stage_factory& factory = registry_.find(job_->stage_type);
    const auto digests =
        co_await checkpoint_->judge(plan, factory, setup_for(*job_, stage, replica));
    auto l = out.initDigests(static_cast<unsigned>(digests.size()));
    for (unsigned i = 0; i < digests.size(); ++i) l.set(i, digests[i]);
  } catch (const std::exception& e) {
    out.setError(e.what());
  }
}

asio::awaitable<void> worker_agent::shutdown(wire::Shutdown::Reader) {
  if (!sender().valid() || sender().node != system().head()) co_return;  // only the head's
  system().wind_down();  // the job is over: peers closing their connections is no fault
  if (on_exit_) on_exit_(0, "shutdown requested by the coordinator");
  co_return;
}

}  // namespace moevement::engine
