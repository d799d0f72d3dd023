// Counters the runtime keeps so users can see what the fabric did.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace strata {

struct Stats {
  std::atomic<int64_t> ops{0};
  std::atomic<int64_t> bytes_direct{0};   // moved straight between user buffers
  std::atomic<int64_t> bytes_staged{0};   // copied into or out of comm buffers
  std::atomic<int64_t> bytes_exchanged{0};  // written by transfers, either mode
  // Copied or reduced within one rank on an op's behalf: MoE dispatch's
  // fan-out of a received token to more of the rank's experts, combine's sum
  // of a token's rows from one rank's experts before one row goes back.
  std::atomic<int64_t> bytes_local{0};
  std::atomic<int64_t> registrations{0};
  std::atomic<int64_t> bytes_registered{0};
  std::atomic<int64_t> registry_lookups{0};
  std::atomic<int64_t> registry_hits{0};
  std::atomic<int64_t> registry_misses{0};
  std::atomic<int64_t> operand_registry_misses{0};  // inputs found unregistered
  // Handlers that returned before their op finished: the op's completion
  // resumes them on a resumer thread (every rank but the last one in).
  std::atomic<int64_t> waits_handed_off{0};
  // Resumer threads the monitor found on one rank's program for a tick
  // (blocked in XLA's own collective, or long compute): each got a fresh
  // thread put to work, and completions are spread for a while after.
  std::atomic<int64_t> resumers_blocked{0};

  // Per NPU, per lane. Grown on demand under the mutex; updates are rare
  // (once per lane task), so a lock is cheaper than getting clever.
  std::mutex mu;
  std::vector<std::vector<int64_t>> core_bytes;
  std::vector<std::vector<int64_t>> sdma_bytes;
  // Per NPU: bytes the plan executor (collectives, ragged_all_to_all) copied
  // into or out of its comm buffers (buffer_centric), part of bytes_staged.
  std::vector<int64_t> staged_bytes;

  void AddLaneBytes(bool sdma, int npu, int lane, int lanes, int64_t bytes);
  struct LaneBytes {
    int npu, lane;
    int64_t bytes;
  };
  // One lock for a batch of lanes (a host chunk's worth).
  void AddLaneBytes(bool sdma, int lanes, const std::vector<LaneBytes>& batch);
  // Bytes a transfer wrote into destinations; `direct`: straight between
  // user buffers (strata mode), not through comm buffers.
  void AddExchanged(int64_t bytes, bool direct) {
    if (bytes <= 0) return;
    bytes_exchanged += bytes;
    if (direct) bytes_direct += bytes;
  }
  void AddLocal(int64_t bytes) {
    if (bytes > 0) bytes_local += bytes;
  }
  // One rank's staging copy (a whole rank's blocks: rare, so the lock is cheap).
  void AddStaged(int npu, int64_t bytes);
  void Reset();
};

Stats& GlobalStats();

}  // namespace strata
