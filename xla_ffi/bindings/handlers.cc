// Thin FFI handlers: decode the call, validate it, hand it to the runtime.
// Every collective shares one binding; the template argument picks the op's
// registry entry (algorithms/op_registry.h), and one handler exists per entry.
#include "handlers.h"

#include <array>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "../algorithms/op_registry.h"
#include "../runtime/collective.h"
#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

using ffi_common::CheckPool;
using ffi_common::Failed;
using ffi_common::ToDType;

ffi::Future Invalid(OpKind kind, const std::string& why) {
  return Failed(ffi_common::Invalid(Collective(kind).builder.name, why));
}

// The static attributes, packed into one "params" array in this order by
// stratacl_jax/_ffi.py (XLA decodes each attribute by name on every call).
enum CollectiveParam : size_t {
  kReduceOp, kRoot, kGroupSize, kNumDevices, kBlockBytes, kMode, kCores, kEngines, kPlanner,
  kCommBufferBytes, kTimeoutMs, kParamCount
};

// Asynchronous: the handler joins its group and returns a future, so it never
// holds one of XLA's threads while peers are still on their way (held threads
// starve the computations those peers must finish first); see Handoff.
template <OpKind kKind>
ffi::Future CollectiveImpl(int32_t device, ffi::RunId run, ffi::ThreadPool pool,
                          ffi_common::SiteInstance* instance, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> meta,
                          ffi::Result<ffi::AnyBuffer> out, int64_t site_id,
                          ffi::Span<const int32_t> perm, ffi::Span<const int64_t> params) {
  if (params.size() != kParamCount)
    return Invalid(kKind, "params holds " + std::to_string(params.size()) + " values, not " +
                              std::to_string(kParamCount) + " (a program lowered by another version?)");
  const int32_t reduce_op = static_cast<int32_t>(params[kReduceOp]);
  const int32_t root = static_cast<int32_t>(params[kRoot]);
  const int32_t group_size = static_cast<int32_t>(params[kGroupSize]);
  const int32_t num_devices = static_cast<int32_t>(params[kNumDevices]);
  const int64_t block_bytes = params[kBlockBytes];
  const int64_t timeout_ms = params[kTimeoutMs];
  const CollectiveDef& def = Collective(kKind);
  if (auto err = CheckPool(def.builder.name, pool, num_devices)) return Failed(std::move(*err));
  std::optional<DType> dtype = ToDType(x.element_type());
  if (!dtype) return Invalid(kKind, "unsupported element type");
  if (x.element_type() != out->element_type()) return Invalid(kKind, "input and output dtypes differ");
  if (meta.element_count() != 2) return Invalid(kKind, "rank operand must hold (rank, group)");
  if (group_size < 1) return Invalid(kKind, "group_size must be positive");
  if (IsComplex(*dtype) && (reduce_op == static_cast<int32_t>(ReduceOp::kMax) ||
                            reduce_op == static_cast<int32_t>(ReduceOp::kMin)))
    return Invalid(kKind, "complex numbers have no max or min");

  OpParams p;
  p.builder = &def.builder;
  p.dtype = *dtype;
  p.op = static_cast<ReduceOp>(reduce_op);
  p.root = root;
  p.perm.assign(perm.begin(), perm.end());
  p.group_size = group_size;
  p.in_blocks = def.InBlocks(group_size);
  p.out_blocks = def.OutBlocks(group_size);
  p.block_bytes = block_bytes;
  p.mode = static_cast<Mode>(params[kMode]);
  p.cores = static_cast<int32_t>(params[kCores]);
  p.engines = static_cast<int32_t>(params[kEngines]);
  p.planner = static_cast<Planner>(params[kPlanner]);
  p.comm_buffer_bytes = params[kCommBufferBytes];

  const int64_t in_bytes = static_cast<int64_t>(x.size_bytes());
  const int64_t out_bytes = static_cast<int64_t>(out->size_bytes());
  const int64_t in_row = p.in_blocks * block_bytes;
  p.rows = in_row > 0 ? in_bytes / in_row : 1;
  if (in_row > 0 && (in_bytes % in_row != 0 || out_bytes != p.rows * p.out_blocks * block_bytes))
    return Invalid(kKind, "buffer sizes " + std::to_string(in_bytes) + " -> " +
                              std::to_string(out_bytes) + " do not fit block_bytes " +
                              std::to_string(block_bytes));
  if (in_row == 0) return ffi_common::Ready();  // nothing to move on any rank

  RankCall c;
  static_cast<CallSite&>(c) = ffi_common::DecodeCallSite(device, run, meta, site_id, timeout_ms, instance);
  c.in = x.untyped_data();
  c.out = out->untyped_data();
  ffi_common::Handoff handoff({c.in}, {c.out});
  RunCollectiveAsync(p, c, handoff.Completion());
  return handoff.Result();
}

}  // namespace

namespace ffi_common {
ffi::ErrorOr<std::unique_ptr<SiteInstance>> NewSiteInstance() {
  static std::atomic<int64_t> next{int64_t{1} << 40};  // apart from trace-time site ids
  auto instance = std::make_unique<SiteInstance>();
  instance->instance.store(next++, std::memory_order_release);
  return instance;
}

const XLA_FFI_TypeInfo* SiteInstanceTypeInfo() {
  static const XLA_FFI_TypeInfo info = {
      XLA_FFI_TypeInfo_STRUCT_SIZE, nullptr,
      [](void* object) { delete static_cast<SiteInstance*>(object); }};
  return &info;
}
}  // namespace ffi_common
}  // namespace strata

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataSiteInstantiate, strata::ffi_common::NewSiteInstance,
                              ffi::Ffi::BindInstantiate());

namespace strata {
namespace {

// One handler per op: XLA binds each once, on its first call.
template <OpKind kKind>
XLA_FFI_Error* CollectiveHandlerOf(XLA_FFI_CallFrame* call_frame) {
  static auto* handler = ffi::Ffi::Bind()
                             .Ctx<ffi::DeviceOrdinal>()
                             .Ctx<ffi::RunId>()
                             .Ctx<ffi::ThreadPool>()
                             .Ctx<ffi::State<ffi_common::SiteInstance>>()
                             .Arg<ffi::AnyBuffer>()
                             .Arg<ffi::Buffer<ffi::S32>>()
                             .Ret<ffi::AnyBuffer>()
                             .Attr<int64_t>("site_id")
                             .Attr<ffi::Span<const int32_t>>("perm")
                             .Attr<ffi::Span<const int64_t>>("params")
                             .To(CollectiveImpl<kKind>)
                             .release();
  return handler->Call(call_frame);
}

template <size_t... kKinds>
constexpr std::array<XLA_FFI_Handler*, sizeof...(kKinds)> HandlerTable(std::index_sequence<kKinds...>) {
  return {&CollectiveHandlerOf<static_cast<OpKind>(kKinds)>...};
}

}  // namespace

XLA_FFI_Handler* CollectiveHandler(OpKind kind) {
  static constexpr auto handlers = HandlerTable(std::make_index_sequence<kFixedPlanOpCount>());
  return handlers[static_cast<size_t>(kind)];
}

}  // namespace strata
