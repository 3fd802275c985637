#include "planner/profile.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

namespace pipeshard {
namespace {

constexpr const char* kFormat = "pipeshard-profile";
constexpr int kVersion = 1;

double flops(int64_t rows, int64_t in, int64_t out) {
  return 2.0 * static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
}

// The measured time of pass `us` (a member of LinearTiming) at the shape, or scaled from
// the listed shape nearest in log flops, or from the GEMM rate.
double linear_us(const MachineProfile& p, int64_t rows, int64_t in, int64_t out, double LinearTiming::*us) {
  const double f = flops(rows, in, out);
  if (f <= 0) return 0;
  const LinearTiming* nearest = nullptr;
  double distance = std::numeric_limits<double>::infinity();
  for (const LinearTiming& t : p.linear) {
    if (t.rows == rows && t.in == in && t.out == out) return t.*us;
    const double d = std::abs(std::log(flops(t.rows, t.in, t.out) / f));
    if (d < distance) distance = d, nearest = &t;
  }
  if (nearest != nullptr && nearest->*us > 0) return nearest->*us * f / flops(nearest->rows, nearest->in, nearest->out);
  return f / p.gemm_flops_per_s * 1e6;
}

nlohmann::json link_json(const LinkCost& c) {
  nlohmann::json j = {{"latency_us", c.latency_us}, {"bytes_per_s", c.bytes_per_s}};
  if (!c.points.empty()) {
    j["measured"] = nlohmann::json::array();
    for (const LinkCost::Point& p : c.points) j["measured"].push_back({{"bytes", p.bytes}, {"us", p.us}});
  }
  return j;
}

// Reads the fields of profile.json into a MachineProfile, naming the first one at fault.
class Reader {
 public:
  explicit Reader(const std::string& label) : label_(label) {}

  Status number(const nlohmann::json& j, const char* key, const std::string& path, double& out, bool positive) {
    if (!j.contains(key)) return Status::ok();  // the default stays
    const nlohmann::json& v = j.at(key);
    const bool ok = v.is_number() && std::isfinite(v.get<double>()) && (positive ? v.get<double>() > 0 : v >= 0);
    if (!ok) return bad(path + key, positive ? "a positive number" : "a number, 0 or more");
    out = v.get<double>();
    return Status::ok();
  }

  Status link(const nlohmann::json& j, const char* key, LinkCost& out) {
    if (!j.contains(key)) return Status::ok();
    const nlohmann::json& v = j.at(key);
    if (!v.is_object()) return bad(key, "an object with latency_us and bytes_per_s");
    const std::string path = std::string(key) + ".";
    if (Status s = number(v, "latency_us", path, out.latency_us, false); !s) return s;
    if (Status s = number(v, "bytes_per_s", path, out.bytes_per_s, true); !s) return s;
    return objects(v, path, "measured", "a list of {\"bytes\", \"us\"}",
                   [&](const nlohmann::json& e, const std::string& at) {
                     LinkCost::Point p;
                     if (Status s = fields(e, at, {{"bytes", &p.bytes}, {"us", &p.us}}, true); !s) return s;
                     if (!out.points.empty() && p.bytes <= out.points.back().bytes) {
                       return bad(at + "bytes", "more than the point before's (ascending)");
                     }
                     out.points.push_back(p);
                     return Status::ok();
                   });
  }

  Status linear(const nlohmann::json& j, std::vector<LinearTiming>& out) {
    return objects(j, "", "linear", "a list of timed shapes", [&](const nlohmann::json& e, const std::string& at) {
      double rows = 0, in = 0, outf = 0;
      if (Status s = fields(e, at, {{"rows", &rows}, {"in", &in}, {"out", &outf}}, true); !s) return s;
      for (auto [key, field] : {std::pair{"rows", rows}, {"in", in}, {"out", outf}}) {
        if (field != std::floor(field) || field > 1e12) return bad(at + key, "a whole number");
      }
      LinearTiming t;
      t.rows = static_cast<int64_t>(rows), t.in = static_cast<int64_t>(in), t.out = static_cast<int64_t>(outf);
      const std::initializer_list<std::pair<const char*, double*>> times = {
          {"forward_us", &t.forward_us}, {"input_grad_us", &t.input_grad_us}, {"weight_grad_us", &t.weight_grad_us}};
      if (Status s = fields(e, at, times, false); !s) return s;
      out.push_back(t);
      return Status::ok();
    });
  }

  // compute_scale_by_rows: {"rows", "scale"} objects, rows ascending.
  Status rows_scales(const nlohmann::json& j, std::vector<MachineProfile::RowsScale>& out) {
    return objects(j, "", "compute_scale_by_rows", "a list of {\"rows\", \"scale\"}",
                   [&](const nlohmann::json& e, const std::string& at) {
                     double rows = 0, scale = 0;
                     if (Status s = fields(e, at, {{"rows", &rows}, {"scale", &scale}}, true); !s) return s;
                     if (rows != std::floor(rows) || rows > 1e12) return bad(at + "rows", "a whole number");
                     if (!out.empty() && static_cast<int64_t>(rows) <= out.back().rows) {
                       return bad(at + "rows", "more than the entry before's (ascending)");
                     }
                     out.push_back({static_cast<int64_t>(rows), scale});
                     return Status::ok();
                   });
  }

  // The list of objects at `key` of `j` (`path` names `j` in messages), each handed to
  // `each` with its own path ("key[i].") to read; nothing when the key is absent.
  Status objects(const nlohmann::json& j, const std::string& path, const char* key, const char* what,
                 const std::function<Status(const nlohmann::json&, const std::string&)>& each) {
    if (!j.contains(key)) return Status::ok();
    const nlohmann::json& list = j.at(key);
    if (!list.is_array()) return bad(path + key, what);
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string at = path + key + "[" + std::to_string(i) + "]";
      if (!list[i].is_object()) return bad(at, "an object");
      if (Status s = each(list[i], at + "."); !s) return s;
    }
    return Status::ok();
  }

  // Each of `keys` present in `e` and a number (positive, or 0 or more), read into its field.
  Status fields(const nlohmann::json& e, const std::string& path,
                std::initializer_list<std::pair<const char*, double*>> keys, bool positive) {
    for (auto [key, field] : keys) {
      if (!e.contains(key)) return bad(path + key, "present");
      if (Status s = number(e, key, path, *field, positive); !s) return s;
    }
    return Status::ok();
  }

  Status bad(const std::string& field, const std::string& what) const {
    return Status::error(label_ + ": '" + field + "' must be " + what);
  }

 private:
  std::string label_;
};

}  // namespace

double LinkCost::time_us(double bytes) const {
  if (bytes <= 0) return 0;
  if (points.size() < 2) return latency_us + bytes / bytes_per_s * 1e6;
  size_t above = 1;  // the segment [above − 1, above] that holds `bytes`, or the end one nearest
  while (above + 1 < points.size() && points[above].bytes < bytes) ++above;
  const Point &lo = points[above - 1], &hi = points[above];
  return std::max(0.0, lo.us + (hi.us - lo.us) * (bytes - lo.bytes) / (hi.bytes - lo.bytes));
}

double MachineProfile::linear_forward_us(int64_t rows, int64_t in, int64_t out) const {
  return linear_us(*this, rows, in, out, &LinearTiming::forward_us);
}
double MachineProfile::linear_input_grad_us(int64_t rows, int64_t in, int64_t out) const {
  return linear_us(*this, rows, in, out, &LinearTiming::input_grad_us);
}
double MachineProfile::linear_weight_grad_us(int64_t rows, int64_t in, int64_t out) const {
  return linear_us(*this, rows, in, out, &LinearTiming::weight_grad_us);
}

double MachineProfile::all_reduce_us(double bytes, int group) const {
  if (group <= 1) return 0;
  return all_reduce.time_us(2.0 * (group - 1) / group * bytes);
}

double MachineProfile::reduce_scatter_us(double bytes, int group) const {
  if (group <= 1) return 0;
  return all_reduce.time_us(1.0 * (group - 1) / group * bytes);
}

double MachineProfile::compute_scale_at(double rows) const {
  const std::vector<RowsScale>& c = compute_scale_by_rows;
  if (c.empty()) return compute_scale;
  if (rows <= static_cast<double>(c.front().rows)) return c.front().scale;
  if (rows >= static_cast<double>(c.back().rows)) return c.back().scale;
  size_t above = 1;
  while (static_cast<double>(c[above].rows) < rows) ++above;
  const RowsScale &lo = c[above - 1], &hi = c[above];
  const double at = std::log(rows / static_cast<double>(lo.rows)) /
                    std::log(static_cast<double>(hi.rows) / static_cast<double>(lo.rows));
  return lo.scale + (hi.scale - lo.scale) * at;
}

double MachineProfile::busy_slowdown(double others) const {
  others = std::clamp(others, 0.0, 1.0);
  const std::vector<double>& c = slowdown_by_busy_ranks;
  if (c.size() < 2) return 1 + (all_busy_slowdown - 1) * others;
  const double at = others * static_cast<double>(c.size() - 1);  // index of the busy count
  const size_t below = std::min(static_cast<size_t>(at), c.size() - 2);
  return c[below] + (c[below + 1] - c[below]) * (at - static_cast<double>(below));
}

std::string profile_json_text(const MachineProfile& p) {
  nlohmann::json j;
  j["format"] = kFormat;
  j["version"] = kVersion;
  j["machine"] = p.machine;
  j["backend"] = p.backend;
  j["ranks"] = p.ranks;
  nlohmann::json linear = nlohmann::json::array();
  for (const LinearTiming& t : p.linear) {
    linear.push_back({{"rows", t.rows},
                      {"in", t.in},
                      {"out", t.out},
                      {"forward_us", t.forward_us},
                      {"input_grad_us", t.input_grad_us},
                      {"weight_grad_us", t.weight_grad_us}});
  }
  j["linear"] = linear;
  j["gemm_flops_per_s"] = p.gemm_flops_per_s;
  j["elementwise_bytes_per_s"] = p.elementwise_bytes_per_s;
  j["optimizer_params_per_s"] = p.optimizer_params_per_s;
  j["op_overhead_us"] = p.op_overhead_us;
  j["step_overhead_us"] = p.step_overhead_us;
  j["micro_batch_overhead_us"] = p.micro_batch_overhead_us;
  j["compute_scale"] = p.compute_scale;
  if (!p.compute_scale_by_rows.empty()) {
    nlohmann::json by_rows = nlohmann::json::array();
    for (const MachineProfile::RowsScale& r : p.compute_scale_by_rows) {
      by_rows.push_back({{"rows", r.rows}, {"scale", r.scale}});
    }
    j["compute_scale_by_rows"] = by_rows;
  }
  j["all_busy_slowdown"] = p.all_busy_slowdown;
  if (!p.slowdown_by_busy_ranks.empty()) j["slowdown_by_busy_ranks"] = p.slowdown_by_busy_ranks;
  j["p2p"] = link_json(p.p2p);
  j["all_reduce"] = link_json(p.all_reduce);
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

Result<MachineProfile> parse_profile_json(const std::string& text, const std::string& label) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::error(label + ": not a JSON object");
  if (!j.contains("format") || j["format"] != kFormat) {
    return Status::error(label + ": not a pipeshard profile (\"format\" is not \"" + kFormat + "\")");
  }
  if (!j.contains("version") || j["version"] != kVersion) {
    return Status::error(label + ": profile version " + (j.contains("version") ? j["version"].dump() : "missing") +
                         ", this build reads version " + std::to_string(kVersion));
  }
  MachineProfile p;
  Reader r(label);
  if (j.contains("machine")) {
    if (!j["machine"].is_string()) return r.bad("machine", "a string");
    p.machine = j["machine"].get<std::string>();
  }
  if (j.contains("backend")) {
    if (!j["backend"].is_string()) return r.bad("backend", "a string");
    p.backend = j["backend"].get<std::string>();
  }
  double ranks = p.ranks;
  if (Status s = r.number(j, "ranks", "", ranks, true); !s) return s;
  if (ranks != std::floor(ranks) || ranks > 1 << 20) return r.bad("ranks", "a whole number of processes");
  p.ranks = static_cast<int>(ranks);
  if (Status s = r.linear(j, p.linear); !s) return s;
  for (auto [key, field, positive] : {std::tuple{"gemm_flops_per_s", &p.gemm_flops_per_s, true},
                                      {"elementwise_bytes_per_s", &p.elementwise_bytes_per_s, true},
                                      {"optimizer_params_per_s", &p.optimizer_params_per_s, true},
                                      {"op_overhead_us", &p.op_overhead_us, false},
                                      {"step_overhead_us", &p.step_overhead_us, false},
                                      {"micro_batch_overhead_us", &p.micro_batch_overhead_us, false},
                                      {"compute_scale", &p.compute_scale, true},
                                      {"all_busy_slowdown", &p.all_busy_slowdown, true}}) {
    if (Status s = r.number(j, key, "", *field, positive); !s) return s;
  }
  if (p.all_busy_slowdown < 1) return r.bad("all_busy_slowdown", "1 or more");
  if (Status s = r.rows_scales(j, p.compute_scale_by_rows); !s) return s;
  if (j.contains("slowdown_by_busy_ranks")) {
    const nlohmann::json& c = j.at("slowdown_by_busy_ranks");
    const std::string what = "a list of " + std::to_string(p.ranks) + " numbers (one per rank), each 1 or more";
    if (!c.is_array() || c.size() != static_cast<size_t>(p.ranks)) return r.bad("slowdown_by_busy_ranks", what);
    for (const nlohmann::json& v : c) {
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 1) {
        return r.bad("slowdown_by_busy_ranks", what);
      }
      p.slowdown_by_busy_ranks.push_back(v.get<double>());
    }
    if (!j.contains("all_busy_slowdown")) p.all_busy_slowdown = p.slowdown_by_busy_ranks.back();
    if (std::abs(p.slowdown_by_busy_ranks.back() - p.all_busy_slowdown) > 1e-9 * p.all_busy_slowdown) {
      return r.bad("slowdown_by_busy_ranks", "a list that ends at all_busy_slowdown");
    }
  }
  if (Status s = r.link(j, "p2p", p.p2p); !s) return s;
  if (Status s = r.link(j, "all_reduce", p.all_reduce); !s) return s;
  return p;
}

Result<MachineProfile> read_profile_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": cannot be read");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::error(path + ": cannot be read");
  return parse_profile_json(text.str(), path);
}

}  // namespace pipeshard
