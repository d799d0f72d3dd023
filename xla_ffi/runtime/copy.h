// Plain copies for the emulated DMA engines and the reduction kernels' stores.
#pragma once
#include <cstddef>
#include <cstdint>

namespace strata {

// Copies n bytes. With `streaming`, the destination is written with
// non-temporal stores: they skip the read-for-ownership of every destination
// line and do not evict the sources from cache, which is most of the cost of
// writing an output that will not fit in cache anyway (an all_gather of 1 MB
// per rank over 8 ranks writes 64 MB). Call StoreFence() before other threads
// may read what was streamed.
void CopyBytes(void* dst, const void* src, size_t n, bool streaming);

// Orders this thread's streaming stores before its later stores (the
// completion signal other threads wait on).
void StoreFence();

// Group output size from which ops stream their stores: half the last-level
// cache (sources and outputs cannot both stay cached beyond it), or
// STRATA_STREAM_BYTES when set.
int64_t StreamingThresholdBytes();
// Whether a group whose ranks each write `out_bytes_per_rank` streams its stores.
inline bool StreamsOutputs(int64_t out_bytes_per_rank, int64_t group_size) {
  return out_bytes_per_rank * group_size >= StreamingThresholdBytes();
}
// For tests and A/B runs: sets the threshold (< 0: back to the default) and
// returns the previous one. Ops read it when they start.
int64_t SetStreamingThresholdBytes(int64_t bytes);

}  // namespace strata
