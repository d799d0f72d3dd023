// What every FFI handler shares: dtype decoding, futures that are already
// settled, and the refusal to run on a thread pool too small for XLA:CPU.
#pragma once
#include <algorithm>
#include <atomic>
#include <optional>
#include <string>

#include <functional>
#include <initializer_list>
#include <memory>
#include <vector>

#include "../runtime/dtypes.h"
#include "../runtime/executor.h"
#include "../runtime/rendezvous.h"
#include "../runtime/stats.h"
#include "../runtime/status.h"
#include "xla/ffi/api/ffi.h"

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define STRATA_TSAN 1
#endif

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

// How a handler that has just joined its group returns: with a settled future
// if its op is already done (it was the last rank in and ran the op on the
// spot), else at once with a pending one that the op's completion settles,
// on a resumer thread (Complete in runtime/executor.h). It never waits: a
// waiting handler holds an XLA thread per rank, and on 2 cores every waiter
// costs a context switch (a futex wake if it sleeps) per op, paid rank after
// rank; resumer threads instead run ranks' programs on one after another.
// (Polling up to 500 us + 100 us per rank was 1.5-2x slower than this at 8,
// 64 and 384 ranks; see BENCHMARKS.md.)
//
// It also tells TSan the one ordering XLA makes that TSan cannot see (jaxlib
// is not instrumented): an op that reads a buffer another op wrote starts
// only after that op's future is settled, so what the writer's workers
// stored is there for the reader's handler (MoE combine checks the
// pair_slot its dispatch's workers placed). The completion releases every
// result buffer, the handler acquires every operand: the edge XLA's
// dataflow makes, buffer by buffer, and no other. Nothing in other builds.
class Handoff {
 public:
  // inputs: the operand buffers the op reads; outputs: the result buffers
  // it writes (for TSan, above).
  Handoff(std::initializer_list<const void*> inputs, std::initializer_list<const void*> outputs)
      : state_(new State) {
#ifdef STRATA_TSAN
    for (const void* in : inputs) __tsan_acquire(const_cast<void*>(in));
    state_->outputs.assign(outputs.begin(), outputs.end());
#else
    (void)inputs;
    (void)outputs;
#endif
  }
  Handoff(const Handoff&) = delete;
  Handoff& operator=(const Handoff&) = delete;
  // Result() gives up the handler's share; a handler that never got there
  // gives it up here (and the completion's, if it never handed one out).
  ~Handoff() {
    if (!state_) return;
    if (!completion_out_) Release(state_);
    Release(state_);
  }

  // Called exactly once (the runtime's contract for completions). It holds
  // the completion's share of the state as a raw pointer: a lambda with a
  // shared_ptr is not trivially copyable, so std::function would put it on
  // the heap, and so would the lambda that settles the future, two
  // allocations per rank per op made on one thread and freed on another
  // (glibc's slow path: libc was ~0.6 us of strata's ~1.3 us per rank).
  std::function<void(const Status&)> Completion() {
    completion_out_ = true;
    return [state = state_](const Status& st) {
#ifdef STRATA_TSAN
      // On the thread that finished the op, before XLA can hear of it.
      for (const void* out : state->outputs) __tsan_release(const_cast<void*>(out));
#endif
      state->status = st;  // read by the handler only once it sees kDone
      int waiting = kWaiting;
      if (state->phase.compare_exchange_strong(waiting, kDone, std::memory_order_acq_rel)) {
        Release(state);
        return;
      }
      // The handler has returned its pending future: settle it, off this thread.
      Complete([state] {
        SettleNow(state->promise, state->status);
        Release(state);
      });
    };
  }

  // What the handler returns, once it has joined.
  ffi::Future Result() {
    State* state = state_;
    state_ = nullptr;
    int waiting = kWaiting;
    if (state->phase.compare_exchange_strong(waiting, kDetached, std::memory_order_acq_rel)) {
      GlobalStats().waits_handed_off++;
      ffi::Future future(state->promise);
      Release(state);
      return future;
    }
    ffi::Future done = state->status.ok ? Ready()
                                        : Failed(ffi::Error(ffi::ErrorCode::kAborted, state->status.message));
    Release(state);
    return done;
  }

 private:
  // Who settles the handler's future, decided once by whichever comes first:
  // the op finishing (kDone: the handler returns a settled future) or the
  // handler returning (kDetached: the completion settles the future). Atomic,
  // not a mutex: it is decided on every rank of every op, often while the op
  // finishes on another thread (a contended mutex there cost a futex wake-up
  // per rank: 15 ms per 384-rank op instead of 2.5).
  enum Phase : int { kWaiting, kDone, kDetached };
  struct State {
    std::atomic<int> phase{kWaiting};
    std::atomic<int> shares{2};  // the handler's and the completion's
    Status status;
    ffi::Promise promise;
#ifdef STRATA_TSAN
    std::vector<const void*> outputs;
#endif
  };
  static void Release(State* state) {
    if (state->shares.fetch_sub(1, std::memory_order_acq_rel) == 1) delete state;
  }
  State* state_;
  bool completion_out_ = false;
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
