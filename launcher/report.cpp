#include "launcher/report.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <stdexcept>

#include "engine/run_log_reader.hpp"

namespace moevement::launcher {
namespace {

constexpr const char* report_usage =
    "usage: moevement report RUN.jsonl [MORE.jsonl ...] [-o REPORT.html]\n"
    "  one self-contained HTML file of the runs (overlaid): throughput over wall time with the\n"
    "  failures and recoveries, loss, checkpoint costs, the recoveries and their supervision\n"
    "  tree; default output: the first run log's name with .html\n";

// Okabe-Ito: told apart with any colour vision.
constexpr const char* palette[] = {"#0072B2", "#E69F00", "#009E73", "#CC79A7",
                                   "#56B4E9", "#D55E00", "#000000"};
constexpr const char* loss_colour = "#D55E00";

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// ---- what a run log tells

struct point {
  double x = 0, y = 0;
};

struct marker {
  double t = 0;
  std::string label;
};

struct recovery_row {
  double start = 0, end = -1, seconds = 0, spawn = 0, pull = 0, replay = 0, rejoin = 0;
  std::string kind, lost;
  long target = -1, replayed = 0;
  // Which recovery_end is its (regions recover side by side); a later generation of its
  // region restarted it.
  std::optional<double> generation, region;
  bool restarted = false;
};

// One event of the recovery tree (docs/recovery.md "The recovery tree"): a region's
// supervisor started, restarted (a member's worker lost), grew (a loss next to it), or gave up
// and escalated to the job supervisor.
struct supervision_row {
  double t = 0;
  std::string region, event, stages, roles;
  long generation = -1, restarts = -1;
};

struct run_story {
  std::string name, stopped;
  std::string skipped;  // the first unreadable line records followed (a torn write), if any
  std::size_t skipped_lines = 0;
  std::size_t left_out = 0;       // iteration and validation records without a usable iteration
  std::vector<point> throughput;  // (seconds since the start, tokens/s)
  std::vector<point> loss, val_loss, stall_ms, snapshot_mb, capture_ms;  // by iteration
  std::vector<marker> losses, injections;
  std::vector<double> persisted;  // times windows persisted
  std::vector<recovery_row> recoveries;
  std::vector<supervision_row> supervision;
  std::optional<double> ettr, wall_s, w_sparse;
  std::optional<double> w_last;    // W_sparse as the head re-chose it (window_tuned), if it did
  std::string hash, failed, stop;  // stop: SIGUSR1's job_stopped
  long iterations = 0;
  // job_start records: more than one where a resumed job, or a standby head taking over,
  // appended to the log; the takeovers among them.
  int starts = 0, takeovers = 0;
};

double num(const engine::run_record& r, const char* key, double fallback = 0) {
  return r.number(key).value_or(fallback);
}

// A value from the log fit to draw: finite and of a sane size (a log is untrusted).
std::optional<double> drawable(const engine::run_record& r, const char* key, double scale = 1) {
  const auto v = r.number(key);
  if (!v || !std::isfinite(*v * scale) || std::fabs(*v * scale) > 1e15) return std::nullopt;
  return *v * scale;
}

// A whole number from the log fit to show (-1: none, or not sane).
long whole(const engine::run_record& r, const char* key) {
  const auto v = drawable(r, key);
  return v && *v >= 0 ? static_cast<long>(*v) : -1;
}

// The recovery tree's events: each generation of a region (recovery_start) and each
// escalation (region_escalated).
void add_supervision(run_story& s, const engine::run_record& r, double t, const std::string& ev) {
  supervision_row row;
  row.t = t;
  const long region = whole(r, "region");
  row.region = region >= 0 ? std::to_string(region) : "-";
  const long first = whole(r, "first_stage"), last = whole(r, "last_stage");
  row.stages = first < 0       ? "-"
               : first == last ? fmt::format("{}", first)
                               : fmt::format("{}..{}", first, last);
  row.restarts = whole(r, "restarts");
  if (ev == "region_escalated") {
    row.event = "escalated to " + r.text("to").value_or("?");
    row.roles = r.text("reason").value_or("").substr(0, 200);
  } else if (r.is("recovery", "rollback")) {
    const long attempt = whole(r, "attempt");
    row.region = "rollback";
    row.event = attempt > 1 ? "restarted" : "started";
    row.stages = "all";
    row.roles = fmt::format("{}/{} rebuilt", num(r, "stage", -1), num(r, "replica", -1));
    row.generation = attempt;
  } else {
    row.event = r.text("supervision").value_or("started");
    row.roles = r.text("roles").value_or("").substr(0, 200);
    row.generation = whole(r, "generation");
  }
  s.supervision.push_back(std::move(row));
}

void add_event(run_story& s, const engine::run_record& r, double t) {
  const std::string ev = r.text("event").value_or("");
  if (ev == "worker_lost") {
    // A spare has no stage (-1), nor a loss during a standby's takeover (no key): named by
    // their worker.
    const auto stage = r.number("stage");
    const auto node = num(r, "node", -1);
    s.losses.push_back(
        {t, !stage       ? fmt::format("worker {} lost", node)
            : *stage < 0 ? fmt::format("spare worker {} lost", node)
                         : fmt::format("stage {} replica {} lost", *stage, num(r, "replica", -1))});
  } else if (ev == "inject") {
    s.injections.push_back({t, r.text("spec").value_or("inject")});
  } else if (ev == "window_persisted") {
    s.persisted.push_back(t);
  } else if (ev == "window_chosen") {
    s.w_sparse = r.number("w_sparse");
  } else if (ev == "window_tuned") {
    if (r.number("w_sparse") != r.number("previous")) s.w_last = r.number("w_sparse");
  } else if (ev == "recovery_start") {
    recovery_row row;
    row.start = t;
    row.kind = r.text("recovery").value_or("?");
    // A resume lost nothing: every stage restores from disk.
    row.lost = row.kind == "resume"
                   ? "none (every stage from disk)"
                   : fmt::format("stage {} replica {}", num(r, "stage", -1), num(r, "replica", -1));
    row.generation = drawable(r, "generation");
    row.region = drawable(r, "region");
    for (auto& earlier : s.recoveries) {
      if (earlier.end < 0 && row.region && earlier.region == row.region) earlier.restarted = true;
    }
    s.recoveries.push_back(row);
    add_supervision(s, r, t, ev);
  } else if (ev == "region_escalated") {
    add_supervision(s, r, t, ev);
  } else if (ev == "recovery_end" && !s.recoveries.empty()) {
    // The row of the same generation (regions recover side by side), else the newest.
    const auto generation = drawable(r, "generation");
    auto it = std::find_if(s.recoveries.rbegin(), s.recoveries.rend(), [&](const recovery_row& x) {
      return generation && x.generation == generation && x.end < 0;
    });
    recovery_row& row = it != s.recoveries.rend() ? *it : s.recoveries.back();
    row.end = t;
    row.seconds = num(r, "seconds");
    row.spawn = num(r, "spawn_s");
    row.pull = num(r, "pull_s");
    row.replay = num(r, "replay_s");
    row.rejoin = num(r, "rejoin_s");
    row.target = static_cast<long>(drawable(r, "target_iteration").value_or(-1));
    row.replayed = static_cast<long>(drawable(r, "iterations_replayed").value_or(0));
  } else if (ev == "job_start") {
    ++s.starts;
    s.failed.clear();  // a resume or a takeover goes on: the end is this run's
    s.stop.clear();
    s.hash.clear();
    s.ettr.reset();
    if (r.has("takeover")) ++s.takeovers;
  } else if (ev == "job_end") {
    s.ettr = r.number("ettr");  // of the last run (a resumed job's: since its resume)
    // A resumed job's wall time is every run's in the log, on the clock that joins them.
    s.wall_s = s.starts > 1 ? std::optional<double>(t) : r.number("wall_s");
    s.hash = r.text("state_hash").value_or("");
  } else if (ev == "job_failed") {
    s.failed = r.text("message").value_or("the job failed");
  } else if (ev == "job_stopped") {
    s.stop = r.text("message").value_or("stopped with a window on disk");
    s.ettr = r.number("ettr");  // a clean end: measured as job_end's
    s.wall_s = s.starts > 1 ? std::optional<double>(t) : r.number("wall_s");
  }
}

// Times from job_start. A resumed job appends to the same log, its own clock from 0 again:
// each job_start after the first goes on from the last time seen.
class run_clock {
 public:
  double at(const engine::run_record& r) {
    if (r.is("event", "job_start")) {
      if (started_) offset_ = now_;
      started_ = true;
      t0_ = r.number("time_s").value_or(0);
    }
    if (const auto t = r.number("time_s"); t && std::isfinite(*t) && std::fabs(*t) < 1e12) {
      now_ = offset_ + std::max(0.0, *t - t0_);
    }
    return now_;
  }
  // A record without time_s (an older log) that took `seconds`.
  double advance(double seconds) {
    if (std::isfinite(seconds) && seconds > 0 && seconds < 1e9) now_ += seconds;
    return now_;
  }

 private:
  bool started_ = false;
  double t0_ = 0, offset_ = 0, now_ = 0;
};

run_story story_of(const std::string& path, const engine::run_log_contents& log) {
  run_story s;
  s.name = std::filesystem::path(path).filename().string();
  s.stopped = log.stopped;
  s.skipped = log.skipped.empty() ? "" : log.skipped.front();
  s.skipped_lines = log.skipped_lines;
  run_clock clock;
  for (const auto& r : log.records) {
    if (r.is("kind", "iteration")) {
      const double t = r.has("time_s") ? clock.at(r) : clock.advance(num(r, "iteration_s"));
      const auto it = drawable(r, "iteration");
      if (!it) {
        ++s.left_out;
        continue;
      }
      auto add = [&](std::vector<point>& to, std::optional<double> v) {
        if (v) to.push_back({*it, *v});
      };
      if (const auto tps = drawable(r, "tokens_per_s")) s.throughput.push_back({t, *tps});
      add(s.loss, drawable(r, "loss"));  // a diverged loss is null: not drawn
      add(s.stall_ms, drawable(r, "stall_s", 1000));
      add(s.snapshot_mb, drawable(r, "snapshot_bytes", 1e-6));
      add(s.capture_ms, drawable(r, "capture_cpu_s", 1000));
      s.iterations = std::max(s.iterations, static_cast<long>(std::max(0.0, *it)) + 1);
    } else if (r.is("kind", "validation")) {
      const auto it = drawable(r, "iteration");
      const auto v = drawable(r, "val_loss");
      if (it && v) s.val_loss.push_back({*it, *v});
      if (!it) ++s.left_out;
    } else if (r.is("kind", "event")) {
      add_event(s, r, clock.at(r));
    }
  }
  return s;
}

// ---- charts

// A round step for about `n` ticks over [0, span].
double tick_step(double span, int n) {
  if (!(span > 0) || !std::isfinite(span)) return 1;
  const double raw = span / n, mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    if (m * mag >= raw) return m * mag;
  }
  return 10 * mag;
}

std::string tick_text(double v) {
  if (v != 0 && (std::fabs(v) >= 1e5 || std::fabs(v) < 1e-2)) return fmt::format("{:.1e}", v);
  return fmt::format("{:g}", std::round(v * 1000) / 1000);
}

// One line chart: x and y from 0 (or the data's minimum) to their maxima, ticked and labelled.
class svg_chart {
 public:
  svg_chart(std::string title, std::string x_label, std::string y_label)
      : title_(std::move(title)), x_label_(std::move(x_label)), y_label_(std::move(y_label)) {}

  // Axes from 0 (or the data's minimum, when negative) to the data's maxima.
  void fit(const std::vector<point>& pts) {
    for (const auto& p : pts) {
      x_max_ = std::max(x_max_, p.x);
      y_max_ = std::max(y_max_, p.y);
      y_min_ = std::min(y_min_, p.y);
    }
  }
  void fit_x(double x) { x_max_ = std::max(x_max_, x); }

  void line(const std::vector<point>& pts, const char* colour, bool dots = false) {
    if (pts.empty()) return;
    std::string d;
    for (const auto& p : pts) d += fmt::format("{:.1f},{:.1f} ", px(p.x), py(p.y));
    body_ += fmt::format(
        "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n", colour, d);
    if (!dots) return;
    for (const auto& p : pts) {
      body_ += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n", px(p.x),
                           py(p.y), colour);
    }
  }
  // A vertical line at x with a label (hover) and a short text.
  void rule(double x, const char* colour, const std::string& label, const char* dash) {
    body_ += fmt::format(
        "<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1}\" y2=\"{2}\" stroke=\"{3}\" "
        "stroke-dasharray=\"{4}\"><title>{5}</title></line>\n",
        px(x), top_, top_ + plot_h_, colour, dash, escape(label));
  }
  void band(double x0, double x1, const char* colour, const std::string& label) {
    body_ += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{}\" width=\"{:.1f}\" height=\"{}\" fill=\"{}\" "
        "fill-opacity=\"0.18\"><title>{}</title></rect>\n",
        px(x0), top_, std::max(1.0, px(x1) - px(x0)), plot_h_, colour, escape(label));
  }
  void tick_below(double x, const char* colour) {
    body_ +=
        fmt::format("<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1}\" y2=\"{2}\" stroke=\"{3}\"/>\n",
                    px(x), top_ + plot_h_ - 6, top_ + plot_h_, colour);
  }

  std::string svg() const {
    std::string out = fmt::format(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
        "viewBox=\"0 0 {} {}\" role=\"img\"><title>{}</title>\n",
        width_, height_, width_, height_, escape(title_));
    out += fmt::format("<text x=\"{}\" y=\"16\" class=\"t\">{}</text>\n", left_, escape(title_));
    out += axes();
    out += body_;
    return out + "</svg>\n";
  }

 private:
  double px(double x) const { return left_ + (x_max_ > 0 ? x / x_max_ : 0) * plot_w_; }
  double py(double y) const {
    const double span = y_max_ - y_min_;
    return top_ + plot_h_ - (span > 0 ? (y - y_min_) / span : 0) * plot_h_;
  }
  std::string axes() const {
    std::string out = fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>\n",
        left_, top_, plot_w_, plot_h_);
    const double xs = tick_step(x_max_, 10), ys = tick_step(y_max_ - y_min_, 5);
    for (int i = 0; i <= max_ticks; ++i) {
      const double x = i * xs;
      if (x > x_max_ * 1.0001) break;
      out += fmt::format("<text x=\"{:.1f}\" y=\"{}\" class=\"x\">{}</text>\n", px(x),
                         top_ + plot_h_ + 16, tick_text(x));
    }
    const double y0 = std::ceil(y_min_ / ys) * ys;
    for (int i = 0; i <= max_ticks; ++i) {
      const double y = y0 + i * ys;
      if (y > y_max_ * 1.0001) break;
      out += fmt::format(
          "<line x1=\"{}\" x2=\"{}\" y1=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#eee\"/>"
          "<text x=\"{}\" y=\"{:.1f}\" class=\"y\">{}</text>\n",
          left_, left_ + plot_w_, py(y), py(y), left_ - 6, py(y) + 4, tick_text(y));
    }
    out += fmt::format("<text x=\"{}\" y=\"{}\" class=\"xl\">{}</text>\n", left_ + plot_w_ / 2,
                       height_ - 4, escape(x_label_));
    out += fmt::format("<text transform=\"translate(14,{}) rotate(-90)\" class=\"xl\">{}</text>\n",
                       top_ + plot_h_ / 2, escape(y_label_));
    return out;
  }

  static constexpr int max_ticks = 20;
  std::string title_, x_label_, y_label_, body_;
  int width_ = 1180, height_ = 300, left_ = 70, top_ = 28, plot_w_ = 1080, plot_h_ = 228;
  double x_max_ = 0, y_max_ = 0, y_min_ = 0;
};

// ---- the page

std::string throughput_chart(const std::vector<run_story>& runs) {
  svg_chart c("Throughput over wall time, with failures and recoveries",
              "seconds since the job started", "tokens/s");
  for (const auto& r : runs) {
    c.fit(r.throughput);
    for (const auto& rec : r.recoveries) c.fit_x(rec.end >= 0 ? rec.end : rec.start);
    for (const auto& m : r.losses) c.fit_x(m.t);
    for (const auto& m : r.injections) c.fit_x(m.t);
    for (double t : r.persisted) c.fit_x(t);
  }
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const char* colour = palette[i % std::size(palette)];
    const auto& r = runs[i];
    for (const auto& rec : r.recoveries) {
      c.band(
          rec.start, rec.end >= 0 ? rec.end : rec.start, colour,
          fmt::format("{}: {} recovery of {} ({:.2f} s)", r.name, rec.kind, rec.lost, rec.seconds));
    }
    for (double t : r.persisted) c.tick_below(t, colour);
    c.line(r.throughput, colour);
    for (const auto& m : r.losses) c.rule(m.t, "#D55E00", r.name + ": " + m.label, "6,3");
    for (const auto& m : r.injections) c.rule(m.t, "#000000", r.name + ": " + m.label, "2,3");
  }
  return c.svg();
}

std::string loss_chart(const run_story& r) {
  svg_chart c(r.name + ": loss", "iteration", "loss (nats)");
  c.fit(r.loss);
  c.fit(r.val_loss);
  c.line(r.loss, palette[0]);
  c.line(r.val_loss, loss_colour, true);
  return c.svg();
}

// One per-iteration series as a chart of its own; nothing when the log has none.
std::string series_chart(const std::string& title, const std::string& y_label,
                         const std::vector<point>& pts, const char* colour) {
  if (pts.empty()) return "";
  svg_chart c(title, "iteration", y_label);
  c.fit(pts);
  c.line(pts, colour);
  return c.svg();
}

std::string cost_charts(const run_story& r) {
  return series_chart(r.name + ": the step's wait for the checkpoint capture (stall)", "stall (ms)",
                      r.stall_ms, palette[1]) +
         series_chart(r.name + ": CPU time of the stages' captures per iteration (summed)",
                      "capture CPU (ms)", r.capture_ms, palette[3]) +
         series_chart(r.name + ": snapshot bytes captured per iteration", "MB", r.snapshot_mb,
                      palette[2]);
}

std::string summary_table(const std::vector<run_story>& runs) {
  std::string out =
      "<table><tr><th>run</th><th>iterations</th><th>wall (s)</th><th>ETTR</th>"
      "<th>W_sparse</th><th>failures</th><th>recoveries</th><th>end</th></tr>\n";
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    std::string end = !r.failed.empty() ? "failed: " + r.failed
                      : !r.stop.empty() ? r.stop
                      : r.hash.empty()  ? "no job_end record (still running, or killed)"
                                        : "state_hash " + r.hash;
    out += fmt::format(
        "<tr><td><span class=\"key\" style=\"background:{}\"></span>{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
        palette[i % std::size(palette)], escape(r.name), r.iterations,
        r.wall_s ? fmt::format("{:.2f}", *r.wall_s) : "-",
        !r.ettr ? std::string("-")
        : r.starts > 1
            ? fmt::format("{:.3f} (the last of {} runs: {})", *r.ettr, r.starts,
                          r.takeovers == 0              ? "resumed"
                          : r.takeovers == r.starts - 1 ? "a standby head took over"
                                                        : "resumed, and a standby head took over")
            : fmt::format("{:.3f}", *r.ettr),
        !r.w_sparse ? std::string("-")
        : r.w_last  ? fmt::format("{:g} &rarr; {:g}", *r.w_sparse, *r.w_last)
                    : fmt::format("{:g}", *r.w_sparse),
        r.takeovers == 0
            ? std::to_string(r.losses.size())
            : fmt::format("{} (and the head: a standby took over{})", r.losses.size(),
                          r.takeovers > 1 ? fmt::format(", {} times", r.takeovers) : std::string()),
        r.recoveries.size(), escape(end));
  }
  return out + "</table>\n";
}

std::string recovery_table(const std::vector<run_story>& runs) {
  std::string out =
      "<table><tr><th>run</th><th>at (s)</th><th>kind</th><th>lost</th><th>resumed at "
      "iteration</th><th>replayed</th><th>seconds</th><th>spawn</th><th>pull</th>"
      "<th>replay</th><th>rejoin</th></tr>\n";
  std::size_t rows = 0;
  for (const auto& r : runs) {
    for (const auto& rec : r.recoveries) {
      ++rows;
      out += fmt::format(
          "<tr><td>{}</td><td>{:.2f}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
          "<td>{:.3f}</td><td>{:.3f}</td><td>{:.3f}</td><td>{:.3f}</td><td>{:.3f}</td></tr>\n",
          escape(r.name), rec.start, escape(rec.kind), escape(rec.lost),
          rec.end >= 0    ? std::to_string(rec.target)
          : rec.restarted ? "(restarted)"
                          : "(did not end)",
          rec.replayed, rec.seconds, rec.spawn, rec.pull, rec.replay, rec.rejoin);
    }
  }
  if (rows == 0) return "<p>No recovery in these runs.</p>\n";
  return out + "</table>\n";
}

std::string supervision_table(const std::vector<run_story>& runs) {
  std::string out =
      "<p>Each recovery region has a supervisor under the job supervisor: it started, restarted "
      "(a member's worker was lost), grew (a loss next to it), or gave up past "
      "checkpoint.region_restarts and escalated.</p>\n"
      "<table><tr><th>run</th><th>at (s)</th><th>region</th><th>event</th><th>stages</th>"
      "<th>members (stage/replica), or why</th><th>generation</th><th>restarts</th></tr>\n";
  std::size_t rows = 0;
  auto number = [](long v) { return v >= 0 ? std::to_string(v) : std::string("-"); };
  for (const auto& r : runs) {
    for (const auto& e : r.supervision) {
      ++rows;
      out += fmt::format(
          "<tr><td>{}</td><td>{:.2f}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
          "<td>{}</td></tr>\n",
          escape(r.name), e.t, escape(e.region), escape(e.event), escape(e.stages), escape(e.roles),
          number(e.generation), number(e.restarts));
    }
  }
  if (rows == 0) return "<p>No recovery tree in these runs.</p>\n";
  return out + "</table>\n";
}

constexpr const char* style =
    "body{font-family:sans-serif;max-width:1200px;margin:1em auto;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;"
    "text-align:right}td:first-child,th:first-child{text-align:left}"
    ".key{display:inline-block;width:12px;height:12px;margin-right:6px}"
    ".warn{color:#a40}svg{display:block;margin:0.8em 0}"
    "svg .t{font-size:14px;font-weight:bold}svg .x{font-size:11px;text-anchor:middle}"
    "svg .y{font-size:11px;text-anchor:end}svg .xl{font-size:12px;text-anchor:middle}";

std::string page(const std::vector<run_story>& runs) {
  std::string out = fmt::format(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>moevement report</title>"
      "<style>{}</style></head><body>\n<h1>moevement report</h1>\n",
      style);
  for (const auto& r : runs) {
    if (!r.stopped.empty()) {
      out += fmt::format("<p class=\"warn\">{}: read up to {}; the rest is not shown.</p>\n",
                         escape(r.name), escape(r.stopped));
    }
    if (r.skipped_lines > 0) {
      out += fmt::format(
          "<p class=\"warn\">{}: {} unreadable line(s) skipped, records after them (a write torn "
          "by a kill, the resume's records appended); the first: {}.</p>\n",
          escape(r.name), r.skipped_lines, escape(r.skipped));
    }
    if (r.left_out > 0) {
      out += fmt::format(
          "<p class=\"warn\">{}: {} iteration or validation record(s) left out: their "
          "\"iteration\" is missing or not a number.</p>\n",
          escape(r.name), r.left_out);
    }
  }
  out += summary_table(runs);
  out +=
      "<p>Shaded: a recovery (detection to training going on); dashed: a worker lost; "
      "dotted: an injected failure; ticks at the bottom: a window persisted. Hover for "
      "details.</p>\n";
  out += throughput_chart(runs);
  out += "<h2>Recoveries</h2>\n" + recovery_table(runs);
  out += "<h2>The recovery tree</h2>\n" + supervision_table(runs);
  for (const auto& r : runs) {
    out += "<h2>" + escape(r.name) + "</h2>\n" + loss_chart(r) + cost_charts(r);
  }
  return out + "</body></html>\n";
}

}  // namespace

void write_report(const std::vector<std::string>& run_logs, const std::string& out_path) {
  for (const auto& log : run_logs) {  // the page would replace the run log it is made from
    std::error_code ec;
    if (log == out_path || std::filesystem::equivalent(log, out_path, ec)) {
      throw std::invalid_argument("the report would overwrite its run log " + log +
                                  "; name another output (-o, or --report)");
    }
  }
  std::vector<run_story> runs;
  for (const auto& path : run_logs) {
    auto log = engine::read_run_log(path);
    if (!log.ok()) throw std::runtime_error(log.err().message);
    runs.push_back(story_of(path, *log));
  }
  // Logs of one name (each job's run.jsonl) are told apart by the path given.
  std::map<std::string, int> named;
  for (const auto& r : runs) ++named[r.name];
  for (std::size_t i = 0; i < runs.size(); ++i) {
    if (named[runs[i].name] > 1) runs[i].name = run_logs[i];
  }
  // Private as the run log is (it names hosts and failures): 0600 whatever the umask.
  const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || ::fchmod(fd, 0600) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("cannot write " + out_path + ": " + std::strerror(errno));
  }
  ::close(fd);
  std::ofstream out(out_path, std::ios::trunc);
  out << page(runs);
  out.flush();
  if (!out) throw std::runtime_error("cannot write " + out_path);
}

int run_report(int argc, char** argv) {
  std::vector<std::string> logs;
  std::string out;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-o" || a == "--output") {
      if (i + 1 >= argc) {
        std::cerr << "moevement report: " << a << " needs a file name\n" << report_usage;
        return 2;
      }
      out = argv[++i];
    } else if (a == "--help" || a == "-h") {
      std::cout << report_usage;
      return 0;
    } else if (a.starts_with("-")) {
      std::cerr << "moevement report: unexpected argument '" << a << "'\n" << report_usage;
      return 2;
    } else {
      logs.push_back(a);
    }
  }
  if (logs.empty()) {
    std::cerr << report_usage;
    return 2;
  }
  if (out.empty()) {
    std::string base = logs.front();
    if (base.ends_with(".jsonl")) base.resize(base.size() - 6);
    out = base + ".html";
  }
  try {
    write_report(logs, out);
  } catch (const std::invalid_argument& e) {
    std::cerr << "moevement report: " << e.what() << "\n";
    return 2;
  }
  std::cout << "report: " << out << "\n";
  return 0;
}

}  // namespace moevement::launcher
