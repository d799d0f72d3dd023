#include "registry.h"

#include <sys/mman.h>

#include <algorithm>

#include "stats.h"

namespace strata {

Registry::PerNpu& Registry::Get(int npu) {
  const bool direct = npu >= 0 && npu < kDirectNpus;
  if (direct) {
    if (PerNpu* p = direct_[npu].load(std::memory_order_acquire)) return *p;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (direct) {
    PerNpu* p = direct_[npu].load(std::memory_order_relaxed);
    if (!p) {
      p = new PerNpu();
      direct_[npu].store(p, std::memory_order_release);
    }
    return *p;
  }
  PerNpu*& p = npus_[npu];
  if (!p) p = new PerNpu();
  return *p;
}

namespace {
bool Contains(const std::map<uintptr_t, int64_t>& regions, uintptr_t addr, int64_t len) {
  auto it = regions.upper_bound(addr);
  if (it == regions.begin()) return false;
  --it;
  return addr + len <= it->first + it->second;
}
}  // namespace

void Registry::Register(int npu, uintptr_t addr, int64_t len) {
  PerNpu& p = Get(npu);
  {
    std::lock_guard<std::mutex> lock(p.mu);
    int64_t& have = p.regions[addr];
    have = std::max(have, len);
  }
  GlobalStats().registrations++;
  GlobalStats().bytes_registered += len;
}

void Registry::Deregister(int npu, uintptr_t addr) {
  PerNpu& p = Get(npu);
  std::lock_guard<std::mutex> lock(p.mu);
  p.regions.erase(addr);
}

bool Registry::Lookup(int npu, uintptr_t addr, int64_t len) {
  PerNpu& p = Get(npu);
  std::lock_guard<std::mutex> lock(p.mu);
  return Contains(p.regions, addr, len);
}

bool Registry::LookupOrRegister(int npu, uintptr_t addr, int64_t len, bool operand) {
  const bool hit = Lookup(npu, addr, len);
  Stats& s = GlobalStats();
  s.registry_lookups++;
  (hit ? s.registry_hits : s.registry_misses)++;
  if (operand && !hit) s.operand_registry_misses++;
  if (!hit) {
    s.registrations++;
    s.bytes_registered += len;
  }
  return hit;
}

int64_t Registry::RegionCount(int npu) {
  PerNpu& p = Get(npu);
  std::lock_guard<std::mutex> lock(p.mu);
  return static_cast<int64_t>(p.regions.size());
}

void Registry::PreferLargePages(void* addr, int64_t len) {
  constexpr uintptr_t kHuge = 2u << 20;
  if (len < static_cast<int64_t>(2 * kHuge)) return;
  uintptr_t lo = (reinterpret_cast<uintptr_t>(addr) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t hi = (reinterpret_cast<uintptr_t>(addr) + len) & ~(kHuge - 1);
#ifdef MADV_HUGEPAGE
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
}

Registry& GlobalRegistry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace strata
