// MoE expert parallelism: token dispatch to the ranks that own the experts,
// and the weighted combine back. E experts are spread evenly over the group
// (rank r owns experts [r*E_local, (r+1)*E_local)); each local expert has
// `capacity` rows. The layout is computed from every rank's routing when the
// group meets; the rows then move between user buffers as a job of the host
// worker pool (runtime/executor.h), by DeepEP's traffic rule: a token crosses
// to a rank once, however many of its experts live there (into the row of
// its pair with the lowest k on that rank), and is copied to its other rows
// there; combine sums a token's rows on their rank and one row crosses back.
//
// Layout encodings shared by the ops (all int32):
//   pair_slot[t*K+k]  (source side) = e*capacity + row, the global slot of
//                     the pair (t, k) routed to expert e, or -1 if dropped.
//                     The owning rank is e / E_local.
//   slot_source[l*capacity+row] (expert side) = (src*T + t)*K + k, the pair
//                     that filled that row of local expert l, or -1.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "../runtime/collective.h"
#include "../runtime/dtypes.h"
#include "../runtime/moe_shape.h"
#include "../runtime/observer.h"
#include "../runtime/rendezvous.h"
#include "../runtime/status.h"

namespace strata {

// What the op is; identical on every rank (checked when the group meets).
// The fields are the shape an observer records (runtime/moe_shape.h).
struct MoeParams : MoeOpShape {
  std::string Describe(const char* opname) const;
  Signature Sign(const char* opname) const;  // compared at rendezvous; Describe on mismatch
};

// Who is calling (rank, group, call site, run), as for the collectives.
using MoeCall = CallSite;

// Below this many bytes moved by the whole group (one worker task's worth,
// kTaskBytes), the last rank in runs an MoE op on the spot.
constexpr int64_t kMoeInlineGroupBytes = 256 << 10;

// Weights and their gradients are float64 for float64 rows, float32 otherwise.
DType MoeWeightDType(DType rows);
bool MoeSupportsCombine(DType rows);

// The ops are asynchronous: a call joins its group and returns at once, never
// waiting for a peer; `done` is called exactly once, when the op has
// completed on every rank of the group (its outputs are then written), or
// with the error every rank gets. The caller's buffers must stay valid until
// then.
using MoeDone = std::function<void(const Status&)>;

// x [T, H], topk_idx [T, K] -> recv_x [E_local, C, H] (rows past the count
// zeroed), pair_slot [T, K], slot_source [E_local, C], recv_counts [E_local],
// dropped (pairs of this rank that found their expert full).
// Expert ids as the user gave them: any integer width, so an id that int32
// cannot hold is reported as given, not as what a cast made of it.
struct ExpertIds {
  const void* data = nullptr;
  DType dtype = DType::S32;  // S32, S64, U32 or U8 (anything else is cast to S32 before)
  int64_t At(int64_t i) const;
};

void MoeDispatchAsync(const MoeParams& p, const MoeCall& c, const void* x, ExpertIds topk_idx,
                      void* recv_x, int32_t* pair_slot, int32_t* slot_source, int32_t* recv_counts,
                      int32_t* dropped, MoeDone done);

// y[t] = sum_k weights[t, k] * expert_y[slot of (t, k)], dropped pairs adding 0,
// in a fixed order (accumulation type, from zero): per rank holding t's
// pairs, ascending, w * row if it holds one of them, else the sum of its
// pairs' w * row in k order rounded to the rows' dtype; then rounded into y.
// Layout operands (pair_slot, slot_source) come from a DispatchHandle the
// user may have changed: every value is checked before it indexes a buffer,
// and one out of range is an error naming the op, the rank and the value.
void MoeCombineAsync(const MoeParams& p, const MoeCall& c, const void* expert_y,
                     const void* weights, const int32_t* pair_slot, void* y, MoeDone done);

// The VJP of combine for the cotangent ct_y [T, H]:
//   d_expert_y[slot] = weights[t, k] * ct_y[t]  (zero rows for empty slots),
//   d_weights[t, k]  = <ct_y[t], expert_y[slot of (t, k)]>  (0 if dropped).
void MoeCombineBackwardAsync(const MoeParams& p, const MoeCall& c, const void* ct_y,
                             const void* expert_y, const void* weights, const int32_t* pair_slot,
                             const int32_t* slot_source, void* d_expert_y, void* d_weights,
                             MoeDone done);

}  // namespace strata
