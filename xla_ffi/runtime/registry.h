// Memory regions each emulated NPU has registered with the fabric. A peer
// may read or write a buffer directly only inside a registered region.
#pragma once
#include <atomic>
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
  // Looks up a buffer an op is about to use. A miss is an XLA temporary: it
  // is registered for this op only (counted as a registration) and nothing
  // of it is kept, since XLA frees and recycles such buffers behind our back:
  // a cached registration would outlive its buffer. Returns whether it hit.
  // `operand` says whether it is an op's input (counted apart from results,
  // which XLA allocates afresh and so are per-op registrations by nature).
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
    // Pinned for their lifetime (arenas, comm buffers): start -> length.
    // Kept unmerged so that Deregister removes exactly what was registered.
    std::map<uintptr_t, int64_t> regions;
  };
  PerNpu& Get(int npu);

  // Every rank looks its NPU up twice per op: the common NPUs are found
  // without a lock (a shared mutex taken by hundreds of device threads per op
  // was a convoy); created under mu_, never freed.
  static constexpr int kDirectNpus = 4096;
  std::atomic<PerNpu*> direct_[kDirectNpus] = {};
  std::mutex mu_;
  std::map<int, PerNpu*> npus_;  // the others (ids beyond kDirectNpus)
};

Registry& GlobalRegistry();

}  // namespace strata
