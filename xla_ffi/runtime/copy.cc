#include "copy.h"

#include <atomic>

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define STRATA_HAVE_STREAMING 1
#endif

namespace strata {

void CopyBytes(void* dst, const void* src, size_t n, bool streaming) {
#ifdef STRATA_HAVE_STREAMING
  // Below a few cache lines the alignment head costs more than it saves.
  if (streaming && n >= 256) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    // Non-temporal stores need 16-byte aligned destinations: copy the head.
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    std::memcpy(d + i, s + i, n - i);
    return;
  }
#endif
  (void)streaming;
  std::memcpy(dst, src, n);
}

void StoreFence() {
#ifdef STRATA_HAVE_STREAMING
  _mm_sfence();
#endif
}

namespace {
// Bytes of the last-level cache one core shares, as the kernel describes it
// (cpu0's deepest data or unified cache in sysfs); -1 if none.
long SysfsLastLevelCacheBytes() {
  long best_level = 0, bytes = -1;
  for (int index = 0; index < 16; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
    long level = 0;
    std::string type, size;
    if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) break;
    if (type == "Instruction" || level < best_level || size.empty()) continue;
    char* unit = nullptr;
    const long value = std::strtol(size.c_str(), &unit, 10);
    const long scale = *unit == 'K' ? 1L << 10 : *unit == 'M' ? 1L << 20 : *unit == 'G' ? 1L << 30 : 1;
    if (value > 0) best_level = level, bytes = value * scale;
  }
  return bytes;
}

int64_t DefaultStreamingThreshold() {
  // STRATA_STREAM_BYTES overrides it (A/B measurements; 0 streams always).
  if (const char* env = std::getenv("STRATA_STREAM_BYTES")) return static_cast<int64_t>(std::atoll(env));
  // sysfs first: glibc's sysconf can report the host's whole L3 to a guest
  // (320 MiB on this project's 32 MiB AMD VMs), which kept 151 MB outputs on
  // plain stores, 1.2-1.5x slower than streaming them.
  long llc = SysfsLastLevelCacheBytes();
#ifdef _SC_LEVEL3_CACHE_SIZE
  if (llc <= 0) llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
  if (llc <= 0) llc = 32L << 20;
  return static_cast<int64_t>(llc) / 2;
}

std::atomic<int64_t>& Threshold() {
  static std::atomic<int64_t> threshold{DefaultStreamingThreshold()};
  return threshold;
}
}  // namespace

int64_t StreamingThresholdBytes() { return Threshold().load(std::memory_order_relaxed); }

int64_t SetStreamingThresholdBytes(int64_t bytes) {
  return Threshold().exchange(bytes < 0 ? DefaultStreamingThreshold() : bytes);
}

}  // namespace strata
