// Memory regions each emulated NPU has registered with the fabric. A peer
// may read or write a buffer directly only inside a registered region.
#pragma once
#include <cstdint>
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
  // first time) so the next call hits. Returns whether it hit.
  bool LookupOrRegister(int npu, uintptr_t addr, int64_t len);
  int64_t RegionCount(int npu);

  // Asks the kernel to back [addr, addr+len) with 2 MiB pages where the
  // region is large. Registering memory with a fabric pins it in large pages;
  // on the host this turns hundreds of thousands of 4 KiB page faults on a
  // freshly allocated output into a few hundred. Harmless when already touched.
  static void PreferLargePages(void* addr, int64_t len);

 private:
  struct PerNpu {
    std::mutex mu;
    std::map<uintptr_t, int64_t> regions;  // start -> length, non-overlapping
  };
  PerNpu& Get(int npu);
  bool FindLocked(PerNpu& p, uintptr_t addr, int64_t len);
  void InsertLocked(PerNpu& p, uintptr_t addr, int64_t len);

  std::mutex mu_;
  std::vector<PerNpu*> npus_;
};

Registry& GlobalRegistry();

}  // namespace strata
