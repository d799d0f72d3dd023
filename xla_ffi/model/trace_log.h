// Host-side records of real runs, for strata.emulator.trace(): installed as
// the runtime's observer (runtime/observer.h), it notes for every rank's call
// of every op when it arrived and when the group's op completed for it, with
// the op's parameters (and, for MoE, the rank's routing; for a ragged
// exchange, its sizes) so the supernode model can time the same op afterwards.
#pragma once
#include <cstdint>
#include <vector>

#include "../runtime/collective.h"
#include "../runtime/observer.h"

namespace strata::model {

struct TraceRecord {
  ObservedOp kind = ObservedOp::kCollective;
  OpParams op;     // collectives and ragged_all_to_all
  MoeOpShape moe;  // MoE ops
  RaggedRankSizes ragged;  // ragged_all_to_all: this rank's sizes
  // The layout the runtime computed: pair_slot [T*K] of this rank (dispatch:
  // its output, read when the op completed; combine: its input).
  std::vector<int32_t> routing;
  int64_t run_id = 0, site_id = 0;
  int32_t group_id = 0, rank = 0, device = 0;
  double arrive_us = 0, end_us = 0;
  bool ok = false;
};

// The trace log as an observer: install it (SetObserver) to record, remove it
// to stop. Never destroyed (completions may run on detached threads at exit).
OpObserver* TraceLog();
double TraceNowUs();  // steady clock, the records' time base

// The completed records so far (removed from the log); at most kMaxRecords
// are kept, `dropped` counts the rest.
std::vector<TraceRecord> TakeTraceRecords(int64_t* dropped);

}  // namespace strata::model
