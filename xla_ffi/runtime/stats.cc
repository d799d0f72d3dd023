#include "stats.h"

namespace strata {

void Stats::AddLaneBytes(bool sdma, int npu, int lane, int lanes, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu);
  auto& table = sdma ? sdma_bytes : core_bytes;
  if (static_cast<int>(table.size()) <= npu) table.resize(npu + 1);
  if (static_cast<int>(table[npu].size()) < lanes) table[npu].resize(lanes, 0);
  table[npu][lane] += bytes;
}

void Stats::AddLaneBytes(bool sdma, int lanes, const std::vector<LaneBytes>& batch) {
  std::lock_guard<std::mutex> lock(mu);
  auto& table = sdma ? sdma_bytes : core_bytes;
  for (const LaneBytes& b : batch) {
    if (static_cast<int>(table.size()) <= b.npu) table.resize(b.npu + 1);
    if (static_cast<int>(table[b.npu].size()) < lanes) table[b.npu].resize(lanes, 0);
    table[b.npu][b.lane] += b.bytes;
  }
}

void Stats::AddStaged(int npu, int64_t bytes) {
  bytes_staged += bytes;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(staged_bytes.size()) <= npu) staged_bytes.resize(npu + 1, 0);
  staged_bytes[npu] += bytes;
}

void Stats::Reset() {
  for (auto* c : {&ops, &bytes_direct, &bytes_staged, &bytes_exchanged, &bytes_local, &registrations,
                  &bytes_registered, &registry_lookups, &registry_hits, &registry_misses, &operand_registry_misses, &waits_handed_off,
                  &resumers_blocked})
    c->store(0);
  std::lock_guard<std::mutex> lock(mu);
  core_bytes.clear();
  sdma_bytes.clear();
  staged_bytes.clear();
}

Stats& GlobalStats() {
  static Stats* stats = new Stats();  // never destroyed: handlers may run at exit
  return *stats;
}

}  // namespace strata
