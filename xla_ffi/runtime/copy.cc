#include "copy.h"

#include <atomic>

#include <unistd.h>

#include <cstdlib>
#include <cstring>

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
int64_t DefaultStreamingThreshold() {
  // STRATA_STREAM_BYTES overrides it (A/B measurements; 0 streams always).
  if (const char* env = std::getenv("STRATA_STREAM_BYTES")) return static_cast<int64_t>(std::atoll(env));
  long llc = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
  llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
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
