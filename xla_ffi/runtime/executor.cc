#include "executor.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>

namespace strata {

int HostWorkers() {
  static const int workers = [] {
    const char* env = std::getenv("STRATA_HOST_WORKERS");
    int n = env ? std::atoi(env) : 0;
    if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
    return std::max(1, n);
  }();
  return workers;
}

namespace {

struct Running {
  std::shared_ptr<Job> job;
  size_t phase = 0;
  uint64_t next = 0;  // next task to claim in `phase`
  uint64_t done = 0;  // finished tasks of `phase`
};

// Skips empty phases; true when the job has no phase left.
bool SettlePhase(Running& r) {
  while (r.phase < r.job->phases.size() && r.job->phases[r.phase].count == 0) r.phase++;
  return r.phase == r.job->phases.size();
}

class Executor {
 public:
  Executor() {
    for (int i = 0; i < HostWorkers(); ++i) std::thread([this] { WorkerLoop(); }).detach();
  }

  void Submit(std::shared_ptr<Job> job, bool help) {
    auto r = std::make_shared<Running>();
    r->job = std::move(job);
    if (SettlePhase(*r)) {
      if (r->job->on_done) r->job->on_done();
      return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    queue_.push_back(r);
    cv_.notify_all();
    if (!help) return;
    // The submitting thread works on its own job until nothing is left to
    // claim: it is busy, never waiting, and the op needs one wake-up fewer.
    while (r->phase < r->job->phases.size() && r->next < r->job->phases[r->phase].count) {
      const size_t phase = r->phase;
      const uint64_t index = r->next++;
      RunClaimed(lock, r, phase, index);
    }
  }

 private:
  // Claims a task from the oldest job that has one to hand out in its
  // current phase. Caller holds mu_.
  bool Claim(std::shared_ptr<Running>* r, size_t* phase, uint64_t* index) {
    for (auto& candidate : queue_) {
      const Phase& p = candidate->job->phases[candidate->phase];
      if (candidate->next < p.count) {
        *r = candidate;
        *phase = candidate->phase;
        *index = candidate->next++;
        return true;
      }
    }
    return false;
  }

  // Runs a claimed task (lock released meanwhile); whoever finishes a phase's
  // last task opens the next phase or finishes the job.
  void RunClaimed(std::unique_lock<std::mutex>& lock, const std::shared_ptr<Running>& r,
                  size_t phase, uint64_t index) {
    lock.unlock();
    r->job->phases[phase].run(index);
    lock.lock();
    if (++r->done < r->job->phases[phase].count) return;
    r->phase++;
    r->next = r->done = 0;
    if (!SettlePhase(*r)) {
      cv_.notify_all();
      return;
    }
    queue_.erase(std::find(queue_.begin(), queue_.end(), r));
    lock.unlock();
    if (r->job->on_done) r->job->on_done();
    lock.lock();
  }

  void WorkerLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      std::shared_ptr<Running> r;
      size_t phase;
      uint64_t index;
      if (!Claim(&r, &phase, &index)) {
        cv_.wait(lock);
        continue;
      }
      RunClaimed(lock, r, phase, index);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Running>> queue_;
};

Executor& Global() {
  static Executor* e = new Executor();  // never destroyed: workers are detached
  return *e;
}

// Unbounded on purpose: a bounded pool deadlocks the same way one thread does.
class CompletionThreads {
 public:
  void Post(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(fn));
    if (queue_.size() > idle_) {
      std::thread([this] { Loop(); }).detach();
    } else {
      cv_.notify_one();
    }
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      idle_++;
      const bool got = cv_.wait_for(lock, std::chrono::seconds(30), [&] { return !queue_.empty(); });
      idle_--;
      if (!got) return;
      std::function<void()> fn = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  size_t idle_ = 0;
};

}  // namespace

void Complete(std::function<void()> fn) {
  static CompletionThreads* threads = new CompletionThreads();  // threads are detached
  threads->Post(std::move(fn));
}

void Submit(std::shared_ptr<Job> job, bool help) { Global().Submit(std::move(job), help); }

}  // namespace strata
