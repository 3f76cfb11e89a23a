// Failure injection (launcher/inject.hpp, docs/recovery.md): the spec parser, trace files,
// mtbf schedules and [[inject]] tables in process; then real jobs under `moevement launch`
// that fail at a phase of an iteration, on a schedule, from a trace, from a table and during a
// recovery, each ending with the fault-free state_hash (a failure during a recovery: see its
// test).
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "launcher/config.hpp"
#include "launcher/inject.hpp"
#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace moevement::launcher {
namespace {

using namespace moevement::test_support;

std::string temp_file(const std::string& name, const std::string& text) {
  const std::string path =
      ::testing::TempDir() + "inject_" + std::to_string(::getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

engine::job_config small_job(const std::string& extra_toml = "") {
  auto raw = load_config_file(temp_file("job.toml", R"(
[train]
iterations = 12
[parallel]
pp = 3
dp = 2
[checkpoint]
policy = "moevement"
[cluster]
spares = 2
)" + extra_toml));
  return engine::resolve_job(raw);
}

// ---- in process

TEST(inject_spec, every_form_parses_and_prints_back_the_same) {
  for (const std::string spec :
       {"kill:stage=1,replica=0,iter=7",
        "hang:stage=0,replica=1,iter=3",
        "kill:stage=1,replica=0,iter=7,phase=forward",
        "kill:stage=1,replica=0,iter=7,phase=backward",
        "hang:stage=2,replica=0,iter=2,phase=step",
        "kill:stage=2,replica=1,iter=9,phase=snapshot",
        "stall:stage=1,replica=0,iter=4,phase=backward",
        "kill:stage=1,replica=0,during=recovery,nth=2,delay_ms=50",
        "kill:stage=2,replica=1,during=start,delay_ms=0",
        "kill:stage=0,replica=0,during=start,delay_ms=30,scope=host",
        "hang:stage=1,replica=0,during=start,delay_ms=0",
        "kill:stage=1,replica=0,iter=7,scope=host",
        "hang:stage=0,replica=1,during=recovery,nth=1,delay_ms=0,scope=host",
        "mtbf:2.5,seed=7",
        "mtbf:30,seed=1,max=4",
        "trace:some/file.txt",
        "flip:stage=1,replica=0,iter=0,word=0,bit=22",
        "flip:stage=0,replica=2,iter=5,operator=layer0.attention,word=17,bit=3",
        "flip:stage=1,replica=1,iter=4,target=slot,bit=5",
        "flip:stage=0,replica=0,iter=3,target=activation,word=9,bit=30"}) {
    const injection inj = parse_injection(spec);
    EXPECT_EQ(inj.text(), spec);
    EXPECT_EQ(parse_injection(inj.text()).text(), spec);
  }
  const injection d = parse_injection("hang:replica=1,during=recovery,stage=2");
  EXPECT_TRUE(d.during_recovery);
  EXPECT_EQ(d.nth, 1);
  EXPECT_EQ(d.delay_ms, 0);
  EXPECT_EQ(d.failure(), failure_kind::hang);
  EXPECT_EQ(parse_injection("kill:stage=1,replica=0,iter=4,phase=snapshot").phase,
            engine::fault_point::snapshot);
  const injection f = parse_injection("flip:iter=4,replica=1,stage=0,target=weight");
  EXPECT_EQ(f.what, injection::kind::flip);
  EXPECT_EQ(f.bit, 22) << "the default: a bit 2-byte compute weights keep";
  EXPECT_EQ(f.word, 0);
  EXPECT_TRUE(f.op.empty());
}

TEST(inject_spec, malformed_specs_say_what_is_expected) {
  for (const std::string spec : {"kill",
                                 "explode:stage=0,replica=0,iter=1",
                                 "kill:",
                                 "kill:stage=0,iter=1",
                                 "kill:stage=0,replica=0",
                                 "kill:stage=0,replica=0,iter=0",
                                 "kill:stage=0,replica=0,iter=x",
                                 "kill:stage=0,replica=0,iter=2,iter=3",
                                 "kill:stage=0,replica=0,iter=2,phase=sideways",
                                 "kill:stage=0,replica=0,iter=2,during=recovery",
                                 "kill:stage=0,replica=0,during=lunch",
                                 "kill:stage=0,replica=0,during=recovery,phase=step",
                                 "kill:stage=0,replica=0,iter=2,nth=1",
                                 "kill:stage=0,replica=0,during=recovery,nth=0",
                                 "kill:stage=0,replica=0,iter=2,during=start",
                                 "kill:stage=0,replica=0,during=start,nth=1",
                                 "kill:stage=0,replica=0,iter=2,delay_ms=5",
                                 "kill:stage=0,replica=0,iter=2,colour=red",
                                 "kill:stage=0,replica=0,iter=2,scope=rack",
                                 "kill:stage=0,replica=0,iter=2,phase=step,scope=host",
                                 "kill:stage=0,replica=0,iter=2,",
                                 "kill:stage=-1,replica=0,iter=2",
                                 "mtbf:",
                                 "mtbf:0",
                                 "mtbf:abc",
                                 "mtbf:-3",
                                 "mtbf:5,seed=x",
                                 "mtbf:5,max=0",
                                 "mtbf:5,every=2",
                                 "mtbf:inf",
                                 "trace:",
                                 "flip:",
                                 "flip:stage=0,replica=0",
                                 "flip:stage=0,iter=3",
                                 "flip:stage=0,replica=0,iter=3,bit=32",
                                 "flip:stage=0,replica=0,iter=3,bit=-1",
                                 "flip:stage=0,replica=0,iter=3,word=-4",
                                 "flip:stage=0,replica=0,iter=3,operator=",
                                 "flip:stage=0,replica=0,iter=3,phase=step",
                                 "flip:stage=0,replica=0,iter=3,bit=1,bit=2",
                                 "flip:stage=0,replica=0,iter=3,target=slot,word=4",
                                 "flip:stage=0,replica=0,iter=3,target=slot,operator=head",
                                 "flip:stage=0,replica=0,iter=3,target=activation,operator=head",
                                 "flip:stage=0,replica=0,iter=3,target=gradient",
                                 "stall:stage=0,replica=0,iter=3",
                                 "stall:stage=0,replica=0,during=recovery,phase=step"}) {
    try {
      (void)parse_injection(spec);
      ADD_FAILURE() << spec << " was accepted";
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("--inject " + spec), std::string::npos) << m;
      EXPECT_NE(m.find("expected kill|hang:stage=S"), std::string::npos) << m;
    }
  }
}

TEST(inject_spec, checked_against_the_job) {
  const auto job = small_job();
  auto refused = [&](const std::string& spec, const std::string& says) {
    try {
      (void)check_injection(parse_injection(spec), job);
      ADD_FAILURE() << spec << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused("kill:stage=3,replica=0,iter=2", "there is no stage 3 replica 0");
  refused("kill:stage=0,replica=2,iter=2", "there is no stage 0 replica 2");
  refused("kill:stage=0,replica=0,iter=12",
          "iter=12 never runs: the job runs iterations 0..11 (train.iterations = 12); use 1..11");
  refused("kill:stage=0,replica=0,iter=2,scope=host", "scope=host on the local backend");
  EXPECT_NO_THROW((void)check_injection(parse_injection("kill:stage=2,replica=1,iter=11"), job));
  EXPECT_NO_THROW((void)check_injection(parse_injection("flip:stage=2,replica=1,iter=0"), job));
  refused("flip:stage=0,replica=0,iter=12", "use 0..11");
  refused("flip:stage=3,replica=0,iter=2", "there is no stage 3 replica 0");
  refused("flip:stage=2,replica=0,iter=2,target=activation", "stage 2 is the last");
  // Past the operator's master weights: refused here, not once the flip's iteration comes.
  refused("flip:stage=0,replica=0,iter=2,word=99999999", "master weights: word must be 0..");
  refused("flip:stage=1,replica=0,iter=2,operator=layer2.gate,word=99999999",
          "operator layer2.gate has");
  // dp 2 at ep 2: each expert has one copy, so nothing compares it (a non-expert has two).
  auto ep = job;
  ep.ep = 2;
  EXPECT_THROW((void)check_injection(
                   parse_injection("flip:stage=1,replica=0,iter=2,operator=layer2.expert0"), ep),
               std::invalid_argument);
  EXPECT_NO_THROW((void)check_injection(
      parse_injection("flip:stage=1,replica=0,iter=2,operator=layer2.attention"), ep));
  EXPECT_NO_THROW(
      (void)check_injection(parse_injection("stall:stage=1,replica=0,iter=2,phase=forward"), job));
  auto no_limit = job;
  no_limit.iteration_timeout_ms = 0;
  EXPECT_THROW((void)check_injection(
                   parse_injection("stall:stage=1,replica=0,iter=2,phase=forward"), no_limit),
               std::invalid_argument)
      << "nothing would end the job";
  auto rollback = job;
  rollback.policy = engine::policy_kind::dense_memory;
  EXPECT_THROW((void)check_injection(
                   parse_injection("stall:stage=1,replica=0,iter=2,phase=forward"), rollback),
               std::invalid_argument)
      << "the rollback re-runs the stalled iteration on the replacement";
  auto raw = load_config_file(temp_file("none.toml", "[train]\niterations = 12\n"));
  const auto job_none = engine::resolve_job(raw);
  EXPECT_THROW((void)check_injection(
                   parse_injection("kill:stage=0,replica=0,iter=2,phase=snapshot"), job_none),
               std::invalid_argument);
  EXPECT_THROW(
      (void)check_injection(parse_injection("kill:stage=0,replica=0,during=recovery"), job_none),
      std::invalid_argument);
  EXPECT_THROW((void)check_injection(parse_injection("mtbf:5"), job_none), std::invalid_argument)
      << "no spares and no max: no failure would happen";
  EXPECT_EQ(check_injection(parse_injection("mtbf:5,max=3"), job_none).size(), 3u);
  // dp = 1: no replica to compare with, so a flip would go unseen.
  EXPECT_THROW((void)check_injection(parse_injection("flip:stage=0,replica=0,iter=2"), job_none),
               std::invalid_argument);
}

TEST(inject_mtbf, the_same_seed_gives_the_same_schedule_over_every_role) {
  const auto a = mtbf_schedule(parse_injection("mtbf:10,seed=5,max=400"), 3, 2, 0);
  const auto b = mtbf_schedule(parse_injection("mtbf:10,seed=5,max=400"), 3, 2, 0);
  const auto c = mtbf_schedule(parse_injection("mtbf:10,seed=6,max=400"), 3, 2, 0);
  ASSERT_EQ(a.size(), 400u);
  std::set<std::pair<int, int>> roles;
  double last = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].text(), b[i].text());
    EXPECT_GE(a[i].at_s, last);
    last = a[i].at_s;
    EXPECT_LT(a[i].stage, 3);
    EXPECT_LT(a[i].replica, 2);
    roles.insert({a[i].stage, a[i].replica});
  }
  EXPECT_EQ(roles.size(), 6u) << "every (stage, replica) is chosen";
  // Exponential gaps of mean 10 s: 400 of them sum to about 4000 s (5 sigma: +-1000).
  EXPECT_NEAR(a.back().at_s, 4000.0, 1000.0);
  EXPECT_NE(a[0].text(), c[0].text());
  // max defaults to cluster.spares.
  EXPECT_EQ(mtbf_schedule(parse_injection("mtbf:10"), 3, 2, 2).size(), 2u);
}

TEST(inject_trace, a_trace_file_is_read_strictly) {
  const auto ok = read_trace(temp_file("ok.trace",
                                       "# seconds of training, failure, target\n"
                                       "\n"
                                       "0.5 kill stage=1 replica=0   # the middle stage\n"
                                       "  2 hang replica=1 stage=0\n"
                                       "2 kill stage=2 replica=1\n"));
  ASSERT_EQ(ok.size(), 3u);
  EXPECT_EQ(ok[0].text(), "0.500 s: kill stage=1 replica=0");
  EXPECT_EQ(ok[1].text(), "2.000 s: hang stage=0 replica=1");
  EXPECT_NE(ok[2].origin.find("line 5"), std::string::npos) << ok[2].origin;
  const std::map<std::string, std::string> bad{
      {"1 kill stage=0\n", "line 1: 3 fields"},
      {"# c\n1 explode stage=0 replica=0\n", "line 2: unknown failure 'explode'"},
      {"x kill stage=0 replica=0\n", "line 1: 'x' is not a time"},
      {"-1 kill stage=0 replica=0\n", "line 1: '-1' is not a time"},
      {"2 kill stage=0 replica=0\n1 kill stage=0 replica=0\n", "line 2: 1 s comes before"},
      {"1 kill stage=0 stage=1\n", "line 1: 'stage=1' is not stage=S or replica=D"},
      {"1 kill stage=a replica=0\n", "line 1: stage must be an integer"},
      {"1 kill node=1 replica=0\n", "line 1: 'node=1'"},
      {"# nothing\n\n", "no failures"},
  };
  for (const auto& [text, says] : bad) {
    try {
      (void)read_trace(temp_file("bad.trace", text));
      ADD_FAILURE() << text << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("<seconds> kill|hang stage=S replica=D"),
                std::string::npos);
    }
  }
  EXPECT_THROW((void)read_trace("/nonexistent/trace"), std::invalid_argument);
  // A role outside the job is refused naming the line.
  const auto job = small_job();
  try {
    (void)check_injection(parse_injection("trace:" + temp_file("far.trace",
                                                               "1 kill stage=0 replica=0\n"
                                                               "2 kill stage=5 replica=0\n")),
                          job);
    ADD_FAILURE() << "stage 5 of 3 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("line 2: there is no stage 5"), std::string::npos)
        << e.what();
  }
}

TEST(inject_tables, arrays_of_tables_flatten_and_become_injections) {
  const std::string dir = ::testing::TempDir();
  const std::string trace = temp_file("t.trace", "1 kill stage=0 replica=0\n");
  const std::string cfg = temp_file("tables.toml", R"(
[train]
iterations = 12

[[inject]]
kind = "kill"
stage = 1
replica = 0
iter = 4
phase = "backward"

[[inject]]
kind = "hang"
stage = 2
replica = 1
during = "recovery"
delay_ms = 20

[[inject]]
kind = "mtbf"
seconds = 2.5
seed = 3

[[inject]]
kind = "trace"
file = ")" + trace.substr(trace.rfind('/') + 1) + R"("

[[inject]]
kind = "flip"
stage = 0
replica = 1
iter = 3
operator = "layer0.attention"
bit = 5
)");
  auto raw = load_config_file(cfg);
  EXPECT_TRUE(raw.contains("inject.0.kind"));
  EXPECT_TRUE(raw.contains("inject.3.file"));
  apply_override(raw, "inject.0.iter=5");  // --set edits a table
  const auto inj = take_inject_tables(raw, cfg);
  ASSERT_EQ(inj.size(), 5u);
  EXPECT_EQ(inj[4].text(), "flip:stage=0,replica=1,iter=3,operator=layer0.attention,word=0,bit=5");
  EXPECT_EQ(inj[0].text(), "kill:stage=1,replica=0,iter=5,phase=backward");
  EXPECT_EQ(inj[1].text(), "hang:stage=2,replica=1,during=recovery,nth=1,delay_ms=20");
  EXPECT_EQ(inj[2].text(), "mtbf:2.5,seed=3");
  EXPECT_EQ(inj[3].file, trace) << "relative to the config's directory";
  EXPECT_NE(inj[0].source.find("[[inject]] table 1 of " + cfg), std::string::npos);
  for (const auto& [k, v] : raw) EXPECT_FALSE(k.starts_with("inject")) << k;
  EXPECT_NO_THROW((void)engine::resolve_job(raw));
}

TEST(inject_tables, bad_tables_are_refused_naming_the_table) {
  const std::map<std::string, std::string> bad{
      {"[[inject]]\nstage = 1\n", "table 1 of"},
      {"[[inject]]\nkind = \"kill\"\nstage = 1\nreplica = 0\niter = 2\n"
       "[[inject]]\nkind = \"explode\"\n",
       "table 2 of"},
      {"[[inject]]\nkind = 3\n", "kind must be the string"},
      {"[[inject]]\nkind = \"kill\"\nstage = \"one\"\nreplica = 0\niter = 2\n",
       "stage must be an integer, got a string"},
      {"[[inject]]\nkind = \"kill\"\nstage = 1\nreplica = 0\niter = 2\nseconds = 3\n",
       "unknown key 'seconds' for kind = \"kill\""},
      {"[[inject]]\nkind = \"kill\"\nstage = 1\nreplica = 0\n", "give either iter=T or during"},
      {"[[inject]]\nkind = \"stall\"\nstage = 1\nreplica = 0\niter = 2\n",
       "stall needs iter=T and phase=P"},
      {"[[inject]]\nkind = \"mtbf\"\nseed = 1\n", "needs seconds"},
      {"[[inject]]\nkind = \"mtbf\"\nseconds = \"x\"\n", "seconds must be a number"},
      {"[[inject]]\nkind = \"trace\"\n", "needs file"},
      {"[[inject]]\nkind = \"kill\"\nstage = 1\nreplica = 0\niter = 2\nphase = 4\n",
       "phase must be a string"},
      {"[inject]\nkind = \"kill\"\n", "a list of tables"},
      {"[[inject]]\nkind = \"flip\"\nstage = 1\nreplica = 0\niter = 2\nphase = \"step\"\n",
       "unknown key 'phase' for kind = \"flip\""},
      {"[[inject]]\nkind = \"flip\"\nstage = 1\nreplica = 0\niter = 2\nbit = \"x\"\n",
       "bit must be an integer"},
      {"inject = \"kill:stage=0,replica=0,iter=1\"\n", "a list of tables"},
      {"[[inject]]\nkind = \"kill\"\n[inject.x]\ny = 1\n", "list of tables"},
  };
  for (const auto& [text, says] : bad) {
    const std::string cfg = temp_file("bad_tables.toml", text);
    try {
      auto raw = load_config_file(cfg);
      (void)take_inject_tables(raw, cfg);
      ADD_FAILURE() << text << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << text << "\n" << e.what();
      // What to write is said in the table's form, never the command line's.
      EXPECT_EQ(std::string(e.what()).find("kill|hang:stage=S"), std::string::npos) << e.what();
    }
  }
  // Other arrays are still not config values.
  for (const std::string text : {"[train]\niterations = [1, 2]\n", "[train]\nx = []\n"}) {
    EXPECT_THROW((void)load_config_file(temp_file("arr.toml", text)), std::exception) << text;
  }
}

// docs/configuration.md's [[inject]] table lists exactly the keys a table may have.
TEST(inject_tables, the_configuration_reference_lists_every_key) {
  std::ifstream in(source_path("docs/configuration.md"));
  ASSERT_TRUE(in);
  std::set<std::string> documented;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("## ")) inside = line == "## [[inject]]";
    if (!inside || !line.starts_with("| `")) continue;
    const auto end = line.find('`', 3);
    documented.insert(line.substr(3, end - 3));
  }
  const auto keys = inject_table_keys();
  EXPECT_EQ(documented, std::set<std::string>(keys.begin(), keys.end()));
}

// ---- real jobs

std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

// tiny, 12 iterations, a window of 2, pp=3 (as tests/launcher/recovery_test.cpp).
std::string job(int spares, const std::string& extra = "", int iterations = 12) {
  return tiny() + " --set train.iterations=" + std::to_string(iterations) +
         " --set train.seq_len=16 --set parallel.pp=3 --set checkpoint.policy=moevement "
         "--set checkpoint.w_sparse=2 --set cluster.spares=" +
         std::to_string(spares) + " " + extra;
}

std::string reference(int iterations = 12) {
  static std::map<int, std::string> cache;
  if (!cache.contains(iterations)) {
    const auto r =
        run_moevement("train " + tiny() + " --set train.iterations=" + std::to_string(iterations) +
                      " --set train.seq_len=16");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    cache[iterations] = hash_of(r.output);
  }
  return cache[iterations];
}

TEST(inject_launch, a_worker_fails_itself_at_a_phase_and_is_rebuilt_bit_exact) {
  // backward: mid-iteration (its forwards already sent); snapshot: with the slot of the
  // iteration being captured, before any copy exists, so its window cannot persist.
  for (const auto& [spec, targets] : std::vector<std::pair<std::string, std::set<int>>>{
           {"kill:stage=1,replica=0,iter=7,phase=backward", {7}},
           {"kill:stage=2,replica=0,iter=5,phase=snapshot", {6}}}) {
    const auto o = launch("phase", job(1, "--inject " + spec));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_EQ(o.hash, reference()) << spec;
    EXPECT_NE(o.output.find("inject: " + spec + " (worker "), std::string::npos) << o.output;
    const std::string* start = o.first("recovery_start");
    ASSERT_NE(start, nullptr) << o.output;
    EXPECT_TRUE(targets.contains(int(number_field(*start, "target_iteration")))) << *start;
    // Once: the replacement re-running the iteration does not fail again.
    EXPECT_EQ(o.count("worker_lost"), 1) << o.output;
    EXPECT_EQ(o.count("recovery_end"), 1) << o.output;
  }
}

// A worker hung in its step (the others stepped, so the iteration commits without it and it
// is rebuilt one step further): the time spent finding the hang counts against the ETTR, as
// for a hang at any other phase (before, the committed iteration's time held it as useful).
TEST(inject_launch, a_hang_in_the_step_costs_its_detection_in_the_ettr) {
  const auto o = launch("hang_step", job(1,
                                         "--set cluster.failure_timeout_ms=1500 "
                                         "--inject hang:stage=1,replica=0,iter=5,phase=step"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  const std::string* end = o.first("job_end");
  ASSERT_NE(end, nullptr) << o.output;
  // Finding the hang takes the failure timeout from the hung worker's last heartbeat, which
  // may have gone up to one heartbeat interval (100 ms) before the hang: wall_s holds it,
  // useful_s does not. (Before, the hang's iteration counted whole: 0.04 s or so lost.)
  EXPECT_GE(number_field(*end, "wall_s") - number_field(*end, "useful_s"), 1.5 - 0.1) << *end;
}

TEST(inject_launch, mtbf_schedules_repeat_and_the_job_recovers_bit_exact) {
  const std::string inj = "--inject mtbf:0.1,seed=13,max=2";
  const auto a = run_moevement("launch " + job(2, inj) + " --dry-run");
  const auto b = run_moevement("launch " + job(2, inj) + " --dry-run");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const auto line = [](const std::string& out) {
    const auto at = out.find("injection: mtbf:0.1,seed=13,max=2 schedule: ");
    return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
  };
  ASSERT_NE(line(a.output), "") << a.output;
  EXPECT_EQ(line(a.output), line(b.output));
  EXPECT_NE(line(a.output),
            line(run_moevement("launch " + job(2, "--inject mtbf:0.1,seed=14,max=2") + " --dry-run")
                     .output));

  // Both failures fall due within 0.08 s of training (the second while the first one's
  // recovery runs: it waits for its end), well before 30 iterations are done.
  const auto o = launch("mtbf", job(2, inj, 30));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(30));
  EXPECT_NE(o.output.find(line(a.output)), std::string::npos) << "the run prints it too";
  EXPECT_EQ(o.count("inject"), 2) << o.output;
  EXPECT_EQ(o.count("worker_lost"), 2) << o.output;
  EXPECT_EQ(o.count("recovery_end"), 2) << o.output;
  EXPECT_NE(o.output.find("inject: mtbf:0.1,seed=13,max=2 failure 2: kill stage=0 replica=0"),
            std::string::npos)
      << o.output;
  EXPECT_NE(o.output.find("inject: mtbf:0.1,seed=13,max=2 failure 1: kill stage="),
            std::string::npos)
      << o.output;
}

TEST(inject_launch, a_trace_file_and_an_inject_table_combine_with_the_command_line) {
  const std::string trace = temp_file("run.trace",
                                      "# the first failure right after iteration 0\n"
                                      "0 kill stage=2 replica=0\n");
  const std::string cfg = temp_file("run.toml", "[[inject]]\nkind = \"trace\"\nfile = \"" + trace +
                                                    "\"\n\n[[inject]]\nkind = \"kill\"\n"
                                                    "stage = 1\nreplica = 0\niter = 9\n"
                                                    "phase = \"forward\"\n");
  // The table's injections come first, then --inject's; the job's own keys from tiny.toml
  // are overridden on the command line, the tables come from a config of their own.
  const std::string args = cfg +
                           " --set model.preset=tiny --set train.iterations=12 "
                           "--set train.seq_len=16 --set train.micro_batches=2 "
                           "--set train.micro_batch_size=8 --set train.val_batches=8 "
                           "--set parallel.pp=3 --set checkpoint.policy=moevement "
                           "--set checkpoint.w_sparse=2 --set cluster.spares=3 "
                           "--inject hang:stage=0,replica=0,iter=5 "
                           "--set cluster.failure_timeout_ms=2000";
  const auto dry = run_moevement("launch " + args + " --dry-run");
  ASSERT_EQ(dry.exit_code, 0) << dry.output;
  const auto t = dry.output.find("injection: trace:" + trace);
  const auto k = dry.output.find("injection: kill:stage=1,replica=0,iter=9,phase=forward");
  const auto h = dry.output.find("injection: hang:stage=0,replica=0,iter=5");
  ASSERT_NE(t, std::string::npos) << dry.output;
  ASSERT_NE(k, std::string::npos) << dry.output;
  ASSERT_NE(h, std::string::npos) << dry.output;
  EXPECT_LT(t, k);
  EXPECT_LT(k, h);
  EXPECT_EQ(dry.output.find("warning"), std::string::npos) << "3 losses, 3 spares";
  // More losses than spares (the trace's kill, the table's kill and --inject's hang; one
  // spare), and any under policy none: said before anything starts (the real run stops when no
  // spare is left).
  const auto short_of_spares =
      run_moevement("launch " + args + " --set cluster.spares=1 --dry-run");
  EXPECT_EQ(short_of_spares.exit_code, 0) << short_of_spares.output;
  EXPECT_NE(short_of_spares.output.find(
                "warning: 3 worker losses injected and cluster.spares = 1: the job stops when no "
                "spare is left"),
            std::string::npos)
      << short_of_spares.output;
  const auto none = run_moevement("launch " + args + " --set checkpoint.policy=none --dry-run");
  EXPECT_NE(none.output.find("recovers from nothing"), std::string::npos) << none.output;

  const auto o = launch("combined", args);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  EXPECT_EQ(o.count("recovery_end"), 3) << o.output;
  EXPECT_NE(o.output.find("inject: trace " + trace + " line 2: kill stage=2 replica=0"),
            std::string::npos)
      << o.output;
  EXPECT_NE(o.output.find("inject: kill:stage=1,replica=0,iter=9,phase=forward (worker"),
            std::string::npos)
      << o.output;
}

TEST(inject_launch, a_failure_during_a_recovery_fires_after_recovery_start) {
  const auto o = launch("during", job(2,
                                      "--inject kill:stage=1,replica=0,iter=5 "
                                      "--inject kill:stage=2,replica=0,during=recovery"));
  const auto fired =
      o.output.find("inject: kill:stage=2,replica=0,during=recovery,nth=1,delay_ms=0 (worker");
  ASSERT_NE(fired, std::string::npos) << o.output;
  EXPECT_NE(
      o.output.substr(fired, o.output.find('\n', fired) - fired).find("recovery 1 in progress"),
      std::string::npos)
      << o.output;
  // The injection comes after the first recovery_start and before any recovery_end; the loss
  // it causes, when the coordinator records it before the job ends, after it too.
  int starts = 0, ends = 0, lost_after_start = 0, injected_during = 0;
  for (const auto& l : o.log) {
    if (l.find("\"event\":\"recovery_start\"") != std::string::npos) ++starts;
    if (l.find("\"event\":\"recovery_end\"") != std::string::npos) ++ends;
    if (l.find("\"event\":\"inject\"") != std::string::npos && starts == 1 && ends == 0) {
      ++injected_during;
      EXPECT_NE(l.find("during=recovery"), std::string::npos) << l;
      EXPECT_EQ(number_field(l, "stage"), 2) << l;
    }
    if (l.find("\"event\":\"worker_lost\"") != std::string::npos && starts > 0) {
      ++lost_after_start;
      EXPECT_EQ(number_field(l, "stage"), 2) << l;
    }
  }
  EXPECT_EQ(injected_during, 1) << o.output;
  // Until the coordinator recovers from a loss during a recovery, the job may stop saying why
  // (the loss during the recovery, or the replacement's restore failing for the lost
  // neighbour, whichever it hears of first). When it goes on, it must end bit-exact.
  if (o.exit_code == 0) {
    EXPECT_EQ(lost_after_start, 1) << o.output;
    EXPECT_EQ(o.hash, reference());
  } else {
    EXPECT_EQ(o.exit_code, 1) << o.output;
    EXPECT_NE(o.output.find("moevement launch: "), std::string::npos) << o.output;
    EXPECT_EQ(o.hash, "");
  }
}

// A during=recovery injection armed by its recovery whose delay_ms outlasts the job is said
// not to have fired (it went silently: armed counted as struck).
TEST(inject_launch, a_delayed_failure_the_job_outlives_is_said_not_to_have_fired) {
  const auto o = launch("armed", job(2,
                                     "--inject kill:stage=1,replica=0,iter=5 --inject "
                                     "kill:stage=2,replica=0,during=recovery,delay_ms=600000"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  EXPECT_NE(o.output.find("inject: kill:stage=2,replica=0,during=recovery,nth=1,delay_ms=600000 "
                          "did not fire before the job ended (it was armed"),
            std::string::npos)
      << o.output;
}

// A worker killed as the roles go out, before training starts (its stage being built): a spare
// takes its role from the initial state, under any policy (nothing is trained yet), and the
// job ends with the fault-free hash. Without a spare the job stops at once, saying why.
TEST(inject_launch, a_worker_lost_before_training_starts_is_replaced_by_a_spare) {
  for (const std::string policy : {"moevement", "none"}) {
    const auto o = launch("before_start_" + policy,
                          job(1, "--set checkpoint.policy=" + policy +
                                     " --inject kill:stage=1,replica=0,during=start"));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_EQ(o.hash, reference()) << policy;
    const std::string* lost = o.first("worker_lost");
    ASSERT_NE(lost, nullptr) << o.output;
    EXPECT_NE(lost->find("\"during\":\"start\""), std::string::npos) << *lost;
    EXPECT_EQ(number_field(*lost, "spare"), 4) << "the one spare: " << *lost;
    EXPECT_EQ(o.count("recovery_start"), 0) << "no recovery: nothing was trained yet";
    EXPECT_NE(o.output.find("before training started; spare worker 4 takes its role"),
              std::string::npos)
        << o.output;
  }
  const auto none_left =
      launch("before_start_no_spare", job(0, "--inject kill:stage=1,replica=0,during=start"));
  EXPECT_EQ(none_left.exit_code, 1) << none_left.output;
  EXPECT_NE(none_left.output.find("before training started and no spare is left to take its "
                                  "role (raise cluster.spares)"),
            std::string::npos)
      << none_left.output;
}

// A worker hung as the roles go out (SIGSTOP before it joined: no heartbeat to miss) is found
// by cluster.start_timeout_ms, killed, and replaced by the spare, which gets as long again.
TEST(inject_launch, a_worker_hung_before_training_starts_is_replaced_at_the_start_timeout) {
  const auto o = launch("hung_at_start", job(1,
                                             "--set cluster.start_timeout_ms=5000 "
                                             "--inject hang:stage=1,replica=0,during=start"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  EXPECT_NE(o.output.find("did not report its stage within cluster.start_timeout_ms = 5000 ms "
                          "before training started; spare worker 4 takes its role"),
            std::string::npos)
      << o.output;
}

TEST(inject_launch, bad_injections_are_refused_before_anything_starts) {
  const std::string trace = temp_file("bad_run.trace", "1 kill stage=0 replica=0\nsoon kill\n");
  const std::string table = temp_file("bad_run.toml", "[[inject]]\nkind = \"kill\"\n");
  for (const std::string& args :
       {job(1, "--inject kill:stage=0,replica=0,iter=2,phase=sideways"),
        job(1, "--inject kill:stage=9,replica=0,iter=2,phase=step"),
        job(1, "--inject kill:stage=0,replica=0,iter=40"),
        job(1, "--inject kill:stage=0,replica=0,during=recovery,iter=3"), job(1, "--inject mtbf:0"),
        job(0, "--inject mtbf:3"), job(1, "--inject trace:" + trace),
        job(1, "--inject trace:/nonexistent/failures.trace"),
        job(1,
            "--set checkpoint.policy=none --inject kill:stage=0,replica=0,iter=2,phase=snapshot"),
        job(1, "--inject kill:stage=0,replica=0,iter=2 --sbatch"),
        // the same failure twice
        job(1, "--inject kill:stage=0,replica=0,iter=2 --inject kill:stage=0,replica=0,iter=2"),
        // an operator stage 1 does not have (it was found only once the job ran)
        job(1, "--set parallel.dp=3 --inject flip:stage=1,replica=0,iter=3,operator=layer0.gate"),
        table + " --set train.iterations=12"}) {
    const auto r = run_moevement("launch " + args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_TRUE(r.output.find("--inject") != std::string::npos ||
                r.output.find("[[inject]]") != std::string::npos)
        << args << ": " << r.output;
    EXPECT_EQ(r.output.find("moevement launch: model"), std::string::npos)
        << "nothing started: " << r.output;
  }
}

}  // namespace
}  // namespace moevement::launcher
