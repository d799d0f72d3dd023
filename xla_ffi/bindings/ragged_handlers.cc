// FFI handler of ragged_all_to_all: check shapes, put the output operand's
// rows in the result (XLA aliases the two, so usually nothing to copy), join
// the group (algorithms/ragged_all_to_all.h). Asynchronous like the others.
#include "ragged_handlers.h"

#include <cstring>
#include <optional>
#include <string>

#include "../algorithms/op_registry.h"
#include "../algorithms/ragged_all_to_all.h"
#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

// "strata.ragged_all_to_all", from the op registry.
const char* const kOp = Collective(OpKind::kRaggedAllToAll).builder.name;

// How the exchange runs (strata.config), packed into one "params" array in
// this order by stratacl_jax/ragged_all_to_all.py.
enum RaggedParam : size_t { kMode, kCores, kEngines, kPlanner, kCommBufferBytes, kParamCount };

int64_t RowElems(ffi::AnyBuffer::Dimensions d) {
  int64_t e = 1;
  for (size_t i = 1; i < d.size(); ++i) e *= d[i];
  return e;
}

ffi::Future RaggedImpl(int32_t device, ffi::RunId run, ffi::ThreadPool pool,
                       ffi_common::SiteInstance* instance, ffi::AnyBuffer operand,
                       ffi::AnyBuffer output, ffi::AnyBuffer input_offsets,
                       ffi::AnyBuffer send_sizes, ffi::AnyBuffer output_offsets,
                       ffi::AnyBuffer recv_sizes, ffi::Buffer<ffi::S32> meta,
                       ffi::Result<ffi::AnyBuffer> out, int64_t site_id, int32_t group_size,
                       int32_t num_devices, int64_t timeout_ms, ffi::Span<const int64_t> params) {
  using ffi_common::Failed;
  using ffi_common::Invalid;
  if (params.size() != kParamCount)
    return Failed(Invalid(kOp, "params holds " + std::to_string(params.size()) + " values, not " +
                                   std::to_string(kParamCount) + " (a program lowered by another version?)"));
  if (auto err = ffi_common::CheckPool(kOp, pool, num_devices)) return Failed(std::move(*err));
  std::optional<DType> dtype = ffi_common::ToDType(operand.element_type());
  if (!dtype) return Failed(Invalid(kOp, "unsupported element type"));
  auto od = operand.dimensions(), ud = output.dimensions();
  if (operand.element_type() != output.element_type() || output.element_type() != out->element_type() ||
      od.size() < 1 || ud.size() != od.size() || RowElems(od) != RowElems(ud) ||
      out->size_bytes() != output.size_bytes())
    return Failed(Invalid(kOp, "operand and output must have one dtype and the same row shape"));
  if (group_size < 1) return Failed(Invalid(kOp, "group_size must be positive"));
  const size_t entries = input_offsets.element_count();
  for (auto* v : {&input_offsets, &send_sizes, &output_offsets, &recv_sizes})
    if (v->element_count() != entries || entries == 0 || entries % group_size != 0)
      return Failed(Invalid(kOp, "offsets and sizes must be one length, a positive multiple of the group size"));
  if (meta.element_count() != 2) return Failed(Invalid(kOp, "rank operand must hold (rank, group)"));
  IndexType index_types[4];
  {
    ffi::AnyBuffer* vectors[4] = {&input_offsets, &send_sizes, &output_offsets, &recv_sizes};
    for (int v = 0; v < 4; ++v) {
      switch (vectors[v]->element_type()) {
        case ffi::DataType::S32: index_types[v] = IndexType::S32; break;
        case ffi::DataType::S64: index_types[v] = IndexType::S64; break;
        case ffi::DataType::U32: index_types[v] = IndexType::U32; break;
        case ffi::DataType::U64: index_types[v] = IndexType::U64; break;
        default: return Failed(Invalid(kOp, "offsets and sizes must be int32, int64, uint32 or uint64"));
      }
    }
  }

  if (out->untyped_data() != output.untyped_data() && output.size_bytes() > 0)
    std::memcpy(out->untyped_data(), output.untyped_data(), output.size_bytes());

  RaggedParams p;
  p.group_size = group_size;
  p.slices_per_peer = static_cast<int32_t>(entries / group_size);
  p.operand_rows = od[0];
  p.output_rows = ud[0];
  p.row_bytes = RowElems(od) * static_cast<int64_t>(DTypeSize(*dtype));
  p.dtype = *dtype;
  for (int v = 0; v < 4; ++v) p.index_types[v] = index_types[v];
  p.mode = static_cast<Mode>(params[kMode]);
  p.cores = static_cast<int32_t>(params[kCores]);
  p.engines = static_cast<int32_t>(params[kEngines]);
  p.planner = static_cast<Planner>(params[kPlanner]);
  p.comm_buffer_bytes = params[kCommBufferBytes];
  RaggedBuffers b;
  b.operand = operand.untyped_data();
  b.out = out->untyped_data();
  b.input_offsets = input_offsets.untyped_data();
  b.send_sizes = send_sizes.untyped_data();
  b.output_offsets = output_offsets.untyped_data();
  b.recv_sizes = recv_sizes.untyped_data();
  ffi_common::Handoff handoff({b.operand, b.input_offsets, b.send_sizes, b.output_offsets, b.recv_sizes}, {b.out});
  RaggedAllToAllAsync(p, ffi_common::DecodeCallSite(device, run, meta, site_id, timeout_ms, instance), b,
                      handoff.Completion());
  return handoff.Result();
}

}  // namespace
}  // namespace strata

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataRaggedAllToAll, strata::RaggedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ctx<ffi::State<strata::ffi_common::SiteInstance>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("site_id")
                                  .Attr<int32_t>("group_size")
                                  .Attr<int32_t>("num_devices")
                                  .Attr<int64_t>("timeout_ms")
                                  .Attr<ffi::Span<const int64_t>>("params"));
