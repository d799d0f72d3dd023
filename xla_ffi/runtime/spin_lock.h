// A lock for the rendezvous' short critical sections, taken by every rank of
// every op. Hundreds of device threads share two cores: a std::mutex whose
// holder is preempted puts every contender to sleep in the kernel, and each
// unlock then pays a futex wake-up (a cross-CPU interrupt in a VM), one after
// another (perf on 384 ranks: futex_wake was the largest single cost). Here a
// contender spins briefly, then yields its core (to the holder, among others)
// and never sleeps, so no unlock has anyone to wake.
#pragma once
#include <atomic>
#include <thread>

namespace strata {

class SpinLock {
 public:
  void lock() {
    for (int spins = 0;; ++spins) {
      if (!locked_.exchange(true, std::memory_order_acquire)) return;
      while (locked_.load(std::memory_order_relaxed)) {
        if (++spins > kSpinsBeforeYield) std::this_thread::yield();
      }
    }
  }
  bool try_lock() { return !locked_.load(std::memory_order_relaxed) && !locked_.exchange(true, std::memory_order_acquire); }
  void unlock() { locked_.store(false, std::memory_order_release); }

 private:
  static constexpr int kSpinsBeforeYield = 64;
  std::atomic<bool> locked_{false};
};

}  // namespace strata
