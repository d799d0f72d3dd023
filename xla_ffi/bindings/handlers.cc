// Thin FFI handlers: decode the call, validate it, hand it to the runtime.
// Every collective shares one binding; the template argument picks the op.
#include "handlers.h"

#include <algorithm>
#include <optional>
#include <string>

#include "../algorithms/algorithms.h"
#include "../runtime/collective.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

std::optional<DType> ToDType(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::F32;
    case ffi::DataType::F64: return DType::F64;
    case ffi::DataType::F16: return DType::F16;
    case ffi::DataType::BF16: return DType::BF16;
    case ffi::DataType::S8: return DType::S8;
    case ffi::DataType::S32: return DType::S32;
    case ffi::DataType::S64: return DType::S64;
    case ffi::DataType::U8: return DType::U8;
    case ffi::DataType::U32: return DType::U32;
    case ffi::DataType::PRED: return DType::PRED;
    default: return std::nullopt;
  }
}

ffi::Future Failed(ffi::ErrorCode code, std::string why) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi::Error(code, std::move(why)));
  return future;
}

ffi::Future Invalid(OpKind kind, const std::string& why) {
  return Failed(ffi::ErrorCode::kInvalidArgument, std::string(OpName(kind)) + ": " + why);
}

// Asynchronous: the handler joins its group and returns a future at once, so
// it never holds one of XLA's threads while peers are still on their way
// (held threads starve the computations those peers must finish first).
template <OpKind kKind>
ffi::Future CollectiveImpl(int32_t device, ffi::RunId run, ffi::ThreadPool pool,
                          ffi::AnyBuffer x, ffi::Buffer<ffi::S32> meta,
                          ffi::Result<ffi::AnyBuffer> out, int64_t site_id, int32_t reduce_op,
                          int32_t root, ffi::Span<const int32_t> perm, int32_t group_size,
                          int32_t num_devices, int64_t block_bytes, int32_t mode, int32_t cores,
                          int32_t engines, int32_t planner, int64_t comm_buffer_bytes,
                          int64_t timeout_ms) {
  // XLA:CPU deadlocks itself when its client pool has fewer than two threads
  // per device (a blocked launch holds the threads a running collective
  // needs); refuse before we could be part of that. The pool size the FFI
  // reports saturates at 256, so beyond 128 devices this check can only see
  // that much; the Python layer sizes the real pool (PJRT_NPROC) regardless.
  constexpr int64_t kReportedPoolCap = 256;
  const int64_t threads = pool.num_threads();
  const int64_t needed = 2 * static_cast<int64_t>(num_devices);
  if (threads < std::min(needed, kReportedPoolCap)) {
    return Failed(
        ffi::ErrorCode::kFailedPrecondition,
        std::string(OpName(kKind)) + ": XLA:CPU's client thread pool has " +
            std::to_string(threads) + " threads, but a program on " +
            std::to_string(num_devices) + " devices needs at least " + std::to_string(needed) +
            " or XLA can hang. Set PJRT_NPROC=" + std::to_string(needed) +
            " (or more) before JAX starts; importing stratacl_jax before the first JAX "
            "computation does this for you.");
  }
  std::optional<DType> dtype = ToDType(x.element_type());
  if (!dtype) return Invalid(kKind, "unsupported element type");
  if (x.element_type() != out->element_type()) return Invalid(kKind, "input and output dtypes differ");
  if (meta.element_count() != 2) return Invalid(kKind, "rank operand must hold (rank, group)");
  if (group_size < 1) return Invalid(kKind, "group_size must be positive");

  OpParams p;
  p.kind = kKind;
  p.dtype = *dtype;
  p.op = static_cast<ReduceOp>(reduce_op);
  p.root = root;
  p.perm.assign(perm.begin(), perm.end());
  p.group_size = group_size;
  BlockCounts(kKind, group_size, &p.in_blocks, &p.out_blocks);
  p.block_bytes = block_bytes;
  p.mode = static_cast<Mode>(mode);
  p.cores = cores;
  p.engines = engines;
  p.planner = static_cast<Planner>(planner);
  p.comm_buffer_bytes = comm_buffer_bytes;

  const int64_t in_bytes = static_cast<int64_t>(x.size_bytes());
  const int64_t out_bytes = static_cast<int64_t>(out->size_bytes());
  const int64_t in_row = p.in_blocks * block_bytes;
  p.rows = in_row > 0 ? in_bytes / in_row : 1;
  if (in_row > 0 && (in_bytes % in_row != 0 || out_bytes != p.rows * p.out_blocks * block_bytes))
    return Invalid(kKind, "buffer sizes " + std::to_string(in_bytes) + " -> " +
                              std::to_string(out_bytes) + " do not fit block_bytes " +
                              std::to_string(block_bytes));
  if (in_row == 0) {  // nothing to move on any rank
    ffi::Promise promise;
    ffi::Future future(promise);
    promise.SetAvailable();
    return future;
  }

  RankCall c;
  c.run_id = run.run_id;
  c.site_id = site_id;
  c.rank = meta.typed_data()[0];
  c.group_id = meta.typed_data()[1];
  c.device = device;
  c.in = x.untyped_data();
  c.out = out->untyped_data();
  c.timeout_s = static_cast<double>(timeout_ms) / 1000.0;
  ffi::Promise promise;
  ffi::Future future(promise);
  RunCollectiveAsync(p, c, [promise](const Status& st) mutable {
    if (st.ok) {
      promise.SetAvailable();
    } else {
      promise.SetError(ffi::Error(ffi::ErrorCode::kAborted, st.message));
    }
  });
  return future;
}

}  // namespace
}  // namespace strata

#define STRATA_DEFINE_COLLECTIVE(symbol, kind)                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, strata::CollectiveImpl<kind>, \
                                ffi::Ffi::Bind()                      \
                                    .Ctx<ffi::DeviceOrdinal>()        \
                                    .Ctx<ffi::RunId>()                \
                                    .Ctx<ffi::ThreadPool>()           \
                                    .Arg<ffi::AnyBuffer>()            \
                                    .Arg<ffi::Buffer<ffi::S32>>()     \
                                    .Ret<ffi::AnyBuffer>()            \
                                    .Attr<int64_t>("site_id")         \
                                    .Attr<int32_t>("reduce_op")       \
                                    .Attr<int32_t>("root")            \
                                    .Attr<ffi::Span<const int32_t>>("perm") \
                                    .Attr<int32_t>("group_size")      \
                                    .Attr<int32_t>("num_devices")     \
                                    .Attr<int64_t>("block_bytes")     \
                                    .Attr<int32_t>("mode")            \
                                    .Attr<int32_t>("cores")           \
                                    .Attr<int32_t>("engines")         \
                                    .Attr<int32_t>("planner")         \
                                    .Attr<int64_t>("comm_buffer_bytes") \
                                    .Attr<int64_t>("timeout_ms"))

STRATA_DEFINE_COLLECTIVE(StrataAllReduce, strata::OpKind::kAllReduce);
STRATA_DEFINE_COLLECTIVE(StrataAllGather, strata::OpKind::kAllGather);
STRATA_DEFINE_COLLECTIVE(StrataReduceScatter, strata::OpKind::kReduceScatter);
STRATA_DEFINE_COLLECTIVE(StrataAllToAll, strata::OpKind::kAllToAll);
STRATA_DEFINE_COLLECTIVE(StrataBroadcast, strata::OpKind::kBroadcast);
STRATA_DEFINE_COLLECTIVE(StrataPermute, strata::OpKind::kPermute);
