// Host-side records of real runs, for strata.emulator.trace(): when tracing
// is on, every rank's call of every op notes when it arrived and when the
// group's op completed for it, with the op's parameters (and, for MoE, the
// rank's routing) so the supernode model can time the same op afterwards.
// Off (the default), the runtime pays one relaxed atomic load per call.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "../algorithms/moe.h"
#include "../runtime/collective.h"
#include "../runtime/status.h"

namespace strata::model {

enum RecordKind : int32_t { kCollective = 0, kMoeDispatch = 1, kMoeCombine = 2, kMoeCombineBackward = 3 };

struct TraceRecord {
  RecordKind kind = kCollective;
  OpParams op;    // collectives
  MoeParams moe;  // MoE ops
  // The layout the runtime computed: pair_slot [T*K] of this rank (dispatch:
  // its output, read when the op completed; combine: its input).
  std::vector<int32_t> routing;
  int64_t run_id = 0, site_id = 0;
  int32_t group_id = 0, rank = 0, device = 0;
  double arrive_us = 0, end_us = 0;
  bool ok = false;
};

bool TraceEnabled();
void SetTraceEnabled(bool on);
double TraceNowUs();  // steady clock, the records' time base

using Done = std::function<void(const Status&)>;
// Notes the arrival now and returns `done` wrapped to note the end.
Done TraceCollective(const OpParams& p, const CallSite& c, Done done);
// `routing` (pair_slot, `routing_count` entries) is copied now, or when the op
// completes successfully if `read_at_end` (an output the op fills).
Done TraceMoe(RecordKind kind, const MoeParams& p, const CallSite& c, const int32_t* routing,
              int64_t routing_count, bool read_at_end, Done done);

// The completed records so far (removed from the log); at most kMaxRecords
// are kept, `dropped` counts the rest.
std::vector<TraceRecord> TakeTraceRecords(int64_t* dropped);

}  // namespace strata::model
