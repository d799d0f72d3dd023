// Memory regions each emulated NPU has registered with the fabric. A peer
// may read or write a buffer directly only inside a registered region.
#pragma once
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

namespace strata {

class Registry {
 public:
  // Registers [addr, addr+len) for `npu`; counted in stats.
  void Register(int npu, uintptr_t addr, int64_t len);
  void Deregister(int npu, uintptr_t addr);
  // True when [addr, addr+len) lies inside one region of `npu`.
  bool Lookup(int npu, uintptr_t addr, int64_t len);
  // Looks up; on a miss registers the range (an XLA temporary seen for the
  // first time) so the next call hits. Returns whether it hit. `operand`
  // says whether it is an op's input (counted apart from results, which XLA
  // allocates afresh and so are first-use registrations by nature).
  bool LookupOrRegister(int npu, uintptr_t addr, int64_t len, bool operand = true);
  int64_t RegionCount(int npu);

  // Asks the kernel to back [addr, addr+len) with 2 MiB pages where the
  // region is large. Registering memory with a fabric pins it in large pages;
  // on the host this turns hundreds of thousands of 4 KiB page faults on a
  // freshly allocated output into a few hundred. Harmless when already touched.
  static void PreferLargePages(void* addr, int64_t len);

 private:
  struct PerNpu {
    std::mutex mu;
    std::map<uintptr_t, int64_t> regions;  // pinned (arenas, comm buffers): start -> length
    std::map<uintptr_t, int64_t> cached;   // registered on first use
    std::deque<uintptr_t> cache_order;     // oldest first, for eviction
  };
  static constexpr size_t kMaxCached = 4096;  // per NPU; XLA recycles addresses
  PerNpu& Get(int npu);
  bool FindLocked(PerNpu& p, uintptr_t addr, int64_t len);
  void InsertLocked(PerNpu& p, uintptr_t addr, int64_t len);

  std::mutex mu_;
  std::vector<PerNpu*> npus_;
};

Registry& GlobalRegistry();

}  // namespace strata
