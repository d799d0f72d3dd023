// Registration-on-allocation: each emulated NPU allocates tensor memory from
// arenas that were registered with the fabric (and backed by large,
// pre-faulted pages) when the arena was created. Every block handed out is
// therefore reachable by peers without a per-op registration or staging copy.
//
// Memory goes back (the policy): a chunk whose last block is freed is
// unregistered and returned to the OS at once, except that each arena keeps
// one wholly free chunk of at most kKeepFreeBytes (the largest such) to
// serve the next allocations without mapping and faulting pages again. A
// request that no chunk can hold first returns every wholly free chunk, then
// maps one of at least the request's size. So after all its arrays are freed
// an arena holds at most kKeepFreeBytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace strata {

struct ArenaInfo {
  int64_t chunks = 0;
  int64_t bytes_reserved = 0;  // registered arena memory
  int64_t chunks_released = 0;  // returned to the OS, ever
  int64_t bytes_in_use = 0;
  int64_t live_blocks = 0;
  int64_t allocations = 0;  // ever
};

class Arena {
 public:
  static constexpr size_t kAlign = 64;             // XLA imports 64-byte aligned host memory zero-copy
  static constexpr size_t kMinChunk = 32u << 20;   // grown in chunks of at least this
  static constexpr size_t kKeepFreeBytes = 64u << 20;  // the one wholly free chunk kept, at most

  explicit Arena(int device) : device_(device) {}
  // nullptr when the memory cannot be mapped (nothing is kept then).
  void* Allocate(size_t bytes);
  // Returns false when `p` is not a live block of this arena.
  bool Free(void* p);
  bool Owns(const void* p) const;
  ArenaInfo Info();

 private:
  struct Chunk {
    char* base;
    size_t size;
    std::map<size_t, size_t> free;  // offset -> length, coalesced
    bool Empty() const { return free.size() == 1 && free.begin()->first == 0 && free.begin()->second == size; }
  };
  bool AddChunk(size_t at_least);
  void Release(std::map<uintptr_t, Chunk>::iterator it);
  // Applies the policy once a chunk became wholly free.
  void Trim();

  const int device_;
  mutable std::mutex mu_;
  std::map<uintptr_t, Chunk> chunks_;  // base -> chunk, in address order
  std::map<uintptr_t, std::pair<uintptr_t, size_t>> live_;  // addr -> (chunk base, length)
  ArenaInfo info_;
};

Arena& ArenaFor(int device);
// Frees a block from whichever device's arena owns it.
bool ArenaFree(void* p);

}  // namespace strata
