// The host worker pool that executes collectives: as many threads as the
// machine has cores (STRATA_HOST_WORKERS overrides), shared by every op of
// every group. XLA's handler threads never wait here: a handler joins its
// group and returns a future; once the group is complete its work runs as a
// Job on these workers, and the job's completion fulfils every rank's future.
// A blocked handler would hold one of XLA's own pool threads, and enough of
// them starve the very computations the missing peers still have to run.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "status.h"

namespace strata {

struct Job;

// `count` independent tasks; a phase starts when the previous one finished.
struct Phase {
  uint64_t count = 0;
  std::function<void(uint64_t)> run;
  // Optional: runs once after the phase's last task, on the thread that ran
  // it (no lock held), before the next phase opens. The phases it puts in
  // `more` run next, and an on_done it sets there runs before the job's own.
  // How work whose shape an earlier phase works out joins its job: MoE
  // dispatch's plan is built from the slots its first phase assigns. A phase
  // with `then` must have tasks (an empty phase is skipped, then and all).
  std::function<void(Job* more)> then;
};

// Two phases whose tasks are independent as one: task i runs a's task i,
// then b's (the phases' counts may differ); neither may have a `then`.
Phase Together(Phase a, Phase b);

// Two phases whose tasks are independent as one: a's tasks, then b's (in
// claim order: a's are taken first); neither may have a `then`.
Phase Concat(Phase a, Phase b);

struct Job {
  std::vector<Phase> phases;
  // Called once, after the last task of the last phase, on a worker thread.
  std::function<void()> on_done;
};

// Appends `more` (what a phase's `then` produced) to `job` after phase
// `after`: its phases next, its on_done before the job's own.
void Splice(Job* job, size_t after, Job&& more);

// Runs every phase of `job` on the calling thread, in order, with what their
// `then`s add; leaves the job without phases and with the on_done still to
// run (the small ops a group's last rank runs on the spot).
void RunPhasesHere(Job* job);

int HostWorkers();

// Names the calling thread (at most 15 characters: Linux's limit), so top,
// perf and profilers tell strata's threads from XLA's: a thread started by
// std::thread otherwise inherits the name of whichever thread started it.
void NameThisThread(const char* name);

// Queues `job`; it runs on the host workers. With `help`, the calling thread
// also runs the job's tasks until none is left to claim (it never waits for
// tasks others are running). A job without tasks completes at once, on the
// calling thread.
void Submit(std::shared_ptr<Job> job, bool help = false);

// Runs `fn` (a completion that resumes a rank's XLA program: fulfilling an
// XLA future runs the rest of that program on the fulfilling thread, up to its
// next pending collective) on the runtime's resumer threads: as many as the
// machine has cores, resuming ranks one after another, plus a fresh thread for
// each one found blocked for a tick (a rank that reaches XLA's own collective,
// lax.psum, waits there for ranks still queued behind it; see Resumers in
// executor.cc). Never blocks the caller.
void Complete(std::function<void()> fn);

// While one is alive, Complete() calls on this thread are collected and handed
// over together when it ends: a group's completions queue under one lock
// instead of one each against the threads already taking them (nested: the
// outermost one hands over).
class CompletionBatch {
 public:
  CompletionBatch();
  ~CompletionBatch();
  CompletionBatch(const CompletionBatch&) = delete;
  CompletionBatch& operator=(const CompletionBatch&) = delete;

 private:
  bool outer_;  // another batch of this thread is open: that one hands over
};

}  // namespace strata
