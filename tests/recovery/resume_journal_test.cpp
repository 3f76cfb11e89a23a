// The head's resume journal: a resume point written and read back is the same bit for bit
// (floats and the layout included); the newest journal that verifies is used, a corrupt one skipped
// with its reason; a journal of another job is refused naming the setting that differs; malformed
// text (truncated, steps missing, out of range) is an error, never a crash.
#include "recovery/resume_journal.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>

#include "recovery/durable_store.hpp"

namespace moevement::recovery {
namespace {

engine::job_config job_in(const std::filesystem::path& dir) {
  models::config_map m;
  m["checkpoint.policy"] = std::string("moevement");
  m["checkpoint.durable"] = true;
  m["checkpoint.dir"] = dir.string();
  m["parallel.pp"] = std::int64_t{2};
  return engine::resolve_job(m);
}

engine::resume_point point(std::uint64_t window) {
  engine::resume_point p;
  p.window = window;
  p.w_sparse = 3;
  p.target_iteration = std::int64_t(window) * 3 + 5;
  p.scaler.enabled = true;
  p.scaler.scale = 32768.0f;
  p.scaler.good_steps = 7;
  p.scaler.window = 200;
  p.pp = 3;
  p.dp = 2;
  p.ep = 2;
  p.windows = {{window - 1, std::int64_t(window - 1) * 3 + 1},
               {window, std::int64_t(window) * 3 + 1}};
  for (std::int64_t it = p.windows.begin()->second; it < p.target_iteration; ++it) {
    engine::planned_step s;
    s.loss_scale = 65536.0f / float(it + 1);
    s.plan.apply = it % 4 != 0;
    s.plan.grad_mul = 1.0f / 3.0f + float(it);
    s.plan.grad_norm = std::sqrt(double(it) + 0.1);
    p.steps[it] = s;
  }
  return p;
}

class resume_journal_test : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("resume_journal_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

void expect_same(const engine::resume_point& a, const engine::resume_point& b) {
  EXPECT_EQ(a.window, b.window);
  EXPECT_EQ(a.w_sparse, b.w_sparse);
  EXPECT_EQ(a.target_iteration, b.target_iteration);
  EXPECT_EQ(a.scaler.enabled, b.scaler.enabled);
  EXPECT_EQ(a.scaler.scale, b.scaler.scale);
  EXPECT_EQ(a.scaler.good_steps, b.scaler.good_steps);
  EXPECT_EQ(a.scaler.window, b.scaler.window);
  EXPECT_EQ(a.pp, b.pp);
  EXPECT_EQ(a.dp, b.dp);
  EXPECT_EQ(a.ep, b.ep);
  EXPECT_EQ(a.windows, b.windows);
  EXPECT_EQ(a.steps, b.steps);
}

TEST_F(resume_journal_test, a_point_reads_back_bit_for_bit_and_the_newest_wins) {
  const resume_journal j(job_in(dir_));
  j.write(point(4));
  j.write(point(5));
  auto r = j.load();
  ASSERT_TRUE(r.ok()) << r.err().message;
  expect_same(*r, point(5));
}

// A rollback past silent corruption journals the window it went back to again, with the
// iteration it goes on at: the newer journals (of the timeline it left) are dropped.
TEST_F(resume_journal_test, a_rollback_drops_the_journals_of_the_timeline_it_left) {
  const resume_journal j(job_in(dir_));
  j.write(point(4));
  j.write(point(5));
  j.write(point(6));
  engine::resume_point back = point(4);
  back.target_iteration = 14;
  back.steps.erase(back.steps.lower_bound(14), back.steps.end());
  back.drop_newer = true;
  j.write(back);
  auto r = j.load();
  ASSERT_TRUE(r.ok()) << r.err().message;
  expect_same(*r, back);
  EXPECT_EQ(durable_store(resume_journal_dir(dir_)).windows(), std::vector<std::uint64_t>{4});
}

TEST_F(resume_journal_test, a_corrupt_newest_journal_is_skipped_with_its_reason) {
  const resume_journal j(job_in(dir_));
  j.write(point(4));
  j.write(point(5));
  const auto file = resume_journal_dir(dir_) / "window-00000000000000000005" / "resume.txt";
  ASSERT_TRUE(std::filesystem::exists(file));
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(20);
    f.put('#');
  }
  std::vector<std::string> rejected;
  auto r = j.load(&rejected);
  ASSERT_TRUE(r.ok()) << r.err().message;
  expect_same(*r, point(4));
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_NE(rejected[0].find("journal 5"), std::string::npos) << rejected[0];
  EXPECT_NE(rejected[0].find("checksum"), std::string::npos) << rejected[0];
}

TEST_F(resume_journal_test, another_jobs_journal_is_refused_naming_the_setting) {
  resume_journal(job_in(dir_)).write(point(4));
  auto other = job_in(dir_);
  other.model.layers = 6;
  auto r = resume_journal(other).load();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.err().message.find("model.layers = 4; this config has 6"), std::string::npos)
      << r.err().message;
  // Settings that change no bit do not matter, nor the placement (the journal says the
  // windows' layout; a resume may run at another).
  auto longer = job_in(dir_);
  longer.train.iterations = 1000;
  longer.train.val_every = 5;
  longer.pp = 4;
  longer.dp = 2;
  // Loss scaling runs only with f16 compute.
  longer.train.loss_scale = 1024;
  EXPECT_TRUE(resume_journal(longer).load().ok());
  auto f16 = job_in(dir_);
  f16.model.compute_dtype = moevement::models::dtype::f16;
  resume_journal(f16).write(point(4));
  f16.train.loss_scale = 1024;
  r = resume_journal(f16).load();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.err().message.find("train.loss_scale = 65536; this config has 1024"),
            std::string::npos)
      << r.err().message;
}

// A resume that went back past newer journals drops them: the windows from then on take their
// numbers again.
TEST_F(resume_journal_test, journals_after_a_window_are_dropped) {
  const resume_journal j(job_in(dir_));
  for (int w : {3, 4, 5}) j.write(point(w));
  j.drop_after(3);
  auto r = j.load();
  ASSERT_TRUE(r.ok()) << r.err().message;
  EXPECT_EQ(r->window, 3u);
  EXPECT_FALSE(j.load(nullptr, 3).ok()) << "nothing before window 3";
}

TEST_F(resume_journal_test, nothing_to_resume_says_where_it_looked) {
  auto r = resume_journal(job_in(dir_)).load();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.err().message.find("nothing to resume"), std::string::npos) << r.err().message;
  EXPECT_NE(r.err().message.find("checkpoint.durable = true"), std::string::npos);
  EXPECT_NE(r.err().message.find("does not exist"), std::string::npos) << r.err().message;
  EXPECT_NE(r.err().message.find("a job killed before that has nothing to go on from"),
            std::string::npos)
      << r.err().message;
  // A cleared journal directory is as empty.
  const resume_journal j(job_in(dir_));
  j.write(point(4));
  j.clear();
  r = j.load();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.err().message.find("0 journal(s)"), std::string::npos) << r.err().message;
}

// A journal directory that is there but cannot be read is no empty journal: a requeued job
// asks empty() to choose between resuming and starting over (clearing every window).
TEST_F(resume_journal_test, a_journal_that_cannot_be_listed_is_an_error_not_empty) {
  const resume_journal j(job_in(dir_));
  j.write(point(4));
  EXPECT_FALSE(j.empty());
  const auto head = resume_journal_dir(dir_);
  std::filesystem::remove_all(head);
  { std::ofstream(head) << "not a directory"; }  // (chmod cannot stop root, who runs CI)
  EXPECT_THROW((void)j.empty(), std::runtime_error);
  std::filesystem::remove(head);
  EXPECT_TRUE(j.empty()) << "no journal directory at all is an empty journal";
}

TEST(resume_text, malformed_text_is_an_error_saying_what) {
  const auto ids = state_identity(engine::resolve_job({}));
  const std::string good = resume_text(point(4), ids);
  ASSERT_TRUE(parse_resume_text(good).ok());
  // Truncated: the header only, or without its steps.
  EXPECT_FALSE(parse_resume_text("moevement-resume 1\n").ok());
  const std::string no_steps = good.substr(0, good.find("step "));
  auto r = parse_resume_text(no_steps);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.err().message.find("is missing"), std::string::npos) << r.err().message;
  // Another version, an unknown line, a float that is not 8 hex digits, a step past target.
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  EXPECT_FALSE(parse_resume_text(replaced("moevement-resume 1", "moevement-resume 2")).ok());
  EXPECT_FALSE(parse_resume_text(good + "rm -rf /\n").ok());
  EXPECT_FALSE(parse_resume_text(replaced("loss_scaler 1 47000000", "loss_scaler 1 4700")).ok());
  EXPECT_FALSE(parse_resume_text(good + "step 999999 3f800000 1 3f800000 0000000000000000\n").ok());
  EXPECT_FALSE(parse_resume_text(replaced("w_sparse 3", "w_sparse 0")).ok());
  EXPECT_FALSE(parse_resume_text(replaced("layout 3 2 2", "layout 0 2 2")).ok());
  EXPECT_FALSE(parse_resume_text(replaced("layout 3 2 2", "layout 3")).ok());
  EXPECT_FALSE(parse_resume_text(replaced("layout 3 2 2", "layout 3 2 3")).ok());  // ep | dp
  EXPECT_FALSE(parse_resume_text(replaced("layout 3 2 2", "layout 3 2 0")).ok());
  // A journal of before the EP degree was written: ep 1.
  const auto old = parse_resume_text(replaced("layout 3 2 2", "layout 3 2"));
  ASSERT_TRUE(old.ok()) << old.err().message;
  EXPECT_EQ(old->first.ep, 1);
  EXPECT_FALSE(parse_resume_text(std::string("\0\0\0", 3)).ok());
  // An identity line cut after its key (reading its value used to throw out_of_range).
  EXPECT_FALSE(parse_resume_text(good + "identity train.seed\n").ok());
  EXPECT_FALSE(parse_resume_text(good + "identity  1\n").ok());
  // A corpus path with spaces survives.
  auto job = engine::resolve_job({});
  job.train.corpus = "/data/my corpus";
  auto back = parse_resume_text(resume_text(point(4), state_identity(job)));
  ASSERT_TRUE(back.ok()) << back.err().message;
  bool found = false;
  for (const auto& [k, v] : back->second) found |= k == "train.corpus" && v == "/data/my corpus";
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace moevement::recovery
