// Where the ranks of a group meet for one op. A slot is one execution of one
// call site by one group, keyed (run, site, group, iteration): the iteration
// counts how often each rank has run the site in this run, so loop trips get
// their own slots, and a failed run never poisons the next (new run id).
//
// Use: JoinAsync() with the pointers this rank publishes and a signature
// every rank must agree on; it returns at once. The last rank to arrive turns
// the op into a job (peers' pointers are in slot.ptrs), and the job's end, or
// a failure, completes every rank. Nothing ever waits for a peer.
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "executor.h"
#include "spin_lock.h"
#include "status.h"

namespace strata {

// Who is calling: one rank of one group at one call site of one XLA run.
struct CallSite {
  int64_t run_id = 0;   // one XLA execution
  int64_t site_id = 0;  // one call site in the traced program (named in errors)
  // One custom-call instruction of the compiled program (see SiteInstance in
  // bindings/ffi_common.h); what ranks meet by. 0: use site_id (tools, tests).
  int64_t instance_id = 0;
  int64_t MeetingSite() const { return instance_id != 0 ? instance_id : site_id; }
  int32_t group_id = 0;
  int32_t rank = 0;
  int32_t device = 0;
  double timeout_s = 60.0;

  struct Participant As(const char* opname, int32_t group_size) const;
};

// A call site joining a group of `group_size` ranks for the op `opname`.
struct Participant : CallSite {
  const char* opname = "strata";
  int32_t group_size = 1;
};

inline Participant CallSite::As(const char* opname, int32_t group_size) const {
  Participant who;
  static_cast<CallSite&>(who) = *this;
  who.opname = opname;
  who.group_size = group_size;
  return who;
}

// What every rank of a group must agree on. Ranks compare the hash as they
// arrive. The description is only for a mismatch report, and building it
// means copying the op's parameters (a heap allocation per rank per op), so
// JoinAsync asks `keep` for it only while the caller's parameters are still
// alive and only for ranks the report can need: the first rank in and any
// rank whose hash differs from it. Formatting it is left to the report.
struct Signature {
  uint64_t hash = 0;
  std::function<std::function<std::string()>()> keep;
  // A signature that is its own description (ops whose text is cheap).
  static Signature Of(std::string text);
};

// The pointers one rank publishes, held inline: a vector per rank per op was
// an allocation each. Ops publish at most kMax (MoE's combine backward: 8).
class PtrList {
 public:
  static constexpr size_t kMax = 8;
  PtrList() = default;
  PtrList(std::initializer_list<void*> ptrs) {
    for (void* p : ptrs) push_back(p);
  }
  void push_back(void* p) {
    if (size_ == kMax) std::abort();  // a programming error: raise kMax
    ptrs_[size_++] = p;
  }
  void* operator[](size_t i) const { return ptrs_[i]; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  void* back() const { return ptrs_[size_ - 1]; }
  void* const* begin() const { return ptrs_; }
  void* const* end() const { return ptrs_ + size_; }

 private:
  void* ptrs_[kMax] = {};
  size_t size_ = 0;
};

// FNV-1a over the fields that make up a signature, a 64-bit word at a time
// (a ppermute over 384 ranks signs 3 KB of pairs on every rank).
class SignatureHasher {
 public:
  SignatureHasher& Add(const void* data, size_t len) {
    const auto* b = static_cast<const unsigned char*>(data);
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
      uint64_t word;
      std::memcpy(&word, b + i, 8);
      h_ = (h_ ^ word) * 1099511628211ull;
    }
    for (; i < len; ++i) h_ = (h_ ^ b[i]) * 1099511628211ull;
    return *this;
  }
  template <typename T>
  SignatureHasher& Add(const T& v) { return Add(&v, sizeof(v)); }
  uint64_t hash() const { return h_; }

 private:
  uint64_t h_ = 14695981039346656037ull;
};

struct Slot {
  explicit Slot(int n) : n(n), present(n, 0), ptrs(n), devices(n, -1), descriptions(n) {}

  const int n;
  SpinLock mu;
  int arrived = 0;
  std::vector<char> present;
  std::vector<PtrList> ptrs;  // what each rank published
  std::vector<int32_t> devices;
  int first_in = -1;        // the rank every later rank's hash is compared with
  uint64_t first_hash = 0;  // its Signature::hash
  bool disagree = false;    // some rank's hash differs from it
  std::vector<std::function<std::string()>> descriptions;  // kept ones (see Signature)
  bool aborted = false;
  std::string error;
  std::chrono::steady_clock::time_point aborted_at;

  // Each rank's completion, and when the group must be complete by.
  std::vector<std::function<void(const Status&)>> completions;
  std::chrono::steady_clock::time_point deadline;
  double timeout_s = 0;
  const char* opname = "";
  int64_t run_id = 0;
  int64_t site_id = 0;
  int64_t instance_id = 0;  // the meeting key's site (see CallSite::MeetingSite)
  int32_t group_id = 0;
};

using Completion = std::function<void(const Status&)>;
// Run by the last rank to arrive, with the whole group present: returns the
// job that performs the op (its completion fulfils every rank; an on_done it
// sets runs first, for cleanup), or an error that every rank gets instead.
using Starter = std::function<Status(Slot& slot, std::shared_ptr<Job>* job)>;

// Joins `who`'s group for one op without blocking the caller. Publishes
// `ptrs` and `signature`; `done` is called exactly once (it must not block:
// resuming an XLA program belongs on a thread of its own, see Complete):
// after the op ran,
// or with the error (ranks disagree, a peer never arrived within
// who.timeout_s, the starter failed). A watchdog thread enforces timeouts,
// so no thread ever waits for a peer.
void JoinAsync(const Participant& who, const PtrList& ptrs, const Signature& signature,
               Completion done, const Starter& start);

// Live (not aborted) slots: 0 once every op has finished.
int64_t LiveSlotCount();

// Fails every op still waiting for peers with `why`, now, so their ranks'
// programs end instead of waiting out the timeout; later joins of the same
// runs fail at once with it too (their peers are gone). With `refuse_new`
// every later join fails (the process is exiting). Returns the ops aborted.
int64_t AbortPending(const std::string& why, bool refuse_new);

// Chains a SIGINT handler in front of the current one (Python's): Ctrl-C
// aborts the ops waiting for peers (a thread does it; the handler itself only
// posts a semaphore), then the previous handler runs as before. Idempotent.
void InstallInterruptHandler();

}  // namespace strata
