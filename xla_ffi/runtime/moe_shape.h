// An MoE op's shape as every rank of its group agrees on it, and the two
// rules the runtime's MoE work and the supernode model must share: the size
// of a work unit and which lanes dispatch's rows move on. Here, below both
// algorithms/moe.h (whose MoeParams extends the shape) and model/, so the
// model times MoE without reaching up into the algorithms.
#pragma once
#include <cstdint>

#include "collective.h"
#include "dtypes.h"

namespace strata {

// The fields an observer records (observer.h) to time the op again.
struct MoeOpShape {
  int32_t group_size = 1;
  int32_t num_experts = 1;
  int64_t capacity = 0;
  int64_t tokens = 0, topk = 0, hidden = 0;  // per rank
  DType dtype = DType::F32;                   // token / expert rows
  // How a plan's work is split over lanes (strata.config(planner=)): MoE
  // dispatch's plan honours it; combine's engine has its own split.
  Planner planner = Planner::kBalanced;
  int32_t cores = 1, engines = 1;
  // kBufferCentric: the vendor-library baseline. Rows peers read are first
  // copied into this rank's communication buffer, results are written to one
  // and copied out (each at most comm_buffer_bytes).
  Mode mode = Mode::kStrata;
  int64_t comm_buffer_bytes = 200 << 20;

  int64_t local_experts() const { return num_experts / group_size; }
  int64_t row_bytes() const { return hidden * static_cast<int64_t>(DTypeSize(dtype)); }
};

// The MoE work unit: about this many bytes per task, small enough to spread
// over the host workers and lanes, large enough that claiming tasks is not
// contended. The model times the same tasks.
inline constexpr int64_t kMoeTaskBytes = 256 << 10;

// Whether the hand-written model's dispatch tasks (model.cc MoeProgram, no
// longer reached: dispatch is a plan, on PlanJob's lanes) run on the SDMA
// engines or the vector cores: the collectives' rule (collective.h,
// MovesOnSdma) over the rank's bytes (its tokens in, its experts' slots out).
inline bool MoeDispatchOnSdma(int64_t tokens, int64_t row_bytes, int64_t local_slots, int engines,
                              double descriptor_us = kSdmaDescriptorUs, double sdma_gbps = kSdmaGbps) {
  return MovesOnSdma((tokens + local_slots) * row_bytes, engines, descriptor_us, sdma_gbps);
}

}  // namespace strata
