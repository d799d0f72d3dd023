#include "trace_log.h"

#include <chrono>
#include <memory>
#include <mutex>

namespace strata::model {

namespace {

constexpr size_t kMaxRecords = 1 << 20;

// Never destroyed: completions may run on detached threads at exit.
std::mutex& g_mu = *new std::mutex;
std::vector<TraceRecord>& g_records = *new std::vector<TraceRecord>;
int64_t g_dropped = 0;

OpDone Wrap(std::shared_ptr<TraceRecord> rec, OpDone done, const int32_t* read_at_end = nullptr,
            int64_t count = 0) {
  return [rec = std::move(rec), done = std::move(done), read_at_end, count](const Status& st) {
    rec->end_us = TraceNowUs();
    rec->ok = st.ok;
    // Outputs are written and still ours until `done` hands them back to XLA.
    if (st.ok && read_at_end && count > 0) rec->routing.assign(read_at_end, read_at_end + count);
    {
      std::lock_guard<std::mutex> lock(g_mu);
      if (g_records.size() < kMaxRecords) g_records.push_back(std::move(*rec));
      else g_dropped++;
    }
    done(st);
  };
}

std::shared_ptr<TraceRecord> Begin(ObservedOp kind, const CallSite& c) {
  auto rec = std::make_shared<TraceRecord>();
  rec->kind = kind;
  rec->run_id = c.run_id;
  rec->site_id = c.site_id;
  rec->group_id = c.group_id;
  rec->rank = c.rank;
  rec->device = c.device;
  rec->arrive_us = TraceNowUs();
  return rec;
}

class Log final : public OpObserver {
 public:
  OpDone OnCollective(const OpParams& p, const CallSite& c, OpDone done) override {
    auto rec = Begin(ObservedOp::kCollective, c);
    rec->op = p;
    return Wrap(std::move(rec), std::move(done));
  }

  OpDone OnMoe(ObservedOp kind, const MoeOpShape& p, const CallSite& c, const int32_t* routing,
               int64_t routing_count, bool read_at_end, OpDone done) override {
    auto rec = Begin(kind, c);
    rec->moe = p;
    if (read_at_end) return Wrap(std::move(rec), std::move(done), routing, routing_count);
    if (routing && routing_count > 0) rec->routing.assign(routing, routing + routing_count);
    return Wrap(std::move(rec), std::move(done));
  }

  OpDone OnRagged(const OpParams& p, RaggedRankSizes sizes, const CallSite& c, OpDone done) override {
    auto rec = Begin(ObservedOp::kRaggedAllToAll, c);
    rec->op = p;
    rec->ragged = std::move(sizes);
    return Wrap(std::move(rec), std::move(done));
  }
};

}  // namespace

OpObserver* TraceLog() {
  static Log* log = new Log;
  return log;
}

double TraceNowUs() {
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

std::vector<TraceRecord> TakeTraceRecords(int64_t* dropped) {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<TraceRecord> out;
  out.swap(g_records);
  if (dropped) *dropped = g_dropped;
  g_dropped = 0;
  return out;
}

}  // namespace strata::model
