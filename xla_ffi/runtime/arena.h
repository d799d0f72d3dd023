// Registration-on-allocation: each emulated NPU allocates tensor memory from
// arenas that were registered with the fabric (and backed by large,
// pre-faulted pages) when the arena was created. Every block handed out is
// therefore reachable by peers without a per-op registration or staging copy.
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
  int64_t bytes_in_use = 0;
  int64_t live_blocks = 0;
  int64_t allocations = 0;  // ever
};

class Arena {
 public:
  static constexpr size_t kAlign = 64;             // XLA imports 64-byte aligned host memory zero-copy
  static constexpr size_t kMinChunk = 32u << 20;   // grown in chunks of at least this

  explicit Arena(int device) : device_(device) {}
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
  };
  bool AddChunk(size_t at_least);

  const int device_;
  mutable std::mutex mu_;
  std::vector<Chunk> chunks_;
  std::map<uintptr_t, std::pair<size_t, size_t>> live_;  // addr -> (chunk, length)
  ArenaInfo info_;
};

Arena& ArenaFor(int device);
// Frees a block from whichever device's arena owns it.
bool ArenaFree(void* p);

}  // namespace strata
