// Where the ranks of a group meet for one op. A slot is one execution of one
// call site by one group, keyed (run, site, group, iteration): the iteration
// counts how often each rank has run the site in this run, so loop trips get
// their own slots, and a failed run never poisons the next (new run id).
//
// Use: construct a Rendezvous per rank call, Arrive() with the pointers this
// rank publishes and a signature every rank must agree on, run the op
// (peers' pointers are in slot().ptrs), Barrier() between phases. The
// destructor leaves the slot; a failure aborts it so every waiting peer
// returns the same error instead of hanging.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "executor.h"
#include "status.h"

namespace strata {

struct Participant {
  const char* opname = "strata";
  int64_t run_id = 0;   // one XLA execution
  int64_t site_id = 0;  // one call site in the traced program
  int32_t group_id = 0;
  int32_t group_size = 1;
  int32_t rank = 0;
  int32_t device = 0;
  double timeout_s = 60.0;
};

struct Slot {
  explicit Slot(int n) : n(n), present(n, 0), ptrs(n), devices(n, -1), signatures(n) {}

  const int n;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  int inside = 0;
  int left = 0;
  std::vector<char> present;
  std::vector<std::vector<void*>> ptrs;  // what each rank published
  std::vector<int32_t> devices;
  std::vector<std::string> signatures;
  bool aborted = false;
  std::string error;
  std::chrono::steady_clock::time_point aborted_at;

  // Whatever the last arriver set up for everyone (a plan, a layout).
  std::shared_ptr<void> shared;
  // Shared cursor for cooperative task loops, and how many threads have
  // joined the loop; both reset at every barrier.
  std::atomic<uint32_t> next_task{0};
  std::atomic<int> workers{0};

  int phase_count = 0;
  int64_t phase_gen = 0;

  // Non-blocking joins (JoinAsync): each rank's completion, and when the
  // group must be complete by.
  std::vector<std::function<void(const Status&)>> completions;
  std::chrono::steady_clock::time_point deadline;
  double timeout_s = 0;
  const char* opname = "";
  int64_t site_id = 0;
  int32_t group_id = 0;
};

using Completion = std::function<void(const Status&)>;
// Run by the last rank to arrive, with the whole group present: returns the
// job that performs the op (its completion fulfils every rank; an on_done it
// sets runs first, for cleanup), or an error that every rank gets instead.
using Starter = std::function<Status(Slot& slot, std::shared_ptr<Job>* job)>;

// Joins `who`'s group for one op without blocking the caller. Publishes
// `ptrs` and `signature`; `done` is called exactly once: after the op ran,
// or with the error (ranks disagree, a peer never arrived within
// who.timeout_s, the starter failed). A watchdog thread enforces timeouts,
// so no thread ever waits for a peer.
void JoinAsync(const Participant& who, std::vector<void*> ptrs, std::string signature,
               Completion done, const Starter& start);

class Rendezvous {
 public:
  explicit Rendezvous(const Participant& who);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  // Publishes `ptrs` and waits for the whole group. The last rank to arrive
  // checks that all signatures match, then runs `on_all_arrived` (under the
  // slot's lock) before waking the others.
  Status Arrive(std::vector<void*> ptrs, std::string signature,
                const std::function<Status(Slot&)>& on_all_arrived = nullptr);
  // Every rank of the group reaches this point before any goes on.
  Status Barrier(const char* phase);
  // Records a failure: peers waiting anywhere in this slot wake with it.
  Status Fail(const Status& st);

  Slot& slot() { return *slot_; }
  const Participant& who() const { return who_; }
  // "strata.op (call site S, group G, rank R of N, device D): "
  std::string Prefix() const;

 private:
  Participant who_;
  std::shared_ptr<Slot> slot_;
  std::chrono::steady_clock::time_point Deadline() const;
};

// Live (not aborted) slots: 0 once every op has finished.
int64_t LiveSlotCount();

// The cooperative task loop every op uses: the first HostWorkers() threads of
// the group to get here pull task indices from the slot's cursor until none
// are left, whichever rank's work they are; the rest go straight on to the
// next barrier (which resets the cursor).
template <typename Fn>
void RunShared(Slot& s, uint64_t total, Fn&& fn) {
  if (s.workers.fetch_add(1) >= HostWorkers()) return;
  for (uint64_t i = s.next_task.fetch_add(1); i < total; i = s.next_task.fetch_add(1)) fn(i);
}

}  // namespace strata
