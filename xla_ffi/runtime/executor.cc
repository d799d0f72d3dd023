#include "executor.h"

#include "spin_lock.h"
#include "stats.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <iterator>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <vector>

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

void NameThisThread(const char* name) { pthread_setname_np(pthread_self(), name); }

Phase Together(Phase a, Phase b) {
  Phase both;
  both.count = std::max(a.count, b.count);
  // Task i runs a's task i, then b's: neighbouring tasks of two plans over
  // the same rows (MoE backward's scale and dots, token by token) run on one
  // thread back to back, so what the first read is still in its cache for
  // the second (alternating them over the threads left that to the shared
  // cache, and the backward read its carried rows from memory twice).
  both.run = [a = std::move(a.run), b = std::move(b.run), a_count = a.count, b_count = b.count](uint64_t i) {
    if (i < a_count) a(i);
    if (i < b_count) b(i);
  };
  return both;
}

Phase Concat(Phase a, Phase b) {
  Phase both;
  both.count = a.count + b.count;
  both.run = [a = std::move(a.run), b = std::move(b.run), a_count = a.count](uint64_t i) {
    if (i < a_count) a(i);
    else b(i - a_count);
  };
  return both;
}

void Splice(Job* job, size_t after, Job&& more) {
  job->phases.insert(job->phases.begin() + static_cast<std::ptrdiff_t>(after) + 1,
                     std::make_move_iterator(more.phases.begin()), std::make_move_iterator(more.phases.end()));
  if (!more.on_done) return;
  job->on_done = [inner = std::move(more.on_done), outer = std::move(job->on_done)] {
    inner();
    if (outer) outer();
  };
}

void RunPhasesHere(Job* job) {
  for (size_t i = 0; i < job->phases.size(); ++i) {
    const Phase& phase = job->phases[i];
    for (uint64_t t = 0; t < phase.count; ++t) phase.run(t);
    if (phase.count == 0 || !phase.then) continue;
    Job more;
    job->phases[i].then(&more);
    Splice(job, i, std::move(more));
  }
  job->phases.clear();
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
    for (int i = 0; i < HostWorkers(); ++i) {
      std::thread([this] {
        NameThisThread("strata-worker");
        WorkerLoop();
      }).detach();
    }
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
    if (r->job->phases[phase].then) {
      // Every task of the phase is done and the next phase is not open: no
      // one else touches this job's phases but under the lock, taken back
      // to splice them in.
      lock.unlock();
      Job more;
      r->job->phases[phase].then(&more);
      lock.lock();
      Splice(r->job.get(), phase, std::move(more));
    }
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

// Resumes ranks' XLA programs. Settling a rank's future runs the rest of its
// program on the settling thread, up to its next collective (which returns a
// pending future, freeing the thread) or its end. A few threads doing that for
// every rank in turn resume a 384-rank group without waking 384 threads (a
// context switch and a futex wake each, on 2 cores: the per-op cost at scale).
//
// A rank's program may also block on the way: in XLA's own collectives
// (lax.psum waits for every rank, some still queued here) or in long compute.
// So the pool is elastic: a monitor checks, every tick while work is queued,
// which threads are still on the task they had a tick ago; those are treated
// as blocked and as many new threads are put to work, so blocked ranks never
// keep queued ones from running (it doubles until they are all unblocked; an
// unbounded pool, like the thread per rank it replaces, cannot deadlock).
//
// Finding a blocked thread takes a tick, and a program that mixes strata ops
// with XLA's collectives pays it at every strata -> XLA step: the first
// resumed ranks block in XLA's rendezvous, which waits for the ranks queued
// behind them (4 chained all-reduces alternating strata/lax.psum on 8 ranks:
// 4.7 ms against 2.0 ms all-lax and 1.1 ms all-strata). So once the monitor
// has found a blocked thread, completions are spread for a while: each one
// queued gets a thread at once (a wake-up per rank, what a blocked rank
// needs anyway) instead of waiting for the next tick.
class Resumers {
 public:
  Resumers() : target_(HostWorkers()) {
    std::thread([this] {
      NameThisThread("strata-monitor");
      MonitorLoop();
    }).detach();
  }

  // Takes (moves out, then clears) the functions of `fns`.
  void Post(std::vector<std::function<void()>>& fns) {
    if (fns.empty()) return;
    std::unique_lock<SpinLock> lock(mu_);
    for (auto& fn : fns) queue_.push_back(std::move(fn));
    fns.clear();
    queued_.store(queue_.size(), std::memory_order_release);
    if (monitor_asleep_) {
      monitor_asleep_ = false;
      monitor_cv_.notify_one();
    }
    // Enough threads already looking for work: spinning ones take it.
    const int queued = static_cast<int>(queue_.size());
    const int wanted = Spreading() ? queued - spinning_ - woken_ : target_ - busy_ - spinning_ - woken_;
    PutToWorkLocked(std::min<int>(wanted, queued));
  }

 private:
  struct Worker {
    std::atomic<uint64_t> task{0};  // ordinal of the task it is running; 0 idle
    uint64_t seen = 0;              // the monitor's last look at `task`
  };

  static constexpr auto kTick = std::chrono::microseconds(500);
  // How long a thread out of work polls for more before sleeping: the next
  // op's completions come within tens of microseconds in a busy program.
  static constexpr auto kSpin = std::chrono::microseconds(50);
  static constexpr auto kIdleExit = std::chrono::seconds(30);
  // How long completions stay spread after the monitor last found a resumer
  // blocked (a program that blocks, blocks again at its next step).
  static constexpr auto kSpreadFor = std::chrono::seconds(1);

  static int64_t NowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  bool Spreading() const { return NowNs() < spread_until_ns_.load(std::memory_order_relaxed); }

  // Wakes `count` sleeping threads, starting new ones when too few sleep.
  // Caller holds mu_.
  void PutToWorkLocked(int count) {
    for (int i = 0; i < count; ++i) {
      if (idle_ > woken_) {
        woken_++;
        cv_.notify_one();
      } else {
        StartThreadLocked();
      }
    }
  }

  // Caller holds mu_.
  void StartThreadLocked() {
    const bool permanent = static_cast<int>(workers_.size()) < target_;
    Worker* w;
    if (!spare_.empty()) {
      w = spare_.back();
      spare_.pop_back();
    } else {
      w = new Worker;  // never freed: kept in spare_ when its thread exits
    }
    w->seen = 0;
    workers_.push_back(w);
    busy_++;  // counts as looking for work until it first waits
    std::thread([this, w, permanent] {
      NameThisThread("strata-resume");
      Loop(w, permanent);
    }).detach();
  }

  void Loop(Worker* w, bool permanent) {
    std::unique_lock<SpinLock> lock(mu_);
    busy_--;
    for (;;) {
      if (queue_.empty()) {
        spinning_++;
        lock.unlock();
        const auto until = std::chrono::steady_clock::now() + kSpin;
        while (queued_.load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < until)
          std::this_thread::yield();
        lock.lock();
        spinning_--;
      }
      if (queue_.empty()) {
        idle_++;
        const auto deadline = std::chrono::steady_clock::now() + kIdleExit;
        bool got = true;
        while (queue_.empty()) {
          const bool timed_out = cv_.wait_until(lock, deadline) == std::cv_status::timeout;
          // Whoever woke us counted us as on the way: we are, or back asleep.
          if (woken_ > 0) woken_--;
          if (timed_out && queue_.empty()) {
            got = false;
            break;
          }
        }
        idle_--;
        if (!got && !permanent) {
          workers_.erase(std::find(workers_.begin(), workers_.end(), w));
          spare_.push_back(w);
          return;
        }
        if (!got) continue;
      }
      std::function<void()> fn = std::move(queue_.front());
      queue_.pop_front();
      queued_.store(queue_.size(), std::memory_order_release);
      busy_++;
      w->task.store(++next_task_, std::memory_order_relaxed);
      lock.unlock();
      fn();
      fn = nullptr;  // its captures go now, not after the next wait
      lock.lock();
      w->task.store(0, std::memory_order_relaxed);
      busy_--;
    }
  }

  void MonitorLoop() {
    std::unique_lock<SpinLock> lock(mu_);
    int quiet_ticks = 0;
    for (;;) {
      if (queue_.empty() && ++quiet_ticks > 200) {
        // Nothing queued for a while: sleep until work comes (Post wakes us).
        monitor_asleep_ = true;
        monitor_cv_.wait(lock, [&] { return !monitor_asleep_; });
        quiet_ticks = 0;
      }
      lock.unlock();
      std::this_thread::sleep_for(kTick);
      lock.lock();
      if (queue_.empty()) continue;
      quiet_ticks = 0;
      int blocked = 0, running = 0;
      for (Worker* w : workers_) {
        const uint64_t task = w->task.load(std::memory_order_relaxed);
        if (task == 0) {
          w->seen = 0;
          continue;
        }
        (task == w->seen ? blocked : running)++;
        w->seen = task;
      }
      if (blocked > 0) {
        GlobalStats().resumers_blocked += blocked;
        spread_until_ns_.store(NowNs() + std::chrono::duration_cast<std::chrono::nanoseconds>(kSpreadFor).count(),
                               std::memory_order_relaxed);
      }
      if (running + spinning_ + woken_ >= target_) continue;
      // One fresh thread per blocked one (at least the shortfall): ranks that
      // block in XLA's collectives all need a thread before any of them can go.
      const int add = std::max(target_ - running - spinning_ - woken_, blocked);
      PutToWorkLocked(std::min<int>(add, static_cast<int>(queue_.size())));
    }
  }

  const int target_;
  SpinLock mu_;  // taken once per resumed rank by several threads: see spin_lock.h
  std::condition_variable_any cv_, monitor_cv_;
  std::deque<std::function<void()>> queue_;
  std::atomic<size_t> queued_{0};  // queue_.size(), for pollers without the lock
  std::vector<Worker*> workers_, spare_;
  uint64_t next_task_ = 0;
  int busy_ = 0, idle_ = 0, spinning_ = 0, woken_ = 0;
  bool monitor_asleep_ = false;
  std::atomic<int64_t> spread_until_ns_{0};  // steady clock; see kSpreadFor
};

}  // namespace

namespace {
Resumers& GlobalResumers() {
  static Resumers* resumers = new Resumers();  // never destroyed: threads are detached
  return *resumers;
}
// The batch this thread is collecting (see CompletionBatch), or null.
thread_local std::vector<std::function<void()>>* t_batch = nullptr;
// What the outermost batch of this thread collects into: kept, so a batch
// does not grow (allocate) a vector of its own several times per op.
thread_local std::vector<std::function<void()>> t_batch_fns;
}  // namespace

void Complete(std::function<void()> fn) {
  CompletionBatch one;  // the one that is open already, if any, takes it
  t_batch->push_back(std::move(fn));
}

CompletionBatch::CompletionBatch() : outer_(t_batch != nullptr) {
  if (!outer_) t_batch = &t_batch_fns;
}

CompletionBatch::~CompletionBatch() {
  if (outer_) return;
  t_batch = nullptr;
  GlobalResumers().Post(t_batch_fns);
}

void Submit(std::shared_ptr<Job> job, bool help) { Global().Submit(std::move(job), help); }

}  // namespace strata
