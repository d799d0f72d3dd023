// The in-flight table of cross-process steps. A strata op over axes that
// cross processes runs XLA's own collectives (gloo) over the process axis;
// those block without a timeout when a peer process is gone, and XLA knows
// nothing of strata ops. So the Python layer brackets each cross-process step
// with two marks: `begin` records (site, local device) -> (when, what: the
// op's name and the ranks and processes it waits for), `end` removes it. The
// marks pass their operand through (aliased, so no copy) to order them around
// the step by data flow. A monitor thread in Python reads the table and, when
// a step has waited past the op's timeout or a peer process stopped its
// heartbeat, reports that op and those ranks and ends the process instead of
// hanging (stratacl_jax/_multiprocess/).
#include "xproc_handlers.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace strata {
namespace {

struct Entry {
  std::chrono::steady_clock::time_point since;
  std::string what;
  double timeout_s = 0;  // the op's strata.config(timeout_s=) when it was lowered
};

std::mutex& g_mu = *new std::mutex;
auto& g_inflight = *new std::map<std::pair<int64_t, int32_t>, Entry>;

ffi::Error Mark(int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t site_id,
                int32_t phase, std::string_view what, int64_t timeout_ms) {
  if (x.size_bytes() != out->size_bytes())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "strata_xproc_mark: sizes differ");
  if (out->untyped_data() != x.untyped_data() && x.size_bytes() > 0)
    std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  const auto key = std::make_pair(site_id, ffi_common::LocalDevice(ordinal));
  std::lock_guard<std::mutex> lock(g_mu);
  // A device runs one site's steps one after another (loop trips too), so a
  // begin replaces the entry and an end removes it: the entry of a step whose
  // program failed (its end never ran) is replaced by the next run's.
  if (phase == 0) {
    Entry& e = g_inflight[key];
    e.since = std::chrono::steady_clock::now();
    e.what.assign(what.data(), what.size());
    e.timeout_s = static_cast<double>(timeout_ms) / 1000.0;
  } else {
    g_inflight.erase(key);
  }
  return ffi::Error::Success();
}

// Every process's hash of the step (all-gathered over the crossing axes, in
// their rank order) against this one's; passes x through (aliased).
// Runs inside the step's marks (the gather of hashes waits on the peers
// too); on a disagreement it ends the step's in-flight entry itself, since
// the program fails before the end mark.
ffi::Error Check(int32_t ordinal, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> hashes, ffi::Result<ffi::AnyBuffer> out,
                 ffi::Span<const int32_t> procs, int64_t site_id, int32_t own, int32_t process,
                 std::string_view what) {
  if (x.size_bytes() != out->size_bytes())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "strata_xproc_check: sizes differ");
  if (out->untyped_data() != x.untyped_data() && x.size_bytes() > 0)
    std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  const int32_t* h = hashes.typed_data();
  const size_t n = hashes.element_count();
  std::string others;
  for (size_t r = 0; r < n; ++r) {
    if (h[r] == own) continue;
    const int32_t p = r < procs.size() ? procs[r] : -1;
    if (p == process) continue;  // this process's own ranks hold its hash
    if (others.find("process " + std::to_string(p) + " ") != std::string::npos) continue;
    if (!others.empty()) others += ", ";
    others += "process " + std::to_string(p) + " (op hash " + std::to_string(h[r]) + ")";
  }
  if (others.empty()) return ffi::Error::Success();
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_inflight.erase(std::make_pair(site_id, ffi_common::LocalDevice(ordinal)));
  }
  const std::string op(what.substr(0, what.find(" over ")));
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    op + ": processes disagree on this cross-process collective: this process (" +
                        std::to_string(process) + ") runs " + std::string(what) + " (op hash " +
                        std::to_string(own) + "), but " + others +
                        " runs another op, reduction, dtype, shape or group here. Every process must run the "
                        "same collectives with the same arguments, in the same order; nothing was exchanged.");
}

// The step's hash as an int32[1] that depends on x by data flow, so XLA runs
// the gather of hashes after the begin mark (inside the step's watch).
ffi::Error Hash(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::S32>> out, int32_t own) {
  (void)x;
  if (out->element_count() != 1) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "strata_xproc_hash: int32[1]");
  out->typed_data()[0] = own;
  return ffi::Error::Success();
}

}  // namespace

void BindXproc(nb::module_& m) {
  m.def("xproc_inflight", []() {
    std::vector<std::tuple<int64_t, int32_t, double, std::string, double>> rows;
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(g_mu);
    for (const auto& [key, e] : g_inflight)
      rows.emplace_back(key.first, key.second, std::chrono::duration<double>(now - e.since).count(), e.what,
                        e.timeout_s);
    return rows;
  }, "(site_id, local device, seconds in flight, description, the op's timeout_s) of every cross-process step "
     "in flight");
}

}  // namespace strata

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataXprocMark, strata::Mark,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("site_id")
                                  .Attr<int32_t>("phase")
                                  .Attr<std::string_view>("what")
                                  .Attr<int64_t>("timeout_ms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataXprocCheck, strata::Check,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int32_t>>("procs")
                                  .Attr<int64_t>("site_id")
                                  .Attr<int32_t>("own")
                                  .Attr<int32_t>("process")
                                  .Attr<std::string_view>("what"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataXprocHash, strata::Hash,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int32_t>("own"));
