// FFI handlers of MoE dispatch/combine: decode shapes and attributes, check
// them, hand the call to the runtime (algorithms/moe.h). Asynchronous, like
// the collectives' handlers: each joins its group and returns a future at
// once, so it never holds one of XLA's threads while peers are on their way
// (held threads starve the computations those peers must finish first).
#include "moe_handlers.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "../algorithms/moe.h"
#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

using ffi_common::ToDType;

ffi::DataType WeightType(DType rows) {
  return MoeWeightDType(rows) == DType::F64 ? ffi::DataType::F64 : ffi::DataType::F32;
}

using ffi_common::CheckPool;
using ffi_common::Failed;
using ffi_common::Invalid;

bool HasDims(ffi::AnyBuffer::Dimensions d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

std::string Shape(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

MoeCall MakeCall(int32_t device, ffi::RunId run, ffi::Buffer<ffi::S32> meta, int64_t site_id,
                 int64_t timeout_ms, const ffi_common::SiteInstance* instance) {
  return ffi_common::DecodeCallSite(device, run, meta, site_id, timeout_ms, instance);
}

constexpr const char* kDispatch = "strata.moe.dispatch";
constexpr const char* kCombine = "strata.moe.combine";
constexpr const char* kCombineBackward = "strata.moe.combine (backward)";  // as algorithms/moe.cc names it

ffi::Future DispatchImpl(int32_t device, ffi::RunId run, ffi::ThreadPool pool, ffi_common::SiteInstance* instance, ffi::AnyBuffer x,
                        ffi::AnyBuffer topk_idx, ffi::Buffer<ffi::S32> meta,
                        ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::Buffer<ffi::S32>> pair_slot,
                        ffi::Result<ffi::Buffer<ffi::S32>> slot_source,
                        ffi::Result<ffi::Buffer<ffi::S32>> recv_counts,
                        ffi::Result<ffi::Buffer<ffi::S32>> dropped, int64_t site_id,
                        int32_t group_size, int32_t num_devices, int32_t num_experts,
                        int64_t capacity, int32_t cores, int32_t engines, int32_t mode,
                        int32_t planner, int64_t comm_buffer_bytes, int64_t timeout_ms) {
  if (auto err = CheckPool(kDispatch, pool, num_devices)) return Failed(std::move(*err));
  if (planner < 0 || planner >= kPlannerCount)
    return Failed(Invalid(kDispatch, "planner code " + std::to_string(planner) + " is not one of strata's"));
  std::optional<DType> dtype = ToDType(x.element_type());
  if (!dtype) return Failed(Invalid(kDispatch, "unsupported token dtype"));
  if (meta.element_count() != 2) return Failed(Invalid(kDispatch, "rank operand must hold (rank, group)"));
  if (group_size < 1 || num_experts < 1 || num_experts % group_size != 0)
    return Failed(Invalid(kDispatch, "num_experts must be a positive multiple of the group size"));
  ExpertIds ids;
  ids.data = topk_idx.untyped_data();
  switch (topk_idx.element_type()) {
    case ffi::DataType::S32: ids.dtype = DType::S32; break;
    case ffi::DataType::S64: ids.dtype = DType::S64; break;
    case ffi::DataType::U32: ids.dtype = DType::U32; break;
    case ffi::DataType::U8: ids.dtype = DType::U8; break;
    default: return Failed(Invalid(kDispatch, "topk_idx must be int32, int64, uint32 or uint8"));
  }
  auto xd = x.dimensions();
  auto id = topk_idx.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0])
    return Failed(Invalid(kDispatch, "x must be [T, H] and topk_idx [T, K], got " + Shape(xd) +
                                         " and " + Shape(id)));
  MoeParams p;
  p.group_size = group_size;
  p.num_experts = num_experts;
  p.capacity = capacity;
  p.tokens = xd[0];
  p.hidden = xd[1];
  p.topk = id[1];
  p.dtype = *dtype;
  p.cores = cores;
  p.engines = engines;
  p.mode = static_cast<Mode>(mode);
  p.planner = static_cast<Planner>(planner);
  p.comm_buffer_bytes = comm_buffer_bytes;
  const int64_t el = p.local_experts();
  if (recv_x->element_type() != x.element_type() ||
      !HasDims(recv_x->dimensions(), {el, capacity, p.hidden}) ||
      !HasDims(pair_slot->dimensions(), {p.tokens, p.topk}) ||
      !HasDims(slot_source->dimensions(), {el, capacity}) ||
      !HasDims(recv_counts->dimensions(), {el}) || dropped->element_count() != 1)
    return Failed(Invalid(kDispatch, "result shapes do not match the operands"));
  ffi_common::Handoff handoff({x.untyped_data(), ids.data},
                              {recv_x->untyped_data(), pair_slot->untyped_data(), slot_source->untyped_data(),
                               recv_counts->untyped_data(), dropped->untyped_data()});
  MoeDispatchAsync(p, MakeCall(device, run, meta, site_id, timeout_ms, instance), x.untyped_data(),
                   ids, recv_x->untyped_data(), pair_slot->typed_data(),
                   slot_source->typed_data(), recv_counts->typed_data(), dropped->typed_data(),
                   handoff.Completion());
  return handoff.Result();
}

// Fills the params a combine-family call shares, from expert_y [E_local, C, H]
// and the pair slots [T, K].
std::optional<ffi::Error> CombineParams(const char* op, ffi::AnyBuffer expert_y,
                                        ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> pair_slot,
                                        ffi::Buffer<ffi::S32> meta, int32_t group_size,
                                        int32_t cores, int32_t engines, int32_t mode,
                                        int64_t comm_buffer_bytes, MoeParams* p) {
  std::optional<DType> dtype = ToDType(expert_y.element_type());
  if (!dtype || !MoeSupportsCombine(*dtype))
    return Invalid(op, "expert rows must be float32, float64, float16 or bfloat16");
  if (meta.element_count() != 2) return Invalid(op, "rank operand must hold (rank, group)");
  auto ed = expert_y.dimensions();
  auto sd = pair_slot.dimensions();
  if (ed.size() != 3 || sd.size() != 2)
    return Invalid(op, "expert_y must be [E_local, C, H] and the slots [T, K], got " + Shape(ed) +
                           " and " + Shape(sd));
  if (group_size < 1) return Invalid(op, "group_size must be positive");
  if (weights.element_type() != WeightType(*dtype) || !HasDims(weights.dimensions(), {sd[0], sd[1]}))
    return Invalid(op, "weights must be [T, K] of the accumulation type");
  p->group_size = group_size;
  p->num_experts = static_cast<int32_t>(ed[0] * group_size);
  p->capacity = ed[1];
  p->hidden = ed[2];
  p->tokens = sd[0];
  p->topk = sd[1];
  p->dtype = *dtype;
  p->cores = cores;
  p->engines = engines;
  p->mode = static_cast<Mode>(mode);
  p->comm_buffer_bytes = comm_buffer_bytes;
  return std::nullopt;
}

ffi::Future CombineImpl(int32_t device, ffi::RunId run, ffi::ThreadPool pool, ffi_common::SiteInstance* instance,
                       ffi::AnyBuffer expert_y, ffi::AnyBuffer weights,
                       ffi::Buffer<ffi::S32> pair_slot, ffi::Buffer<ffi::S32> meta,
                       ffi::Result<ffi::AnyBuffer> y, int64_t site_id, int32_t group_size,
                       int32_t num_devices, int32_t cores, int32_t engines, int32_t mode,
                        int64_t comm_buffer_bytes, int64_t timeout_ms) {
  if (auto err = CheckPool(kCombine, pool, num_devices)) return Failed(std::move(*err));
  MoeParams p;
  if (auto err = CombineParams(kCombine, expert_y, weights, pair_slot, meta, group_size, cores,
                               engines, mode, comm_buffer_bytes, &p))
    return Failed(std::move(*err));
  if (y->element_type() != expert_y.element_type() || !HasDims(y->dimensions(), {p.tokens, p.hidden}))
    return Failed(Invalid(kCombine, "y must be [T, H] of expert_y's dtype"));
  ffi_common::Handoff handoff({expert_y.untyped_data(), weights.untyped_data(), pair_slot.untyped_data()},
                              {y->untyped_data()});
  MoeCombineAsync(p, MakeCall(device, run, meta, site_id, timeout_ms, instance), expert_y.untyped_data(),
                  weights.untyped_data(), pair_slot.typed_data(), y->untyped_data(),
                  handoff.Completion());
  return handoff.Result();
}

ffi::Future CombineBackwardImpl(int32_t device, ffi::RunId run, ffi::ThreadPool pool, ffi_common::SiteInstance* instance,
                               ffi::AnyBuffer ct_y, ffi::AnyBuffer expert_y, ffi::AnyBuffer weights,
                               ffi::Buffer<ffi::S32> pair_slot, ffi::Buffer<ffi::S32> slot_source,
                               ffi::Buffer<ffi::S32> meta, ffi::Result<ffi::AnyBuffer> d_expert_y,
                               ffi::Result<ffi::AnyBuffer> d_weights, int64_t site_id,
                               int32_t group_size, int32_t num_devices, int32_t cores,
                               int32_t engines, int32_t mode, int64_t comm_buffer_bytes,
                               int64_t timeout_ms) {
  if (auto err = CheckPool(kCombineBackward, pool, num_devices)) return Failed(std::move(*err));
  MoeParams p;
  if (auto err = CombineParams(kCombineBackward, expert_y, weights, pair_slot, meta, group_size, cores,
                               engines, mode, comm_buffer_bytes, &p))
    return Failed(std::move(*err));
  const int64_t el = p.local_experts();
  if (ct_y.element_type() != expert_y.element_type() ||
      !HasDims(ct_y.dimensions(), {p.tokens, p.hidden}) ||
      !HasDims(slot_source.dimensions(), {el, p.capacity}) ||
      d_expert_y->element_type() != expert_y.element_type() ||
      !HasDims(d_expert_y->dimensions(), {el, p.capacity, p.hidden}) ||
      d_weights->element_type() != weights.element_type() ||
      !HasDims(d_weights->dimensions(), {p.tokens, p.topk}))
    return Failed(Invalid(kCombineBackward, "backward operand shapes do not match"));
  ffi_common::Handoff handoff({ct_y.untyped_data(), expert_y.untyped_data(), weights.untyped_data(),
                               pair_slot.untyped_data(), slot_source.untyped_data()},
                              {d_expert_y->untyped_data(), d_weights->untyped_data()});
  MoeCombineBackwardAsync(p, MakeCall(device, run, meta, site_id, timeout_ms, instance),
                          ct_y.untyped_data(), expert_y.untyped_data(), weights.untyped_data(),
                          pair_slot.typed_data(), slot_source.typed_data(),
                          d_expert_y->untyped_data(), d_weights->untyped_data(), handoff.Completion());
  return handoff.Result();
}

}  // namespace
}  // namespace strata

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataMoeDispatch, strata::DispatchImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ctx<ffi::State<strata::ffi_common::SiteInstance>>()
                                  .Arg<ffi::AnyBuffer>()           // x [T, H]
                                  .Arg<ffi::AnyBuffer>()           // topk_idx [T, K], int32/int64/uint32/uint8
                                  .Arg<ffi::Buffer<ffi::S32>>()    // (rank, group)
                                  .Ret<ffi::AnyBuffer>()           // recv_x [E_local, C, H]
                                  .Ret<ffi::Buffer<ffi::S32>>()    // pair_slot [T, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()    // slot_source [E_local, C]
                                  .Ret<ffi::Buffer<ffi::S32>>()    // recv_counts [E_local]
                                  .Ret<ffi::Buffer<ffi::S32>>()    // dropped []
                                  .Attr<int64_t>("site_id")
                                  .Attr<int32_t>("group_size")
                                  .Attr<int32_t>("num_devices")
                                  .Attr<int32_t>("num_experts")
                                  .Attr<int64_t>("capacity")
                                  .Attr<int32_t>("cores")
                                  .Attr<int32_t>("engines")
                                  .Attr<int32_t>("mode")
                                  .Attr<int32_t>("planner")
                                  .Attr<int64_t>("comm_buffer_bytes")
                                  .Attr<int64_t>("timeout_ms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataMoeCombine, strata::CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ctx<ffi::State<strata::ffi_common::SiteInstance>>()
                                  .Arg<ffi::AnyBuffer>()           // expert_y [E_local, C, H]
                                  .Arg<ffi::AnyBuffer>()           // weights [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // pair_slot [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // (rank, group)
                                  .Ret<ffi::AnyBuffer>()           // y [T, H]
                                  .Attr<int64_t>("site_id")
                                  .Attr<int32_t>("group_size")
                                  .Attr<int32_t>("num_devices")
                                  .Attr<int32_t>("cores")
                                  .Attr<int32_t>("engines")
                                  .Attr<int32_t>("mode")
                                  .Attr<int64_t>("comm_buffer_bytes")
                                  .Attr<int64_t>("timeout_ms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataMoeCombineBackward, strata::CombineBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ctx<ffi::State<strata::ffi_common::SiteInstance>>()
                                  .Arg<ffi::AnyBuffer>()           // ct_y [T, H]
                                  .Arg<ffi::AnyBuffer>()           // expert_y [E_local, C, H]
                                  .Arg<ffi::AnyBuffer>()           // weights [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // pair_slot [T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // slot_source [E_local, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // (rank, group)
                                  .Ret<ffi::AnyBuffer>()           // d_expert_y
                                  .Ret<ffi::AnyBuffer>()           // d_weights
                                  .Attr<int64_t>("site_id")
                                  .Attr<int32_t>("group_size")
                                  .Attr<int32_t>("num_devices")
                                  .Attr<int32_t>("cores")
                                  .Attr<int32_t>("engines")
                                  .Attr<int32_t>("mode")
                                  .Attr<int64_t>("comm_buffer_bytes")
                                  .Attr<int64_t>("timeout_ms"));
