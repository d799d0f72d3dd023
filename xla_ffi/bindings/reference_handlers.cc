// Reference handlers for the latency benchmark: what XLA itself costs per
// custom call, and what merely meeting a group costs, with no runtime at all.
// They are the floor every strata op is reported against; they are not a
// public API (no timeout, no mismatch checks, no loop support).
//
//   strata_ref_copy:    copies its input to its output.
//   strata_ref_barrier: every rank publishes its input, meets the others in a
//                       spin-then-yield barrier, sums element 0 of every
//                       rank's input into its output, and meets them again
//                       (so no rank leaves while a peer still reads its buffer).
//   strata_ref_meet:    the same result, asynchronously, as strata's ops meet:
//                       a rank publishes its buffers and returns a pending
//                       future; the last rank in sums for everyone and hands
//                       the others to the runtime's resumer threads. What
//                       meeting costs with strata's resumption alone (no
//                       rendezvous bookkeeping, checks, plans or registry).
//                       An output k times the input's size gets the input k
//                       times before the rank meets: an all_gather's output
//                       written with the group met, a floor no real gather
//                       can beat (it cannot write before its peers arrive).
#include "reference_handlers.h"

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "../runtime/copy.h"
#include "../runtime/executor.h"
#include "../runtime/registry.h"
#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace strata {
namespace {

ffi::Error RefCopy(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  if (x.size_bytes() != out->size_bytes())
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "strata_ref_copy: the output's size differs from the input's");
  std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

// One meeting of one call site in one run.
struct Meeting {
  explicit Meeting(int n) : inputs(n, nullptr) {}
  std::vector<const float*> inputs;
  std::atomic<int> arrived{0}, left{0}, gone{0};
};

std::mutex& g_mu = *new std::mutex;
auto& g_meetings = *new std::map<std::tuple<int64_t, int64_t>, std::shared_ptr<Meeting>>;

void SpinUntil(const std::atomic<int>& counter, int target) {
  for (int spins = 0; counter.load(std::memory_order_acquire) < target; ++spins)
    if (spins > 256) std::this_thread::yield();
}

// `out` holds x once, or with `whole_inputs` any whole number of times (>= 1).
bool ArgumentsFit(int rank, int32_t group_size, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& out,
                  bool whole_inputs) {
  const size_t in = x.element_count(), total = out.element_count();
  const bool shape = whole_inputs ? total >= in && total % in == 0 : total == in;
  return group_size >= 1 && rank >= 0 && rank < group_size && in >= 1 && shape;
}

// The meeting of (run, site), made by whichever rank comes first.
template <typename M>
std::shared_ptr<M> Join(std::map<std::tuple<int64_t, int64_t>, std::shared_ptr<M>>& meetings,
                        ffi::RunId run, int64_t site_id, int32_t group_size) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& slot = meetings[{run.run_id, site_id}];
  if (!slot) slot = std::make_shared<M>(group_size);
  return slot;
}

ffi::Error RefBarrier(ffi::RunId run, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rank_buf,
                      ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t site_id, int32_t group_size) {
  const int rank = rank_buf.typed_data()[0];
  if (!ArgumentsFit(rank, group_size, x, *out, /*whole_inputs=*/false))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "strata_ref_barrier: bad arguments");
  std::shared_ptr<Meeting> m = Join(g_meetings, run, site_id, group_size);
  m->inputs[rank] = x.typed_data();
  m->arrived.fetch_add(1, std::memory_order_acq_rel);
  SpinUntil(m->arrived, group_size);
  float sum = 0;
  for (const float* in : m->inputs) sum += in[0];
  std::memcpy(out->typed_data(), x.typed_data(), x.size_bytes());
  out->typed_data()[0] = sum;
  m->left.fetch_add(1, std::memory_order_acq_rel);
  SpinUntil(m->left, group_size);
  if (m->gone.fetch_add(1, std::memory_order_acq_rel) + 1 == group_size) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_meetings.erase({run.run_id, site_id});
  }
  return ffi::Error::Success();
}

// One asynchronous meeting: what each rank published, and its future.
struct AsyncMeeting {
  explicit AsyncMeeting(int n) : inputs(n, nullptr), outputs(n, nullptr), promises(n) {}
  std::vector<const float*> inputs;
  std::vector<float*> outputs;
  std::vector<ffi::Promise> promises;
  std::atomic<int> arrived{0};
};
auto& g_async_meetings = *new std::map<std::tuple<int64_t, int64_t>, std::shared_ptr<AsyncMeeting>>;

ffi::Future RefMeet(ffi::RunId run, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> rank_buf,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t site_id, int32_t group_size) {
  const int rank = rank_buf.typed_data()[0];
  if (!ArgumentsFit(rank, group_size, x, *out, /*whole_inputs=*/true))
    return ffi_common::Failed(ffi::Error(ffi::ErrorCode::kInvalidArgument, "strata_ref_meet: bad arguments"));
  // Written the way strata writes a gather's outputs (large pages for a fresh
  // output, streaming stores once the group's outputs outgrow the cache), so
  // the floor is no slower than the op.
  char* dst = reinterpret_cast<char*>(out->typed_data());
  Registry::PreferLargePages(dst, static_cast<int64_t>(out->size_bytes()));
  const bool streaming = StreamsOutputs(static_cast<int64_t>(out->size_bytes()), group_size);
  for (size_t at = 0; at < out->size_bytes(); at += x.size_bytes())
    CopyBytes(dst + at, x.typed_data(), x.size_bytes(), streaming);
  if (streaming) StoreFence();
  std::shared_ptr<AsyncMeeting> m = Join(g_async_meetings, run, site_id, group_size);
  m->inputs[rank] = x.typed_data();
  m->outputs[rank] = out->typed_data();
  ffi::Future future(m->promises[rank]);
  if (m->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 < group_size) return future;
  float sum = 0;
  for (const float* in : m->inputs) sum += in[0];
  for (float* o : m->outputs) o[0] = sum;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_async_meetings.erase({run.run_id, site_id});
  }
  CompletionBatch batch;
  for (int r = 0; r < group_size; ++r)
    if (r != rank) Complete([promise = m->promises[r]]() mutable { promise.SetAvailable(); });
  return ffi_common::Ready();
}

}  // namespace
}  // namespace strata

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataRefCopy, strata::RefCopy,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

// The two meetings take the same call: (x, rank) -> out, with site and group size.
#define STRATA_DEFINE_MEETING(symbol, fn)                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, fn,                    \
                                ffi::Ffi::Bind()               \
                                    .Ctx<ffi::RunId>()         \
                                    .Arg<ffi::Buffer<ffi::F32>>() \
                                    .Arg<ffi::Buffer<ffi::S32>>() \
                                    .Ret<ffi::Buffer<ffi::F32>>() \
                                    .Attr<int64_t>("site_id")  \
                                    .Attr<int32_t>("group_size"))

STRATA_DEFINE_MEETING(StrataRefBarrier, strata::RefBarrier);
STRATA_DEFINE_MEETING(StrataRefMeet, strata::RefMeet);
