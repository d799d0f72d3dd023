// Python access to the registration-on-allocation arenas: a block comes back
// as a numpy array that owns it, so the block returns to its arena exactly
// when the last reference (in the end, JAX's buffer) goes away.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <new>

#include "../runtime/arena.h"

namespace nb = nanobind;

void BindMemory(nb::module_& m) {
  m.def("arena_buffer", [](int device, size_t nbytes) {
    void* p = strata::ArenaFor(device).Allocate(nbytes);
    if (!p) throw std::bad_alloc();
    nb::capsule owner(p, [](void* q) noexcept { strata::ArenaFree(q); });
    size_t shape[1] = {nbytes};
    return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(p, 1, shape, owner);
  });
  m.def("arena_info", [](int device) {
    strata::ArenaInfo i = strata::ArenaFor(device).Info();
    nb::dict d;
    d["chunks"] = i.chunks;
    d["bytes_reserved"] = i.bytes_reserved;
    d["bytes_in_use"] = i.bytes_in_use;
    d["live_blocks"] = i.live_blocks;
    d["allocations"] = i.allocations;
    return d;
  });
}
