// What every FFI handler shares: dtype decoding, futures that are already
// settled, and the refusal to run on a thread pool too small for XLA:CPU.
#pragma once
#include <algorithm>
#include <atomic>
#include <optional>
#include <string>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <atomic>

#include "../runtime/dtypes.h"
#include "../runtime/executor.h"
#include "../runtime/rendezvous.h"
#include "../runtime/stats.h"
#include "../runtime/status.h"
#include "xla/ffi/api/ffi.h"

namespace strata::ffi_common {

namespace ffi = xla::ffi;

inline std::optional<DType> ToDType(ffi::DataType t) {
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
    case ffi::DataType::C64: return DType::C64;
    case ffi::DataType::C128: return DType::C128;
    default: return std::nullopt;
  }
}

// One custom-call instruction of one compiled program. XLA creates it (in the
// FFI "instantiate" stage) once per instruction of an executable, and every
// device running that executable is handed the same one. The trace-time
// site_id cannot tell instructions apart: jax lowers a jitted helper once and
// calls it from every call site, so two calls, or both branches of a
// lax.cond, carry one site_id; after XLA inlines them they are separate
// instructions, each with its own instance.
struct SiteInstance {
  static inline ffi::TypeId id = {};
  // Written at instantiation, read by every execution: XLA orders the two
  // (the executable is published in between) in code no sanitizer sees, so
  // the id is an atomic rather than a race as far as TSan can tell.
  std::atomic<int64_t> instance{0};
};

// Instance ids: unique in the process, so slots of two instructions never meet.
ffi::ErrorOr<std::unique_ptr<SiteInstance>> NewSiteInstance();
// For jax.ffi.register_ffi_type.
const XLA_FFI_TypeInfo* SiteInstanceTypeInfo();

// XLA:CPU numbers the devices of a multi-process run `process_index *
// kMaxCpuDevicesPerProcess + local id` (xla/pjrt/cpu/cpu_client.h; 2048 in
// jaxlib 0.10.2, checked with jax.devices() over two processes), and
// DeviceOrdinal is that packed id. Everything this runtime indexes by device
// (arenas, registry, stats, rendezvous, traces) lives in one process and is
// indexed by the local id; the process is named by the Python layer.
constexpr int32_t kMaxCpuDevicesPerProcess = 2048;
inline int32_t LocalDevice(int32_t ordinal) { return ordinal % kMaxCpuDevicesPerProcess; }

// Who is calling, from the handler's context and the (rank, group) operand.
inline CallSite DecodeCallSite(int32_t device, ffi::RunId run, ffi::Buffer<ffi::S32>& meta,
                               int64_t site_id, int64_t timeout_ms,
                               const SiteInstance* instance = nullptr) {
  CallSite c;
  c.run_id = run.run_id;
  c.site_id = site_id;
  c.instance_id = instance ? instance->instance.load(std::memory_order_acquire) : 0;
  c.rank = meta.typed_data()[0];
  c.group_id = meta.typed_data()[1];
  c.device = LocalDevice(device);
  c.timeout_s = static_cast<double>(timeout_ms) / 1000.0;
  return c;
}

inline ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

inline ffi::Future Ready() {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetAvailable();
  return future;
}

inline ffi::Error Invalid(const char* op, const std::string& why) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(op) + ": " + why);
}

inline void SettleNow(ffi::Promise& promise, const Status& st) {
  if (st.ok) {
    promise.SetAvailable();
  } else {
    promise.SetError(ffi::Error(ffi::ErrorCode::kAborted, st.message));
  }
}

// The completion the runtime calls once to settle a handler's future: on a
// completion thread of its own, since settling resumes the rank's program.
inline auto Settle(ffi::Promise promise) {
  return [promise = std::move(promise)](const Status& st) mutable {
    Complete([promise, st]() mutable { SettleNow(promise, st); });
  };
}

// A handler that has just joined its group waits a short, bounded while for
// the op to finish: a quick op then returns a settled future and its rank
// goes on on its own thread, with no hand-off. Past the bound the handler
// returns the pending future and frees its thread, so a slow peer can never
// starve XLA of threads.
class BriefWait {
 public:
  // `spin`: poll (yielding) instead of sleeping. Right for ops the last rank
  // runs on the spot: a sleeping waiter costs a futex wake-up and a context
  // switch per rank, paid one after another on a small machine (8 ranks, 1 KB
  // all_reduce: ~110 -> ~60 us per op). Wrong for ops the host workers run:
  // spinning ranks would take the cores from the workers.
  BriefWait(std::chrono::microseconds bound, bool spin)
      : bound_(bound), spin_(spin), state_(std::make_shared<State>()) {}

  // The bound for a group of `n` ranks: the last of n XLA threads reaches the
  // op later the more there are, and a rank that gives up pays a hand-off to
  // a completion thread and XLA's resumption of its program, which costs more
  // than the wait.
  static BriefWait ForGroup(int64_t n, bool spin) {
    return BriefWait(std::chrono::microseconds{kBaseUs + kPerRankUs * std::max<int64_t>(1, n)}, spin);
  }

  std::function<void(const Status&)> Completion() {
    return [state = state_](const Status& st) {
      std::unique_lock<std::mutex> lock(state->mu);
      if (!state->detached) {
        state->status = st;
        state->done = true;
        state->done_flag.store(true, std::memory_order_release);
        state->cv.notify_one();
        return;
      }
      lock.unlock();
      Complete([state, st]() mutable { SettleNow(state->promise, st); });
    };
  }

  ffi::Future Wait() {
    const auto deadline = std::chrono::steady_clock::now() + bound_;
    if (spin_) {
      while (!state_->done_flag.load(std::memory_order_acquire) &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait_until(lock, deadline, [&] { return state_->done; });
    if (state_->done) {
      if (state_->status.ok) return Ready();
      return Failed(ffi::Error(ffi::ErrorCode::kAborted, state_->status.message));
    }
    state_->detached = true;
    GlobalStats().waits_handed_off++;
    return ffi::Future(state_->promise);
  }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false, detached = false;
    std::atomic<bool> done_flag{false};  // `done`, readable without the lock
    Status status;
    ffi::Promise promise;
  };
  static constexpr int64_t kBaseUs = 500, kPerRankUs = 100;
  std::chrono::microseconds bound_;
  bool spin_;
  std::shared_ptr<State> state_;
};

// XLA:CPU deadlocks itself when its client pool has fewer than two threads
// per device (a blocked launch holds the threads a running collective needs);
// refuse before we could be part of that. The pool size the FFI reports
// saturates at 256, so beyond 128 devices this check can only see that much;
// the Python layer sizes the real pool (PJRT_NPROC) regardless.
inline std::optional<ffi::Error> CheckPool(const char* op, ffi::ThreadPool& pool, int32_t num_devices) {
  constexpr int64_t kReportedPoolCap = 256;
  const int64_t threads = pool.num_threads();
  const int64_t needed = 2 * static_cast<int64_t>(num_devices);
  if (threads >= std::min(needed, kReportedPoolCap)) return std::nullopt;
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string(op) + ": XLA:CPU's client thread pool has " + std::to_string(threads) +
                        " threads, but a program on " + std::to_string(num_devices) +
                        " devices needs at least " + std::to_string(needed) +
                        " or XLA can hang. Set PJRT_NPROC=" + std::to_string(needed) +
                        " (or more) before JAX starts; importing stratacl_jax before the first "
                        "JAX computation does this for you.");
}

}  // namespace strata::ffi_common
