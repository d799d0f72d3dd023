// An MoE op's shape as every rank of its group agrees on it. Here, below both
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
  // How a plan's work is split over lanes (strata.config(planner=)): every
  // MoE op's plans honour it.
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

}  // namespace strata
