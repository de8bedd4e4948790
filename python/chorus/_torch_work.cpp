/*
 * _torch_work.cpp - ChorusWork, the handle of one operation (wait, test,
 * the Future, finishing once: copy-backs, then c10d::Work::finish), and the
 * completion thread that finishes the Works whose Future was asked for.
 */
#include "_torch.h"

#include <ATen/record_function.h>

namespace chorus_torch {

ChorusWork::ChorusWork(int rank, OpType type, const char* title,
                       const std::vector<at::Tensor>* inputs, std::shared_ptr<Comm> comm,
                       std::shared_ptr<Completer> completer, std::vector<at::Tensor> outputs,
                       std::vector<at::Tensor> keep, TensorPairs copies, int srcRank)
    : c10d::Work(rank, type, profiling() ? title : nullptr,
                 profiling() && inputs ? c10::optional<std::vector<at::Tensor>>(*inputs)
                                       : c10::nullopt),
      comm_(std::move(comm)),
      completer_(std::move(completer)),
      outputs_(std::move(outputs)),
      keep_(std::move(keep)),
      copies_(std::move(copies)),
      srcRank_(srcRank),
      title_(title) {}

ChorusWork::~ChorusWork() {
  if (!h_) return;
  try {
    if (!finishing()) {
      GilRelease nogil;
      chorus_result_t rc = chorus_work_wait(h_, -1);
      complete(rc);
    }
  } catch (...) {
  }
  chorus_work_free(h_);
}

bool ChorusWork::isCompleted() {
  if (done()) return true;
  chorus_result_t rc = chorus_work_test(h_);
  if (rc == CHORUS_INPROGRESS) return false;
  complete(rc);
  return done();
}

bool ChorusWork::wait(std::chrono::milliseconds timeout) {
  if (!done()) {
    int ms = -1;
    if (timeout != kNoTimeout)
      ms = static_cast<int>(std::min<int64_t>(std::max<int64_t>(timeout.count(), 0), INT_MAX));
    chorus_result_t rc = chorus_work_wait(h_, ms);
    if (rc == CHORUS_INPROGRESS)
      fail(c10::str("chorus: ", title_, " did not complete within the ", ms,
                    " ms given to Work.wait() (it continues in the background; the "
                    "communicator's own timeout, CHORUS_TIMEOUT or init_process_group's "
                    "timeout, fails it if a peer never takes part)"));
    if (!complete(rc)) awaitFinish();
  }
  std::lock_guard<std::mutex> g(finishMu_);
  if (error_) std::rethrow_exception(error_);
  return true;
}

int ChorusWork::sourceRank() const {
  if (srcRank_ == kFromAnyRank) {
    int src = chorus_work_source(h_);
    if (src < 0)
      fail("chorus recv: sourceRank() of a receive from any source is known once it has "
           "completed successfully: wait() first");
    return src;
  }
  if (srcRank_ < 0)
    fail("sourceRank() may only be called on work objects that correspond to a recv");
  return srcRank_;
}

c10::intrusive_ptr<c10::ivalue::Future> ChorusWork::getFuture() {
  if (!registered_.exchange(true) && !finishing()) {
    // On the completion thread (a callback asking for another Work's
    // future, as torch's PowerSGD hook does and then waits on it), finish
    // it here: queued behind the callback it would never complete.
    if (!completer_ || completer_->onThread() ||
        !completer_->enqueue(c10::intrusive_ptr<ChorusWork>::reclaim_copy(this))) {
      GilRelease nogil;
      complete(chorus_work_wait(h_, -1));
    }
  }
  return future();
}

// The completion thread's part: wait for the outcome and finish.
void ChorusWork::completeBlocking() {
  if (finishing()) return;
  complete(chorus_work_wait(h_, -1));
}

// Finishes the Work once; true when this call did it.
bool ChorusWork::complete(chorus_result_t rc) {
  {
    std::lock_guard<std::mutex> g(finishMu_);
    if (finishing_) return false;
    finishing_ = true;
    finisher_ = std::this_thread::get_id();
  }
  std::exception_ptr e;
  if (rc == CHORUS_OK) {
    try {
      at::AutoDispatchBelowAutograd guard;
      for (auto& c : copies_) c.first.copy_(c.second);
    } catch (...) {
      e = std::current_exception();
    }
  } else {
    const char* msg = chorus_work_error(h_);
    e = std::make_exception_ptr(std::runtime_error(resultText(rc, msg)));
  }
  copies_.clear();
  keep_.clear();
  {
    std::lock_guard<std::mutex> g(finishMu_);
    error_ = e;  // known before the Future's callbacks run (they may wait())
  }
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> g(futureMu_);
    outcomeKnown_ = true;
    f = future_;
  }
  if (f) settle(f, e);  // else future() completes it when asked for
  finish(e);
  return true;
}

bool ChorusWork::profiling() { return at::hasCallbacks(); }

const c10::TypePtr& ChorusWork::listOfTensors() {
  static const c10::TypePtr t = c10::ListType::create(c10::TensorType::get());
  return t;
}

const c10::TypePtr& ChorusWork::listOfLists() {
  static const c10::TypePtr t = c10::ListType::create(listOfTensors());
  return t;
}

c10::IValue ChorusWork::value() const {
  if (nested_.empty()) return c10::IValue(outputs_);
  c10::List<c10::List<at::Tensor>> v;
  for (auto& l : nested_) v.push_back(c10::List<at::Tensor>(l));
  return c10::IValue(v);
}

bool ChorusWork::done() {
  std::lock_guard<std::mutex> g(mutex_);
  return completed_;
}

// The Future, made on first use: most calls are waited for and never
// asked for one, and making and completing it was a tenth of a small
// call's cost.  Asked for after the outcome is known, it is completed
// here; before, complete() completes it.  Exactly one of the two does.
c10::intrusive_ptr<c10::ivalue::Future> ChorusWork::future() {
  c10::intrusive_ptr<c10::ivalue::Future> f;
  bool settleHere = false;
  {
    std::lock_guard<std::mutex> g(futureMu_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(nested_.empty() ? listOfTensors()
                                                                          : listOfLists());
      settleHere = outcomeKnown_;
    }
    f = future_;
  }
  if (settleHere) {
    std::exception_ptr e;
    {
      std::lock_guard<std::mutex> g(finishMu_);
      e = error_;
    }
    settle(f, e);
  }
  return f;
}

void ChorusWork::settle(const c10::intrusive_ptr<c10::ivalue::Future>& f, std::exception_ptr e) {
  try {
    if (e)
      f->setError(e);
    else
      f->markCompleted(value());
  } catch (...) {
    // A callback of the Future threw: it must not escape the finishing
    // thread (which may be the completion thread).
  }
}

bool ChorusWork::finishing() {
  std::lock_guard<std::mutex> g(finishMu_);
  return finishing_;
}

// Another thread is finishing: wait until it has (unless this thread is
// that one, called back from the Future's callbacks).
void ChorusWork::awaitFinish() {
  {
    std::lock_guard<std::mutex> g(finishMu_);
    if (finisher_ == std::this_thread::get_id()) return;
  }
  std::unique_lock<std::mutex> l(mutex_);
  cv_.wait(l, [&] { return completed_; });
}

// ------------------------------------------------------ completion thread

bool Completer::enqueue(c10::intrusive_ptr<ChorusWork> w) {
  std::lock_guard<std::mutex> g(mu_);
  if (stop_) return false;
  // The thread owns a reference: a callback may drop the group's last one
  // (shutdown then detaches the thread, which must not outlive *this).
  if (!th_.joinable()) th_ = std::thread([self = shared_from_this()] { self->run(); });
  q_.push_back(std::move(w));
  cv_.notify_one();
  return true;
}

void Completer::run() {
  for (;;) {
    c10::intrusive_ptr<ChorusWork> w;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;  // stopping, and nothing left to finish
      w = std::move(q_.front());
      q_.pop_front();
    }
    try {
      w->completeBlocking();
    } catch (...) {
    }
    w.reset();
  }
}

void Completer::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (th_.joinable()) {
    if (th_.get_id() == std::this_thread::get_id()) {
      th_.detach();  // the group died in one of its own callbacks
    } else {
      GilRelease nogil;
      th_.join();
    }
  }
}

}  // namespace chorus_torch
