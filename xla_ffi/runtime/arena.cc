#include "arena.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>

#include "registry.h"

namespace strata {

namespace {
size_t RoundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

bool Arena::AddChunk(size_t at_least) {
  if (at_least > (SIZE_MAX >> 1)) return false;
  const size_t size = RoundUp(std::max(at_least, kMinChunk), 2u << 20);
  void* mem = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return false;
#ifdef MADV_HUGEPAGE
  madvise(mem, size, MADV_HUGEPAGE);
#endif
  // Fault every page in now, as a fabric pins registered memory, so no op
  // ever pays a page fault on arena memory.
  std::memset(mem, 0, size);
  GlobalRegistry().Register(device_, reinterpret_cast<uintptr_t>(mem), static_cast<int64_t>(size));
  Chunk c{static_cast<char*>(mem), size, {}};
  c.free[0] = size;
  chunks_.emplace(reinterpret_cast<uintptr_t>(mem), std::move(c));
  info_.chunks++;
  info_.bytes_reserved += static_cast<int64_t>(size);
  return true;
}

void Arena::Release(std::map<uintptr_t, Chunk>::iterator it) {
  GlobalRegistry().Deregister(device_, it->first);
  munmap(it->second.base, it->second.size);
  info_.chunks--;
  info_.chunks_released++;
  info_.bytes_reserved -= static_cast<int64_t>(it->second.size);
  chunks_.erase(it);
}

void Arena::Trim() {
  // Keep the largest wholly free chunk that is small enough; release the rest.
  auto keep = chunks_.end();
  for (auto it = chunks_.begin(); it != chunks_.end(); ++it)
    if (it->second.Empty() && it->second.size <= kKeepFreeBytes &&
        (keep == chunks_.end() || it->second.size > keep->second.size))
      keep = it;
  for (auto it = chunks_.begin(); it != chunks_.end();) {
    auto next = std::next(it);
    if (it != keep && it->second.Empty()) Release(it);
    it = next;
  }

}

void* Arena::Allocate(size_t bytes) {
  if (bytes > (SIZE_MAX >> 1)) return nullptr;
  const size_t len = RoundUp(std::max<size_t>(bytes, 1), kAlign);
  std::lock_guard<std::mutex> lock(mu_);
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (auto& [base, c] : chunks_) {
      for (auto it = c.free.begin(); it != c.free.end(); ++it) {  // first fit
        if (it->second < len) continue;
        const size_t off = it->first, rest = it->second - len;
        c.free.erase(it);
        if (rest) c.free[off + len] = rest;
        char* p = c.base + off;
        live_[reinterpret_cast<uintptr_t>(p)] = {base, len};
        info_.bytes_in_use += static_cast<int64_t>(len);
        info_.live_blocks++;
        info_.allocations++;
        return p;
      }
    }
    if (attempt > 0) break;
    // Nothing fits: wholly free chunks are too small for this request;
    // return them before mapping a bigger one.
    for (auto it = chunks_.begin(); it != chunks_.end();) {
      auto next = std::next(it);
      if (it->second.Empty()) Release(it);
      it = next;
    }
    if (!AddChunk(len)) return nullptr;
  }
  return nullptr;
}

bool Arena::Free(void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(p));
  if (it == live_.end()) return false;
  const uintptr_t base = it->second.first;
  const size_t block_len = it->second.second;
  size_t len = block_len;
  live_.erase(it);
  Chunk& c = chunks_.at(base);
  size_t off = static_cast<char*>(p) - c.base;
  // Coalesce with the neighbours so the arena does not fragment over cycles.
  auto next = c.free.lower_bound(off);
  if (next != c.free.end() && next->first == off + len) {
    len += next->second;
    next = c.free.erase(next);
  }
  if (next != c.free.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      len = 0;
    }
  }
  if (len) c.free[off] = len;
  info_.bytes_in_use -= static_cast<int64_t>(block_len);
  info_.live_blocks--;
  if (c.Empty()) Trim();
  return true;
}

bool Arena::Owns(const void* p) const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.count(reinterpret_cast<uintptr_t>(p)) != 0;
}

ArenaInfo Arena::Info() {
  std::lock_guard<std::mutex> lock(mu_);
  return info_;
}

namespace {
// Never destroyed: detached runtime threads (workers, the watchdog,
// completion threads) may still touch these while the process exits.
std::mutex& g_arenas_mu = *new std::mutex;
std::map<int, std::unique_ptr<Arena>>& g_arenas = *new std::map<int, std::unique_ptr<Arena>>;
}  // namespace

Arena& ArenaFor(int device) {
  std::lock_guard<std::mutex> lock(g_arenas_mu);
  auto& a = g_arenas[device];
  if (!a) a = std::make_unique<Arena>(device);
  return *a;
}

bool ArenaFree(void* p) {
  std::vector<Arena*> arenas;
  {
    std::lock_guard<std::mutex> lock(g_arenas_mu);
    for (auto& kv : g_arenas) arenas.push_back(kv.second.get());
  }
  for (Arena* a : arenas)
    if (a->Free(p)) return true;
  return false;
}

}  // namespace strata
