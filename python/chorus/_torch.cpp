/*
 * _torch.cpp - chorus as a torch.distributed process-group backend (torch
 * 1.13's c10d::ProcessGroup), a thin C++17 shim over chorus.h.
 *
 * Every torch group (the default one and each new_group) is its own chorus
 * world, bootstrapped with chorus_comm_init_kv through the c10d::Store
 * (a PrefixStore per group) that torch hands to the creator.  Every
 * collective is issued in chorus's asynchronous form and wrapped in a
 * ChorusWork:
 *   - the Work holds every tensor the operation touches (and the contiguous
 *     temporaries it needed) until the operation completes;
 *   - completion ("finishing") happens once: copy the temporaries back into
 *     the caller's tensors, complete the Future (made only when asked for),
 *     then c10d::Work::finish;
 *   - wait() calls chorus_work_wait on the calling thread, which runs the
 *     operation right there when it has not started (the library's lazy
 *     start: a call waited at once, as dist.all_reduce does, wakes no
 *     other thread); isCompleted() calls chorus_work_test;
 *   - getFuture() hands the Work to a completion thread of its process group
 *     (started on first use) so the Future completes even if nobody waits
 *     (DDP's reducer only calls getFuture).
 * Ownership: the chorus communicator lives in a shared Comm that the process
 * group and every Work hold, so chorus_work_free always precedes
 * chorus_comm_destroy.  The completion thread is joined by the process
 * group's destructor.
 * Errors: arguments are checked here (sizes and dtypes of every list entry,
 * roots, split sizes) and raise at call time; a collective that raises on
 * one rank enters a barrier in its place, so the ranks that did call it fail
 * with CHORUS_ERR_MISMATCH at once instead of waiting for the timeout (when
 * every rank made the same mistake, the barriers match and the group stays
 * usable).  The library's errors read "CHORUS_ERR_<CODE>: <its message>".
 * Non-contiguous tensors go through contiguous temporaries, copied back on
 * completion.
 *
 * ChorusStore is a c10d::Store over chorus's own (authenticated) store, for
 * jobs started by chorusrun, whose MASTER_ADDR:MASTER_PORT is that store
 * (python/chorus/torch.py uses it for env:// there).
 */
#include <torch/extension.h>

#include <ATen/MemoryOverlap.h>
#include <ATen/record_function.h>
#include <pybind11/chrono.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "chorus.h"

namespace chorus_torch {

using c10d::OpType;
using c10d::ReduceOp;
using TensorPairs = std::vector<std::pair<at::Tensor, at::Tensor>>;

// --------------------------------------------------------------- utilities

// Releases the GIL for a scope when this thread holds it (destructors that
// join threads or tear connections down may run from Python).
class GilRelease {
 public:
  GilRelease() {
    if (Py_IsInitialized() && !_Py_IsFinalizing() && PyGILState_Check())
      state_ = PyEval_SaveThread();
  }
  ~GilRelease() {
    if (state_) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

[[noreturn]] static void fail(const std::string& msg) {
  throw std::runtime_error(msg);
}

// The library refused a call (its message, prefixed with the code's name).
struct LibraryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// "CHORUS_ERR_...: what happened".  A timeout also says so in torch's
// words ("Timed out waiting", as Gloo says it), which torch's own tests
// and users' log scrapers look for; chorus's message follows, naming the
// call, the ranks waited for and what to do.
static std::string resultText(chorus_result_t rc, const char* msg) {
  std::string s = chorus_result_name(rc);
  s += ": ";
  if (rc == CHORUS_ERR_TIMEOUT) s += "Timed out waiting for other ranks: ";
  s += (msg && *msg) ? msg : chorus_strerror(rc);
  return s;
}

static std::string dtypeName(at::ScalarType t) {
  switch (t) {
    case at::kBool: return "torch.bool";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

static std::string sizesStr(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); i++) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  return s + "]";
}

static const char* redOpName(ReduceOp::RedOpType op) {
  switch (op) {
    case ReduceOp::SUM: return "SUM";
    case ReduceOp::AVG: return "AVG";
    case ReduceOp::PRODUCT: return "PRODUCT";
    case ReduceOp::MIN: return "MIN";
    case ReduceOp::MAX: return "MAX";
    case ReduceOp::BAND: return "BAND";
    case ReduceOp::BOR: return "BOR";
    case ReduceOp::BXOR: return "BXOR";
    case ReduceOp::PREMUL_SUM: return "PREMUL_SUM";
    default: return "UNUSED";
  }
}

// A dense CPU tensor, or a clear error naming the call.
static void checkTensor(const char* fn, const at::Tensor& t, const char* what) {
  if (!t.defined()) fail(c10::str("chorus ", fn, ": ", what, " is an undefined tensor"));
  if (!t.device().is_cpu())
    fail(c10::str("chorus ", fn, ": ", what, " is on ", t.device(),
                  "; chorus is a CPU backend (use nccl for CUDA tensors)"));
  if (t.layout() != c10::kStrided)
    fail(c10::str("chorus ", fn, ": ", what, " has layout ", t.layout(),
                  "; chorus supports dense (strided) tensors only"));
}

// The input and output of a one-tensor-each call (the *_base methods):
// both dense CPU tensors of one dtype.
static void checkPair(const char* fn, const at::Tensor& input, const at::Tensor& output) {
  checkTensor(fn, input, "the input");
  checkTensor(fn, output, "the output");
  if (output.scalar_type() != input.scalar_type())
    fail(c10::str("chorus ", fn, ": the output has dtype ", dtypeName(output.scalar_type()),
                  " but the input has ", dtypeName(input.scalar_type())));
}

// chorus's element type of t.  torch.bool travels as uint8 in ops that only
// move bytes (reducing == false).
static chorus_dtype_t dtypeOf(const char* fn, const at::Tensor& t, bool reducing) {
  switch (t.scalar_type()) {
    case at::kChar: return CHORUS_INT8;
    case at::kByte: return CHORUS_UINT8;
    case at::kInt: return CHORUS_INT32;
    case at::kLong: return CHORUS_INT64;
    case at::kHalf: return CHORUS_FLOAT16;
    case at::kBFloat16: return CHORUS_BFLOAT16;
    case at::kFloat: return CHORUS_FLOAT32;
    case at::kDouble: return CHORUS_FLOAT64;
    case at::kBool:
      if (!reducing) return CHORUS_UINT8;
      fail(c10::str("chorus ", fn, ": dtype torch.bool not supported by chorus in reductions "
                    "(convert to torch.uint8; bool is supported by the ops that only move data)"));
    default:
      fail(c10::str("chorus ", fn, ": dtype ", dtypeName(t.scalar_type()),
                    " not supported by chorus (supported: int8, uint8, int32, int64, float16, "
                    "bfloat16, float32, float64; bool in ops that do not reduce)"));
  }
}

static bool isIntegral(chorus_dtype_t d) {
  return d == CHORUS_INT8 || d == CHORUS_UINT8 || d == CHORUS_INT32 || d == CHORUS_INT64;
}

// chorus's op for a torch ReduceOp (PREMUL_SUM is SUM after scaling the input).
static chorus_op_t opOf(const char* fn, const ReduceOp& op, chorus_dtype_t dt) {
  switch (op.op_) {
    case ReduceOp::SUM: return CHORUS_SUM;
    case ReduceOp::PREMUL_SUM: return CHORUS_SUM;
    case ReduceOp::AVG: return CHORUS_AVG;
    case ReduceOp::PRODUCT: return CHORUS_PROD;
    case ReduceOp::MIN: return CHORUS_MIN;
    case ReduceOp::MAX: return CHORUS_MAX;
    case ReduceOp::BAND:
    case ReduceOp::BOR:
    case ReduceOp::BXOR:
      if (!isIntegral(dt))
        fail(c10::str("chorus ", fn, ": ReduceOp.", redOpName(op.op_),
                      " is defined for integer dtypes only, not ", chorus_dtype_name(dt)));
      return op.op_ == ReduceOp::BAND ? CHORUS_BAND
             : op.op_ == ReduceOp::BOR ? CHORUS_BOR
                                       : CHORUS_BXOR;
    default:
      fail(c10::str("chorus ", fn, ": ReduceOp ", static_cast<int>(op.op_),
                    " not supported by chorus"));
  }
}

// The tensor PREMUL_SUM reduces: a copy of t multiplied by the factor the
// ReduceOp carries (index idx of the tensor factors, if it has those).
static at::Tensor premulInput(const char* fn, const ReduceOp& op, const at::Tensor& t,
                              size_t idx) {
  if (!at::isFloatingType(t.scalar_type()))
    fail(c10::str("chorus ", fn, ": PREMUL_SUM needs a floating-point tensor, not ",
                  dtypeName(t.scalar_type())));
  auto* sup = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  if (!sup) fail(c10::str("chorus ", fn, ": PREMUL_SUM without its factor"));
  if (!sup->tensor_factors.empty()) {
    if (idx >= sup->tensor_factors.size())
      fail(c10::str("chorus ", fn, ": PREMUL_SUM has ", sup->tensor_factors.size(),
                    " tensor factors for tensor ", idx));
    at::Tensor f = sup->tensor_factors[idx];
    checkTensor(fn, f, "the PREMUL_SUM factor");
    if (f.numel() != 1) fail(c10::str("chorus ", fn, ": the PREMUL_SUM factor must be a scalar"));
    return at::mul(t, f.to(t.scalar_type())).contiguous();
  }
  return at::mul(t, sup->double_factor).contiguous();
}

static size_t nelem(const at::Tensor& t) {
  return static_cast<size_t>(t.numel());
}

// Byte ranges of two contiguous tensors intersect.
static bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  auto a0 = reinterpret_cast<uintptr_t>(a.data_ptr()), a1 = a0 + a.nbytes();
  auto b0 = reinterpret_cast<uintptr_t>(b.data_ptr()), b1 = b0 + b.nbytes();
  return a0 < b1 && b0 < a1;
}

static char* bytePtr(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

// ts are contiguous and lie one after the other in memory, each of the same
// size: one flat buffer that chorus can use as is.
static bool consecutive(const std::vector<at::Tensor>& ts) {
  if (ts.empty()) return false;
  const size_t nb = ts[0].nbytes();
  char* base = bytePtr(ts[0]);
  for (size_t i = 0; i < ts.size(); i++) {
    if (!ts[i].is_contiguous() || ts[i].nbytes() != nb) return false;
    if (nb && bytePtr(ts[i]) != base + i * nb) return false;
  }
  return true;
}

// A contiguous flat tensor over the consecutive tensors ts.
static at::Tensor flatOver(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (auto& t : ts) n += t.numel();
  if (n == 0) return at::empty({0}, ts[0].options());
  return at::from_blob(ts[0].data_ptr(), {n}, ts[0].options());
}

// An input chorus may read: t itself when contiguous, else a contiguous copy.
static at::Tensor inputBuffer(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

// An output chorus may write: t itself when contiguous, else a contiguous
// temporary that is copied into t when the operation completes.  An output
// with internal overlap (an expanded tensor) cannot hold a result.
static at::Tensor outputBuffer(const char* fn, const at::Tensor& t, TensorPairs& copies,
                               bool keepData) {
  if (t.is_contiguous()) return t;
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes)
    fail(c10::str("chorus ", fn, ": an output tensor has overlapping elements (e.g. made by "
                  "expand()); it cannot receive a result"));
  at::Tensor buf = keepData ? t.contiguous() : at::empty(t.sizes(), t.options());
  copies.emplace_back(t, buf);
  return buf;
}

// Packs ts into one contiguous flat tensor (a copy).
static at::Tensor pack(const std::vector<at::Tensor>& ts, const at::TensorOptions& opts) {
  int64_t n = 0;
  for (auto& t : ts) n += t.numel();
  at::Tensor flat = at::empty({n}, opts);
  int64_t off = 0;
  for (auto& t : ts) {
    if (t.numel()) flat.narrow(0, off, t.numel()).view(t.sizes()).copy_(t);
    off += t.numel();
  }
  return flat;
}

// Copy-backs from consecutive slices of flat into ts.
static void unpackInto(const at::Tensor& flat, const std::vector<at::Tensor>& ts,
                       TensorPairs& copies) {
  int64_t off = 0;
  for (auto& t : ts) {
    if (t.numel()) copies.emplace_back(t, flat.narrow(0, off, t.numel()).view(t.sizes()));
    off += t.numel();
  }
}

// Where PyTorch's own tests look for Gloo's words in a refusal, chorus's
// messages start with them ("invalid tensor type", "invalid root rank",
// ...) and give their own detail after (issue 42).
static void checkSameTypeAndSizes(const char* fn, const at::Tensor& expected,
                                  const at::Tensor& t, const std::string& what,
                                  const char* expectedWhat) {
  if (t.scalar_type() != expected.scalar_type())
    fail(c10::str("chorus ", fn, ": invalid tensor type: ", what, " has dtype ",
                  dtypeName(t.scalar_type()), " but ", expectedWhat, " has ",
                  dtypeName(expected.scalar_type())));
  if (t.sizes() != expected.sizes())
    fail(c10::str("chorus ", fn, ": invalid tensor size: ", what, " has sizes ", sizesStr(t),
                  " but ", expectedWhat, " has ", sizesStr(expected)));
}

static void checkSingle(const char* fn, size_t n, const char* what) {
  if (n != 1)
    fail(c10::str("chorus ", fn, ": takes exactly one ", what, " per rank (got ", n,
                  "); lists of several tensors per rank (the multi-device forms) are not "
                  "supported on CPU"));
}

// ----------------------------------------------------- communicator, thread

// The communicator, shared by the process group and its Works: destroyed
// after the last Work is freed.
struct Comm {
  chorus_comm_t comm = nullptr;
  std::mutex issueMu;  // issuing order == library order on this rank
  ~Comm() {
    if (comm) {
      GilRelease nogil;
      chorus_comm_destroy(comm);
    }
  }
};

class ChorusWork;

// Finishes, in order, the Works whose Future someone asked for.
class Completer : public std::enable_shared_from_this<Completer> {
 public:
  // false once the group is gone (the caller then finishes the Work itself).
  bool enqueue(c10::intrusive_ptr<ChorusWork> w);
  void shutdown();
  // True on the completion thread itself (a Future callback running there).
  bool onThread() {
    std::lock_guard<std::mutex> g(mu_);
    return th_.joinable() && th_.get_id() == std::this_thread::get_id();
  }
  ~Completer() { shutdown(); }

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<c10::intrusive_ptr<ChorusWork>> q_;
  bool stop_ = false;
  std::thread th_;
};

// ------------------------------------------------------------------- Work

class ChorusWork : public c10d::Work {
 public:
  ChorusWork(int rank, OpType type, const char* title, const std::vector<at::Tensor>* inputs,
             std::shared_ptr<Comm> comm, std::shared_ptr<Completer> completer,
             std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep,
             TensorPairs copies, int srcRank)
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

  ~ChorusWork() override {
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

  chorus_work_t* handle() { return &h_; }

  bool isCompleted() override {
    if (done()) return true;
    chorus_result_t rc = chorus_work_test(h_);
    if (rc == CHORUS_INPROGRESS) return false;
    complete(rc);
    return done();
  }

  bool wait(std::chrono::milliseconds timeout) override {
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

  void synchronize() override {}

  void abort() override { chorus_comm_abort(comm_->comm); }

  int sourceRank() const override {
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

  // srcRank of a receive from any source: sourceRank() asks the library.
  static constexpr int kFromAnyRank = -2;

  std::vector<at::Tensor> result() override { return outputs_; }
  // The Future's value is this list of lists (allgather with several
  // tensors per rank, as Gloo's); set before anyone can ask for it.
  void setNested(std::vector<std::vector<at::Tensor>> v) { nested_ = std::move(v); }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
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
  void completeBlocking() {
    if (finishing()) return;
    complete(chorus_work_wait(h_, -1));
  }

  // Finishes the Work once; true when this call did it.
  bool complete(chorus_result_t rc) {
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

 private:
  static bool profiling() { return at::hasCallbacks(); }
  static const c10::TypePtr& listOfTensors() {
    static const c10::TypePtr t = c10::ListType::create(c10::TensorType::get());
    return t;
  }
  static const c10::TypePtr& listOfLists() {
    static const c10::TypePtr t = c10::ListType::create(listOfTensors());
    return t;
  }
  c10::IValue value() const {
    if (nested_.empty()) return c10::IValue(outputs_);
    c10::List<c10::List<at::Tensor>> v;
    for (auto& l : nested_) v.push_back(c10::List<at::Tensor>(l));
    return c10::IValue(v);
  }

  bool done() {
    std::lock_guard<std::mutex> g(mutex_);
    return completed_;
  }

  // The Future, made on first use: most calls are waited for and never
  // asked for one, and making and completing it was a tenth of a small
  // call's cost.  Asked for after the outcome is known, it is completed
  // here; before, complete() completes it.  Exactly one of the two does.
  c10::intrusive_ptr<c10::ivalue::Future> future() {
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

  void settle(const c10::intrusive_ptr<c10::ivalue::Future>& f, std::exception_ptr e) {
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
  bool finishing() {
    std::lock_guard<std::mutex> g(finishMu_);
    return finishing_;
  }
  // Another thread is finishing: wait until it has (unless this thread is
  // that one, called back from the Future's callbacks).
  void awaitFinish() {
    {
      std::lock_guard<std::mutex> g(finishMu_);
      if (finisher_ == std::this_thread::get_id()) return;
    }
    std::unique_lock<std::mutex> l(mutex_);
    cv_.wait(l, [&] { return completed_; });
  }

  chorus_work_t h_ = nullptr;
  std::shared_ptr<Comm> comm_;
  std::shared_ptr<Completer> completer_;
  std::vector<at::Tensor> outputs_;  // the Future's value
  std::vector<std::vector<at::Tensor>> nested_;  // or this list of lists (see issue())
  std::vector<at::Tensor> keep_;     // alive until completion
  TensorPairs copies_;               // (caller's tensor, buffer) after success
  std::mutex futureMu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made by future()
  bool outcomeKnown_ = false;                       // complete() has decided
  int srcRank_;
  const char* title_;
  std::mutex finishMu_;
  bool finishing_ = false;
  std::thread::id finisher_;
  std::exception_ptr error_;  // the outcome, once finishing has decided it
  std::atomic<bool> registered_{false};
};

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

// ----------------------------------------------------------- bootstrapping

struct KvCtx {
  c10d::Store* store;
};

static int chorusKvSet(void* ctx, const char* key, const void* val, size_t len, char* err,
                       size_t errcap) {
  try {
    auto* p = static_cast<const uint8_t*>(val);
    std::vector<uint8_t> v(p, p + len);
    static_cast<KvCtx*>(ctx)->store->set(key, v);
    return 0;
  } catch (const std::exception& e) {
    if (err && errcap) std::snprintf(err, errcap, "torch store set('%s'): %s", key, e.what());
  } catch (...) {
    if (err && errcap) std::snprintf(err, errcap, "torch store set('%s'): unknown C++ exception", key);
  }
  return 1;
}

static int chorusKvGet(void* ctx, const char* key, void* val, size_t cap, size_t* len,
                       int timeout_ms, char* err, size_t errcap) {
  try {
    c10d::Store* store = static_cast<KvCtx*>(ctx)->store;
    auto tmo = timeout_ms > 0 ? std::chrono::milliseconds(timeout_ms) : store->getTimeout();
    store->wait({key}, tmo);
    std::vector<uint8_t> v = store->get(key);
    if (len) *len = v.size();
    if (val && cap) std::memcpy(val, v.data(), std::min(cap, v.size()));
    return 0;
  } catch (const std::exception& e) {
    if (err && errcap) std::snprintf(err, errcap, "torch store get('%s'): %s", key, e.what());
  } catch (...) {
    if (err && errcap) std::snprintf(err, errcap, "torch store get('%s'): unknown C++ exception", key);
  }
  return 1;
}

static int envInt(const char* name, int dflt) {
  const char* s = std::getenv(name);
  if (!s || !*s) return dflt;
  char* end = nullptr;
  long v = std::strtol(s, &end, 10);
  if (*end || v < INT_MIN || v > INT_MAX) return dflt;
  return static_cast<int>(v);
}

// torch's default process-group timeout (init_process_group's default).
static constexpr int64_t kTorchDefaultTimeoutMs = 30 * 60 * 1000;

// ------------------------------------------------------------ ProcessGroup

class ProcessGroupChorus : public c10d::ProcessGroup {
 public:
  ProcessGroupChorus(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout)
      : c10d::ProcessGroup(rank, size),
        comm_(std::make_shared<Comm>()),
        completer_(std::make_shared<Completer>()) {
    if (!store) fail("chorus: create_process_group needs a store");
    chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
    cfg.rank = rank;
    cfg.world_size = size;
    // init_process_group always passes a timeout; its default (30 min)
    // yields to CHORUS_TIMEOUT when that is set, any other value is the
    // user's and wins.
    const char* envTimeout = std::getenv("CHORUS_TIMEOUT");
    if (timeout.count() == kTorchDefaultTimeoutMs && envTimeout && *envTimeout)
      cfg.timeout_ms = 0;
    else
      cfg.timeout_ms = static_cast<int>(std::min<int64_t>(std::max<int64_t>(timeout.count(), 1), INT_MAX));
    // Every rank of the job on this host: every group is, too.
    int lws = envInt("LOCAL_WORLD_SIZE", -1), ws = envInt("WORLD_SIZE", -1);
    if (lws > 0 && lws == ws) {
      cfg.local_rank = rank;
      cfg.local_world_size = size;
    } else if (ws == size && envInt("RANK", -1) == rank && lws > 0) {
      cfg.local_rank = envInt("LOCAL_RANK", -1);
      cfg.local_world_size = lws;
    }
    KvCtx ctx{store.get()};
    chorus_kv_t kv;
    kv.ctx = &ctx;
    kv.set = chorusKvSet;
    kv.get = chorusKvGet;
    chorus_comm_t c = nullptr;
    chorus_result_t rc = chorus_comm_init_kv(&cfg, &kv, &c);
    if (rc != CHORUS_OK || !c)
      fail(resultText(rc != CHORUS_OK ? rc : CHORUS_ERR_INTERNAL, chorus_last_init_error()));
    comm_->comm = c;
    timeoutMs_ = chorus_comm_timeout_ms(c);
    init();
  }

  ~ProcessGroupChorus() override { completer_->shutdown(); }

  const std::string getBackendName() const override { return "chorus"; }

  chorus_comm_t comm() const { return comm_->comm; }
  int timeoutMs() const { return timeoutMs_; }

  // ---- collectives
  //
  // An argument error (this rank's, or one the library refused before
  // anything was sent) only throws: the group stays usable, as Gloo's does
  // (issue 42).  When the other ranks did enter the call, the next
  // collective of this rank meets theirs and every rank fails with
  // CHORUS_ERR_MISMATCH; one that never calls again leaves them to their
  // timeout, as on Gloo.

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    static const char* fn = "broadcast";
    at::AutoDispatchBelowAutograd guard;
    checkRoot(fn, opts.rootRank);
    if (opts.rootTensor < 0 || opts.rootTensor >= static_cast<int64_t>(tensors.size()))
      fail(c10::str("chorus broadcast: invalid root tensor: rootTensor ", opts.rootTensor,
                    " is not in [0, ", tensors.size(), ")",
                    tensors.empty() ? " (no tensor given)" : ""));
    for (size_t i = 0; i < tensors.size(); i++) {
      checkTensor(fn, tensors[i], "the tensor");
      if (i) checkSameTypeAndSizes(fn, tensors[0], tensors[i], c10::str("tensor ", i), "tensor 0");
    }
    const at::Tensor& t = tensors[opts.rootTensor];
    chorus_dtype_t dt = dtypeOf(fn, t, false);
    TensorPairs copies;
    at::Tensor buf = outputBuffer(fn, t, copies, true);
    for (size_t i = 0; i < tensors.size(); i++)
      if (static_cast<int64_t>(i) != opts.rootTensor) copies.emplace_back(tensors[i], buf);
    int root = static_cast<int>(opts.rootRank);
    return issue(OpType::BROADCAST, "chorus:broadcast", &tensors, tensors, {buf},
                 std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_broadcast(comm(), buf.data_ptr(), nelem(buf), dt, root, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    static const char* fn = "allreduce";
    at::AutoDispatchBelowAutograd guard;
    if (tensors.empty()) fail("chorus allreduce: requires non-empty tensor list");
    for (size_t i = 1; i < tensors.size(); i++)
      if (tensors[i].layout() != tensors[0].layout())
        fail(c10::str("chorus allreduce: invalid tensor layout at index ", i, ": ",
                      tensors[i].layout(), " where tensor 0 is ", tensors[0].layout()));
    if (tensors[0].is_sparse()) return sparseAllreduce(tensors, opts);
    for (size_t i = 0; i < tensors.size(); i++) {
      checkTensor(fn, tensors[i], "the tensor");
      if (i) checkSameTypeAndSizes(fn, tensors[0], tensors[i], c10::str("tensor ", i), "tensor 0");
    }
    chorus_dtype_t dt = dtypeOf(fn, tensors[0], true);
    chorus_op_t op = opOf(fn, opts.reduceOp, dt);
    TensorPairs copies;
    at::Tensor send, recv;
    if (tensors.size() == 1) {
      const at::Tensor& t = tensors[0];
      if (opts.reduceOp.op_ == ReduceOp::PREMUL_SUM) {
        send = premulInput(fn, opts.reduceOp, t, 0);
        recv = outputBuffer(fn, t, copies, false);
      } else {
        recv = outputBuffer(fn, t, copies, true);
        send = recv;
      }
    } else {
      // Several tensors per rank (all_reduce_multigpu): reduce them here,
      // reduce the result across ranks, copy it into each.
      if (opts.reduceOp.op_ == ReduceOp::AVG || opts.reduceOp.op_ == ReduceOp::PREMUL_SUM)
        fail(c10::str("chorus allreduce: ReduceOp.", redOpName(opts.reduceOp.op_),
                      " with several tensors per rank is not supported"));
      recv = localReduce(tensors, opts.reduceOp.op_);
      send = recv;
      for (auto& t : tensors) copies.emplace_back(t, recv);
    }
    return issue(OpType::ALLREDUCE, "chorus:all_reduce", &tensors, tensors, {send, recv},
                 std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_all_reduce(comm(), send.data_ptr(), recv.data_ptr(),
                                            nelem(recv), dt, op, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    static const char* fn = "allreduce_coalesced";
    at::AutoDispatchBelowAutograd guard;
    if (tensors.empty()) fail("chorus allreduce_coalesced: requires non-empty tensor list");
    for (size_t i = 1; i < tensors.size(); i++)
      if (tensors[i].layout() != tensors[0].layout())
        fail(c10::str("chorus allreduce_coalesced: invalid tensor layout at index ", i, ": ",
                      tensors[i].layout(), " where tensor 0 is ", tensors[0].layout()));
    if (tensors[0].layout() != c10::kStrided)
      fail(c10::str("chorus allreduce_coalesced: unsupported layout: ", tensors[0].layout(),
                    "; coalesced reductions take dense tensors (all_reduce takes sparse ones)"));
    for (size_t i = 0; i < tensors.size(); i++) {
      checkTensor(fn, tensors[i], "a tensor");
      if (tensors[i].scalar_type() != tensors[0].scalar_type())
        fail(c10::str("chorus allreduce_coalesced: tensors must all have the same type: tensor ",
                      i, " has dtype ", dtypeName(tensors[i].scalar_type()),
                      " but tensor 0 has ", dtypeName(tensors[0].scalar_type())));
    }
    chorus_dtype_t dt = dtypeOf(fn, tensors[0], true);
    chorus_op_t op = opOf(fn, opts.reduceOp, dt);
    std::vector<at::Tensor> in = tensors;
    if (opts.reduceOp.op_ == ReduceOp::PREMUL_SUM)
      for (size_t i = 0; i < in.size(); i++) in[i] = premulInput(fn, opts.reduceOp, in[i], 0);
    at::Tensor flat = pack(in, tensors[0].options());
    TensorPairs copies;
    unpackInto(flat, tensors, copies);
    return issue(OpType::ALLREDUCE_COALESCED, "chorus:all_reduce", &tensors, tensors,
                 {flat}, std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_all_reduce(comm(), flat.data_ptr(), flat.data_ptr(),
                                            nelem(flat), dt, op, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    static const char* fn = "reduce";
    at::AutoDispatchBelowAutograd guard;
    checkRoot(fn, opts.rootRank);
    if (opts.rootTensor < 0 || opts.rootTensor >= static_cast<int64_t>(tensors.size()))
      fail(c10::str("chorus reduce: invalid root tensor: rootTensor ", opts.rootTensor,
                    " is not in [0, ", tensors.size(), ")"));
    if (tensors.size() != 1)
      fail(c10::str("chorus reduce: requires a single-element tensor list (got ",
                    tensors.size(), "; one tensor per rank on CPU)"));
    const at::Tensor& t = tensors[0];
    checkTensor(fn, t, "the tensor");
    chorus_dtype_t dt = dtypeOf(fn, t, true);
    chorus_op_t op = opOf(fn, opts.reduceOp, dt);
    int root = static_cast<int>(opts.rootRank);
    bool isRoot = root == rank_;
    TensorPairs copies;
    at::Tensor send, recv;
    if (opts.reduceOp.op_ == ReduceOp::PREMUL_SUM) {
      send = premulInput(fn, opts.reduceOp, t, 0);
      if (isRoot) recv = outputBuffer(fn, t, copies, false);
    } else if (isRoot) {
      recv = outputBuffer(fn, t, copies, true);
      send = recv;
    } else {
      send = inputBuffer(t);
    }
    return issue(OpType::REDUCE, "chorus:reduce", &tensors, tensors, {send, recv},
                 std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_reduce(comm(), send.data_ptr(),
                                        recv.defined() ? recv.data_ptr() : nullptr, nelem(send),
                                        dt, op, root, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override {
    static const char* fn = "allgather";
    at::AutoDispatchBelowAutograd guard;
    // Gloo's contract: n input tensors per rank, n output lists of n x
    // world size tensors each, every list receiving input k of rank r at
    // r * n + k.
    const size_t n = inputs.size(), want = n * static_cast<size_t>(size_);
    if (!n) fail("chorus allgather: requires non-empty input tensor list");
    if (outputs.size() != n)
      fail(c10::str("chorus allgather: requires input/output tensor lists to have the same "
                    "length (", n, " input tensors, ", outputs.size(), " output lists)"));
    for (size_t j = 0; j < n; j++)
      if (outputs[j].size() != want)
        fail(c10::str("chorus allgather: invalid output tensor list at index ", j,
                      " (expected length ", want, ", got ", outputs[j].size(),
                      "): one tensor per rank and input"));
    for (size_t k = 0; k < n; k++) checkTensor(fn, inputs[k], "an input");
    for (size_t j = 0; j < n; j++)
      for (size_t m = 0; m < want; m++) {
        checkTensor(fn, outputs[j][m], "an output");
        checkSameTypeAndSizes(fn, inputs[m % n], outputs[j][m],
                              c10::str("output ", m, " of list ", j),
                              c10::str("input ", m % n).c_str());
      }
    if (n > 1) return allgatherSeveral(outputs, inputs);
    const at::Tensor& in = inputs[0];
    chorus_dtype_t dt = dtypeOf(fn, in, false);
    std::vector<at::Tensor>& outs = outputs[0];
    size_t count = nelem(in);
    at::Tensor send = inputBuffer(in);
    std::vector<at::Tensor> keep{send};
    TensorPairs copies;
    std::vector<at::Tensor> flatOuts = outs;
    if (consecutive(outs)) {
      // One flat buffer: all_gather (in place when the input is our block).
      at::Tensor flat = flatOver(outs);
      keep.push_back(flat);
      bool inPlace = count && bytePtr(send) == bytePtr(flat) + rank_ * send.nbytes();
      if (!inPlace && overlaps(send, flat)) keep[0] = send = send.clone();
      return issue(OpType::ALLGATHER, "chorus:all_gather", &inputs, flatOuts, std::move(keep),
                   std::move(copies), true, [&](chorus_work_t* w) {
                     return chorus_all_gather(comm(), send.data_ptr(), flat.data_ptr(), count,
                                              dt, w);
                   });
    }
    std::vector<void*> ptrs(outs.size());
    for (size_t r = 0; r < outs.size(); r++) {
      at::Tensor b = outputBuffer(fn, outs[r], copies, false);
      if (overlaps(send, b)) keep[0] = send = send.clone();
      keep.push_back(b);
      ptrs[r] = b.data_ptr();
    }
    return issue(OpType::ALLGATHER, "chorus:all_gather", &inputs, flatOuts, std::move(keep),
                 std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_all_gather_list(comm(), send.data_ptr(), ptrs.data(), count,
                                                 dt, w);
                 });
  }

  // allgather with several tensors per rank (checked by allgather): one
  // all_gather of each rank's tensors end to end, copied into every list.
  // The Future's value is the list of lists, as Gloo's.
  c10::intrusive_ptr<c10d::Work> allgatherSeveral(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs) {
    static const char* fn = "allgather";
    for (size_t k = 1; k < inputs.size(); k++)
      if (inputs[k].scalar_type() != inputs[0].scalar_type())
        fail(c10::str("chorus allgather: invalid tensor type at index ", k, ": input ", k,
                      " has dtype ", dtypeName(inputs[k].scalar_type()), " but input 0 has ",
                      dtypeName(inputs[0].scalar_type()), "; a rank's inputs share one dtype"));
    chorus_dtype_t dt = dtypeOf(fn, inputs[0], false);
    at::Tensor send = pack(inputs, inputs[0].options());
    size_t count = nelem(send);
    at::Tensor recv = at::empty({static_cast<int64_t>(count * size_)}, inputs[0].options());
    TensorPairs copies;
    std::vector<at::Tensor> flatOuts;
    for (auto& list : outputs) {
      unpackInto(recv, list, copies);
      flatOuts.insert(flatOuts.end(), list.begin(), list.end());
    }
    return issue(OpType::ALLGATHER, "chorus:all_gather", &inputs, flatOuts, {send, recv},
                 std::move(copies), true,
                 [&](chorus_work_t* w) {
                   return chorus_all_gather(comm(), send.data_ptr(), recv.data_ptr(), count, dt,
                                            w);
                 },
                 -1, &outputs);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    static const char* fn = "_allgather_base";
    at::AutoDispatchBelowAutograd guard;
    checkPair(fn, input, output);
    chorus_dtype_t dt = dtypeOf(fn, input, false);
    size_t count = nelem(input);
    if (nelem(output) != count * size_)
      fail(c10::str("chorus _allgather_base: the output has ", output.numel(),
                    " elements; it must have world size (", size_, ") times the input's (",
                    input.numel(), ")"));
    TensorPairs copies;
    at::Tensor recv = outputBuffer(fn, output, copies, false);
    at::Tensor send = inputBuffer(input);
    bool inPlace = count && output.is_contiguous() &&
                   bytePtr(send) == bytePtr(recv) + rank_ * send.nbytes();
    if (!inPlace && overlaps(send, recv)) send = send.clone();
    std::vector<at::Tensor> ins{input};
    return issue(OpType::_ALLGATHER_BASE, "chorus:_allgather_base", &ins, {output},
                 {send, recv}, std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_all_gather(comm(), send.data_ptr(), recv.data_ptr(), count, dt,
                                            w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions&) override {
    static const char* fn = "allgather_coalesced";
    at::AutoDispatchBelowAutograd guard;
    if (inputs.empty()) fail("chorus allgather_coalesced: requires non-empty input tensor list");
    if (outputLists.size() != static_cast<size_t>(size_))
      fail(c10::str("chorus allgather_coalesced: output lists should be equal to world size: ",
                    outputLists.size(), " given; one per rank (", size_, ")"));
    for (size_t i = 0; i < inputs.size(); i++) {
      checkTensor(fn, inputs[i], "an input");
      if (inputs[i].scalar_type() != inputs[0].scalar_type())
        fail(c10::str("chorus allgather_coalesced: invalid tensor type at index ", i, ": input ",
                      i, " has dtype ", dtypeName(inputs[i].scalar_type()), " but input 0 has ",
                      dtypeName(inputs[0].scalar_type()), "; all must have the same dtype"));
    }
    chorus_dtype_t dt = dtypeOf(fn, inputs[0], false);
    std::vector<at::Tensor> flatOuts;
    for (size_t r = 0; r < outputLists.size(); r++) {
      if (outputLists[r].size() != inputs.size())
        fail(c10::str("chorus allgather_coalesced: output list ", r, " has ",
                      outputLists[r].size(), " tensors; it must have one per input (",
                      inputs.size(), ")"));
      for (size_t i = 0; i < inputs.size(); i++) {
        const at::Tensor& o = outputLists[r][i];
        checkTensor(fn, o, "an output");
        if (o.scalar_type() != inputs[i].scalar_type())
          fail(c10::str("chorus allgather_coalesced: invalid tensor type at index ", i,
                        ": output ", i, " of list ", r, " has dtype ",
                        dtypeName(o.scalar_type()), " but input ", i, " has ",
                        dtypeName(inputs[i].scalar_type())));
        if (o.sizes() != inputs[i].sizes())
          fail(c10::str("chorus allgather_coalesced: invalid size of output tensor at index ",
                        i, ": output ", i, " of list ", r, " has sizes ", sizesStr(o),
                        " but input ", i, " has ", sizesStr(inputs[i])));
        flatOuts.push_back(o);
      }
    }
    at::Tensor send = pack(inputs, inputs[0].options());
    size_t count = nelem(send);
    at::Tensor recv = at::empty({static_cast<int64_t>(count * size_)}, inputs[0].options());
    TensorPairs copies;
    unpackInto(recv, flatOuts, copies);
    return issue(OpType::ALLGATHER_COALESCED, "chorus:all_gather", &inputs, flatOuts,
                 {send, recv}, std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_all_gather(comm(), send.data_ptr(), recv.data_ptr(), count, dt,
                                            w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    static const char* fn = "gather";
    at::AutoDispatchBelowAutograd guard;
    checkRoot(fn, opts.rootRank);
    if (inputs.size() != 1)
      fail(c10::str("chorus gather: requires a single-element input tensor list (got ",
                    inputs.size(), ")"));
    const at::Tensor& in = inputs[0];
    checkTensor(fn, in, "the input");
    chorus_dtype_t dt = dtypeOf(fn, in, false);
    int root = static_cast<int>(opts.rootRank);
    size_t count = nelem(in);
    at::Tensor send = inputBuffer(in);
    TensorPairs copies;
    std::vector<at::Tensor> flatOuts;
    at::Tensor recv;
    if (rank_ == root) {
      if (outputs.size() != 1)
        fail(c10::str("chorus gather: requires a single-element output list containing a list "
                      "with ", size_, " tensors (got ", outputs.size(), " lists, on the root)"));
      std::vector<at::Tensor>& outs = outputs[0];
      checkList(fn, outs, in, "the gather list", "output", "Output");
      flatOuts = outs;
      if (consecutive(outs)) {
        recv = flatOver(outs);
        bool inPlace = count && bytePtr(send) == bytePtr(recv) + root * send.nbytes();
        if (!inPlace && overlaps(send, recv)) send = send.clone();
      } else {
        recv = at::empty({static_cast<int64_t>(count * size_)}, in.options());
        unpackInto(recv, outs, copies);
      }
    } else if (!outputs.empty() && !(outputs.size() == 1 && outputs[0].empty())) {
      fail(c10::str("chorus gather: requires empty output on non-root: only the root (rank ",
                    root, ") may pass a gather list; this rank is ", rank_));
    }
    return issue(OpType::GATHER, "chorus:gather", &inputs, flatOuts, {send, recv},
                 std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_gather(comm(), send.data_ptr(),
                                        recv.defined() ? recv.data_ptr() : nullptr, count, dt,
                                        root, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    static const char* fn = "scatter";
    at::AutoDispatchBelowAutograd guard;
    checkRoot(fn, opts.rootRank);
    if (outputs.size() != 1)
      fail(c10::str("chorus scatter: requires a single-element output tensor list (got ",
                    outputs.size(), ")"));
    const at::Tensor& out = outputs[0];
    checkTensor(fn, out, "the output");
    chorus_dtype_t dt = dtypeOf(fn, out, false);
    int root = static_cast<int>(opts.rootRank);
    size_t count = nelem(out);
    TensorPairs copies;
    at::Tensor recv = outputBuffer(fn, out, copies, false);
    at::Tensor send;
    std::vector<at::Tensor> ins;
    if (rank_ == root) {
      if (inputs.size() != 1)
        fail(c10::str("chorus scatter: requires a single-element input list containing a list "
                      "with ", size_, " tensors (got ", inputs.size(), " lists, on the root)"));
      ins = inputs[0];
      checkList(fn, ins, out, "the scatter list", "input", "Input");
      if (consecutive(ins)) {
        send = flatOver(ins);
        bool inPlace = count && out.is_contiguous() &&
                       bytePtr(recv) == bytePtr(send) + root * recv.nbytes();
        if (!inPlace && overlaps(send, recv)) send = send.clone();
      } else {
        send = pack(ins, out.options());
      }
    } else if (!inputs.empty() && !(inputs.size() == 1 && inputs[0].empty())) {
      fail(c10::str("chorus scatter: requires empty input on non-root: only the source (rank ",
                    root, ") may pass a scatter list; this rank is ", rank_));
    }
    // send may be a view over the caller's list (flatOver): the list's
    // tensors own that memory and must live until the operation ends.
    std::vector<at::Tensor> keep = {send, recv};
    keep.insert(keep.end(), ins.begin(), ins.end());
    return issue(OpType::SCATTER, "chorus:scatter", &ins, outputs, std::move(keep),
                 std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_scatter(comm(), send.defined() ? send.data_ptr() : nullptr,
                                         recv.data_ptr(), count, dt, root, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    static const char* fn = "reduce_scatter";
    at::AutoDispatchBelowAutograd guard;
    checkSingle(fn, outputs.size(), "output tensor");
    checkSingle(fn, inputs.size(), "input list");
    const at::Tensor& out = outputs[0];
    checkTensor(fn, out, "the output");
    chorus_dtype_t dt = dtypeOf(fn, out, true);
    chorus_op_t op = opOf(fn, opts.reduceOp, dt);
    std::vector<at::Tensor> ins = inputs[0];
    checkList(fn, ins, out, "the input list");
    size_t count = nelem(out);
    TensorPairs copies;
    at::Tensor recv = outputBuffer(fn, out, copies, false);
    at::Tensor send;
    if (opts.reduceOp.op_ == ReduceOp::PREMUL_SUM) {
      std::vector<at::Tensor> scaled;
      for (auto& t : ins) scaled.push_back(premulInput(fn, opts.reduceOp, t, 0));
      send = pack(scaled, out.options());
    } else if (consecutive(ins)) {
      send = flatOver(ins);
      bool inPlace = count && out.is_contiguous() &&
                     bytePtr(recv) == bytePtr(send) + rank_ * recv.nbytes();
      if (!inPlace && overlaps(send, recv)) send = send.clone();
    } else {
      send = pack(ins, out.options());
    }
    std::vector<at::Tensor> keep = {send, recv};  // and the list send may view
    keep.insert(keep.end(), ins.begin(), ins.end());
    return issue(OpType::REDUCE_SCATTER, "chorus:reduce_scatter", &ins, outputs,
                 std::move(keep), std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_reduce_scatter(comm(), send.data_ptr(), recv.data_ptr(), count,
                                                dt, op, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    static const char* fn = "_reduce_scatter_base";
    at::AutoDispatchBelowAutograd guard;
    checkPair(fn, input, output);
    chorus_dtype_t dt = dtypeOf(fn, output, true);
    chorus_op_t op = opOf(fn, opts.reduceOp, dt);
    size_t count = nelem(output);
    if (nelem(input) != count * size_)
      fail(c10::str("chorus _reduce_scatter_base: the input has ", input.numel(),
                    " elements; it must have world size (", size_, ") times the output's (",
                    output.numel(), ")"));
    TensorPairs copies;
    at::Tensor recv = outputBuffer(fn, output, copies, false);
    at::Tensor send;
    if (opts.reduceOp.op_ == ReduceOp::PREMUL_SUM) {
      send = premulInput(fn, opts.reduceOp, input, 0);
    } else {
      send = inputBuffer(input);
      bool inPlace = count && output.is_contiguous() &&
                     bytePtr(recv) == bytePtr(send) + rank_ * recv.nbytes();
      if (!inPlace && overlaps(send, recv)) send = send.clone();
    }
    std::vector<at::Tensor> ins{input};
    return issue(OpType::_REDUCE_SCATTER_BASE, "chorus:_reduce_scatter_base", &ins, {output},
                 {send, recv}, std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_reduce_scatter(comm(), send.data_ptr(), recv.data_ptr(), count,
                                                dt, op, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outSplits,
                                               std::vector<int64_t>& inSplits,
                                               const c10d::AllToAllOptions&) override {
    static const char* fn = "alltoall_base";
    at::AutoDispatchBelowAutograd guard;
    checkPair(fn, input, output);
    chorus_dtype_t dt = dtypeOf(fn, input, false);
    TensorPairs copies;
    at::Tensor recv = outputBuffer(fn, output, copies, false);
    at::Tensor send = inputBuffer(input);
    std::vector<at::Tensor> ins{input};
    if (outSplits.empty() && inSplits.empty()) {
      if (input.numel() != output.numel())
        fail(c10::str("chorus alltoall_base: the input has ", input.numel(),
                      " elements and the output ", output.numel(), "; without split sizes "
                      "they must be equal"));
      if (input.dim() == 0 || input.size(0) % size_ != 0)
        fail(c10::str("chorus alltoall_base: the input's first dimension (",
                      input.dim() ? input.size(0) : 0, ") does not divide equally across the ",
                      size_, " ranks; give split sizes"));
      size_t count = nelem(input) / size_;
      bool inPlace = bytePtr(send) == bytePtr(recv) && send.nbytes() == recv.nbytes();
      if (!inPlace && overlaps(send, recv)) send = send.clone();
      return issue(OpType::ALLTOALL_BASE, "chorus:all_to_all", &ins, {output}, {send, recv},
                   std::move(copies), true, [&](chorus_work_t* w) {
                     return chorus_all_to_all(comm(), send.data_ptr(), recv.data_ptr(), count,
                                              dt, w);
                   });
    }
    std::vector<size_t> sc, sd, rc, rd;
    splits(fn, "input", input, inSplits, sc, sd);
    splits(fn, "output", output, outSplits, rc, rd);
    if (overlaps(send, recv)) send = send.clone();
    return issue(OpType::ALLTOALL_BASE, "chorus:all_to_all", &ins, {output}, {send, recv},
                 std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_all_to_allv(comm(), send.data_ptr(), sc.data(), sd.data(),
                                             recv.data_ptr(), rc.data(), rd.data(), dt, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override {
    static const char* fn = "alltoall";
    at::AutoDispatchBelowAutograd guard;
    if (outputs.size() != static_cast<size_t>(size_) || inputs.size() != static_cast<size_t>(size_))
      fail(c10::str("chorus alltoall: the input list has ", inputs.size(),
                    " tensors and the output list ", outputs.size(),
                    "; both need one per rank (", size_, ")"));
    for (size_t i = 0; i < inputs.size(); i++) {
      checkTensor(fn, inputs[i], "an input");
      checkTensor(fn, outputs[i], "an output");
      if (inputs[i].scalar_type() != inputs[0].scalar_type() ||
          outputs[i].scalar_type() != inputs[0].scalar_type())
        fail(c10::str("chorus alltoall: input ", i, " (", dtypeName(inputs[i].scalar_type()),
                      ") or output ", i, " (", dtypeName(outputs[i].scalar_type()),
                      ") differs from input 0's dtype ", dtypeName(inputs[0].scalar_type())));
    }
    chorus_dtype_t dt = dtypeOf(fn, inputs[0], false);
    std::vector<size_t> sc(size_), sd(size_), rc(size_), rd(size_);
    size_t so = 0, ro = 0;
    for (int r = 0; r < size_; r++) {
      sc[r] = nelem(inputs[r]);
      sd[r] = so;
      so += sc[r];
      rc[r] = nelem(outputs[r]);
      rd[r] = ro;
      ro += rc[r];
    }
    at::Tensor send = pack(inputs, inputs[0].options());
    TensorPairs copies;
    at::Tensor recv;
    if (consecutive(outputs) || (size_ == 1 && outputs[0].is_contiguous())) {
      recv = flatOver(outputs);
    } else {
      recv = at::empty({static_cast<int64_t>(ro)}, inputs[0].options());
      unpackInto(recv, outputs, copies);
    }
    return issue(OpType::ALLTOALL, "chorus:all_to_all", &inputs, outputs, {send, recv},
                 std::move(copies), true, [&](chorus_work_t* w) {
                   return chorus_all_to_allv(comm(), send.data_ptr(), sc.data(), sd.data(),
                                             recv.data_ptr(), rc.data(), rd.data(), dt, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override {
    static const char* fn = "send";
    at::AutoDispatchBelowAutograd guard;
    checkSingle(fn, tensors.size(), "tensor");
    checkPeer(fn, dstRank, tag);
    const at::Tensor& t = tensors[0];
    checkTensor(fn, t, "the tensor");
    chorus_dtype_t dt = dtypeOf(fn, t, false);
    at::Tensor buf = inputBuffer(t);
    return issue(OpType::SEND, "chorus:send", &tensors, tensors, {buf}, {}, false,
                 [&](chorus_work_t* w) {
                   return chorus_send(comm(), buf.data_ptr(), nelem(buf), dt, dstRank, tag, w);
                 });
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override {
    return receive(tensors, srcRank, tag);
  }

  // dist.recv / irecv without src: the first message with the tag from any
  // rank, matched in the order receives were posted (chorus_recv with
  // CHORUS_ANY_SOURCE); Work.source_rank() names the sender.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override {
    return receive(tensors, CHORUS_ANY_SOURCE, tag);
  }

  // all_reduce of a sparse COO tensor (SUM), as Gloo does it: every rank's
  // coalesced indices and values go to every rank (one variable-size
  // all-gather: a header -- dtype, dims, sizes, nnz -- then the indices,
  // then the values), which sums them by coalescing and writes the result
  // into the tensor.  Blocking: the Work it returns has completed.  What
  // arrives is checked (lengths, and the header against this rank's own);
  // every rank sees the same bytes, so a mismatch fails every rank alike.
  c10::intrusive_ptr<ChorusWork> sparseAllreduce(std::vector<at::Tensor>& tensors,
                                                const c10d::AllreduceOptions& opts) {
    for (size_t i = 0; i < tensors.size(); i++) {
      if (!tensors[i].device().is_cpu())
        fail(c10::str("chorus allreduce: unsupported device type: sparse tensor ", i, " is on ",
                      tensors[i].device().str(), "; chorus reduces CPU tensors"));
      if (i && tensors[i].sizes() != tensors[0].sizes())
        fail(c10::str("chorus allreduce: invalid tensor size at index ", i, ": sparse tensor ",
                      i, " has sizes ", sizesStr(tensors[i]), " but tensor 0 has ",
                      sizesStr(tensors[0])));
      if (i && tensors[i].scalar_type() != tensors[0].scalar_type())
        fail(c10::str("chorus allreduce: invalid tensor type at index ", i, ": sparse tensor ",
                      i, " has dtype ", dtypeName(tensors[i].scalar_type()),
                      " but tensor 0 has ", dtypeName(tensors[0].scalar_type())));
    }
    if (opts.reduceOp.op_ != ReduceOp::SUM)
      fail(c10::str("chorus allreduce: unsupported reduction operation: sparse tensors are "
                    "reduced with ReduceOp.SUM only (as with Gloo), not ReduceOp.",
                    redOpName(opts.reduceOp.op_)));
    // Several tensors per rank: their sum goes round, and every one of
    // them receives the total.
    at::Tensor t = tensors[0];
    for (size_t i = 1; i < tensors.size(); i++) t = t + tensors[i];
    at::Tensor in = t.coalesce();
    at::Tensor idx = in._indices().contiguous();
    at::Tensor val = in._values().contiguous();
    const int64_t sdim = in.sparse_dim(), ndim = in.dim();
    int64_t denseNumel = 1;
    for (int64_t d = sdim; d < ndim; d++) denseNumel *= in.size(d);
    const int64_t esize = static_cast<int64_t>(val.element_size());
    std::vector<int64_t> head = {kSparseMagic, static_cast<int64_t>(val.scalar_type()), sdim,
                                 ndim};
    for (int64_t d = 0; d < ndim; d++) head.push_back(in.size(d));
    head.push_back(in._nnz());
    const size_t hbytes = head.size() * sizeof(int64_t);
    std::vector<uint8_t> mine(hbytes + idx.nbytes() + val.nbytes());
    memcpy(mine.data(), head.data(), hbytes);
    if (idx.nbytes()) memcpy(mine.data() + hbytes, idx.data_ptr(), idx.nbytes());
    if (val.nbytes()) memcpy(mine.data() + hbytes + idx.nbytes(), val.data_ptr(), val.nbytes());

    auto w = c10::make_intrusive<ChorusWork>(rank_, OpType::ALLREDUCE, "chorus:all_reduce",
                                             &tensors, comm_, completer_, tensors,
                                             std::vector<at::Tensor>{}, TensorPairs{}, -1);
    void* all = nullptr;
    std::vector<size_t> lens(size_);
    chorus_result_t rc;
    {
      std::lock_guard<std::mutex> g(comm_->issueMu);
      GilRelease nogil;
      rc = chorus_all_gather_bytes(comm(), mine.data(), mine.size(), &all, lens.data());
      if (rc == CHORUS_OK) seq_++;
    }
    if (rc != CHORUS_OK) throw LibraryError(resultText(rc, chorus_comm_last_error(comm())));
    std::unique_ptr<void, void (*)(void*)> hold(all, chorus_free);
    std::vector<at::Tensor> idxs, vals;
    const uint8_t* p = static_cast<const uint8_t*>(all);
    for (int r = 0; r < size_; p += lens[r], r++) {
      std::vector<int64_t> theirs(head.size());
      if (lens[r] < hbytes) sparseMismatch(r, c10::str("sent ", lens[r], " bytes"));
      memcpy(theirs.data(), p, hbytes);
      if (!std::equal(head.begin(), head.end() - 1, theirs.begin()))
        sparseMismatch(r, "has another dtype, sparse dimension or size");
      int64_t nnz = theirs.back();
      uint64_t per = static_cast<uint64_t>(sdim) * 8 + static_cast<uint64_t>(denseNumel * esize);
      if (nnz < 0 || (per && static_cast<uint64_t>(nnz) > (lens[r] - hbytes) / per) ||
          hbytes + static_cast<uint64_t>(nnz) * per != lens[r])
        sparseMismatch(r, c10::str("sent ", lens[r], " bytes for ", nnz, " entries"));
      std::vector<int64_t> vshape = {nnz};
      for (int64_t d = sdim; d < ndim; d++) vshape.push_back(in.size(d));
      idxs.push_back(at::empty({sdim, nnz}, idx.options()));
      vals.push_back(at::empty(vshape, val.options()));
      if (nnz) {
        memcpy(idxs.back().data_ptr(), p + hbytes, idxs.back().nbytes());
        memcpy(vals.back().data_ptr(), p + hbytes + idxs.back().nbytes(), vals.back().nbytes());
      }
    }
    at::Tensor sum =
        at::sparse_coo_tensor(at::cat(idxs, 1), at::cat(vals, 0), in.sizes(), in.options())
            .coalesce();
    for (auto& out : tensors) out.copy_(sum);
    w->complete(CHORUS_OK);
    return w;
  }

  [[noreturn]] void sparseMismatch(int r, const std::string& what) const {
    fail(c10::str("chorus allreduce: sparse tensors differ between the ranks: rank ", r, " ",
                  what, "; every rank must pass a tensor of the same dtype, sparse dimension "
                  "and size"));
  }

  c10::intrusive_ptr<c10d::Work> receive(std::vector<at::Tensor>& tensors, int srcRank,
                                         int tag) {
    static const char* fn = "recv";
    bool any = srcRank == CHORUS_ANY_SOURCE;
    at::AutoDispatchBelowAutograd guard;
    checkSingle(fn, tensors.size(), "tensor");
    checkPeer(fn, srcRank, tag, true);
    const at::Tensor& t = tensors[0];
    checkTensor(fn, t, "the tensor");
    chorus_dtype_t dt = dtypeOf(fn, t, false);
    TensorPairs copies;
    at::Tensor buf = outputBuffer(fn, t, copies, false);
    return issue(any ? OpType::RECVANYSOURCE : OpType::RECV,
                 any ? "chorus:recvAnySource" : "chorus:recv", &tensors, tensors, {buf},
                 std::move(copies), false,
                 [&](chorus_work_t* w) {
                   return chorus_recv(comm(), buf.data_ptr(), nelem(buf), dt, srcRank, tag, w);
                 },
                 any ? ChorusWork::kFromAnyRank : srcRank);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return issue(OpType::BARRIER, "chorus:barrier", nullptr, {}, {}, {}, true,
                 [&](chorus_work_t* w) { return chorus_barrier(comm(), w); });
  }

  // Gloo's protocol and messages over tagged point-to-point messages: every
  // rank reports to rank 0 and waits for its answer; only rank 0 applies
  // the barrier's timeout (the others wait as long as the group's timeout
  // allows, so that rank 0, not they, names the rank that failed).  Unlike
  // Gloo, rank 0 answers every rank, failed or not, with the verdict (which
  // ranks failed), so the ranks that did arrive fail at once with rank 0's
  // finding instead of at their own timeout, and every message posted has
  // its match.  A late rank gets the verdict when it arrives.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override {
    at::AutoDispatchBelowAutograd guard;
    auto start = std::chrono::steady_clock::now();
    int64_t tmo = opts.timeout == c10d::kUnsetTimeout ? timeoutMs_ : opts.timeout.count();
    auto deadline = start + std::chrono::milliseconds(rank_ == 0 ? tmo : timeoutMs_);
    auto elapsed = [&]() {
      return std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::steady_clock::now() - start)
          .count();
    };
    auto left = [&]() {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                    deadline - std::chrono::steady_clock::now())
                    .count();
      return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, INT_MAX)));
    };
    auto post = [&](bool isSend, int peer, const at::Tensor& t) {
      return issue(isSend ? OpType::SEND : OpType::RECV, "chorus:monitored_barrier", nullptr,
                   {}, {t}, {}, false, [&](chorus_work_t* w) {
                     return isSend ? chorus_send(comm(), t.data_ptr(), nelem(t), CHORUS_UINT8,
                                                 peer, kMonitoredBarrierTag, w)
                                   : chorus_recv(comm(), t.data_ptr(), nelem(t), CHORUS_UINT8,
                                                 peer, kMonitoredBarrierTag, w);
                   });
    };
    // Waits for w until the deadline: "" on success, else why not.  A
    // pending Work goes to the completion thread (its buffer must live on).
    static const std::string kLate = "it did not arrive in time";
    auto waitFor = [&](const c10::intrusive_ptr<ChorusWork>& w) -> std::string {
      chorus_result_t rc = chorus_work_wait(*w->handle(), left());
      if (rc == CHORUS_INPROGRESS) {
        w->getFuture();
        return kLate;
      }
      w->complete(rc);
      return rc == CHORUS_OK ? "" : resultText(rc, chorus_work_error(*w->handle()));
    };
    auto join = [](const std::vector<int>& v) {
      std::string list;
      for (int r : v) list += (list.empty() ? "" : ", ") + std::to_string(r);
      return list;
    };
    if (rank_ != 0) {
      at::Tensor verdict = at::zeros({size_}, at::kByte);
      auto s = post(true, 0, at::zeros({1}, at::kByte));
      auto r = post(false, 0, verdict);
      std::string why = waitFor(s);
      if (why.empty()) why = waitFor(r);
      else r->getFuture();
      if (why == kLate)
        why = c10::str("rank 0 did not answer within the group's timeout of ", timeoutMs_,
                       " ms; is rank 0 in monitored_barrier too?");
      std::vector<int> failed;
      for (int q = 1; q < size_ && why.empty(); q++)
        if (verdict[q].item<uint8_t>()) failed.push_back(q);
      if (!failed.empty())
        why = c10::str("rank 0 reports that ", failed.size() == 1 ? "rank " : "ranks ",
                       join(failed), " failed to pass monitoredBarrier in ", tmo, " ms");
      if (!why.empty())
        fail(c10::str("[Rank ", rank_, "]: Rank ", rank_, " successfully reached "
                      "monitoredBarrier, but received errors while waiting for send/recv from "
                      "rank 0: ", why, ". Rank 0's error names the rank that failed."));
      return;
    }
    std::vector<c10::intrusive_ptr<ChorusWork>> recvs;
    for (int r = 1; r < size_; r++) recvs.push_back(post(false, r, at::zeros({1}, at::kByte)));
    // Out of time before looking at anyone (timeout 0, or rank 0 came late
    // to its own deadline): rank 0 is the one that timed out, as Gloo says.
    bool lateFromStart = left() == 0;
    at::Tensor verdict = at::zeros({size_}, at::kByte);
    std::vector<int> failed, passed;
    std::string firstWhy;
    for (int r = 1; r < size_; r++) {
      std::string why = waitFor(recvs[r - 1]);
      if (why.empty()) {
        passed.push_back(r);
        continue;
      }
      verdict[r] = 1;
      failed.push_back(r);
      if (firstWhy.empty()) firstWhy = why;
      if (!waitAllRanks) {
        for (int q = r + 1; q < size_; q++) recvs[q - 1]->getFuture();
        break;
      }
    }
    std::vector<c10::intrusive_ptr<ChorusWork>> sends;
    for (int r = 1; r < size_; r++) sends.push_back(post(true, r, verdict));
    std::vector<int> unsent;
    std::string unsentWhy;
    for (int r = 1; r < size_; r++) {
      std::string why = waitFor(sends[r - 1]);
      if (why.empty() || verdict[r].item<uint8_t>()) continue;
      unsent.push_back(r);
      if (unsentWhy.empty()) unsentWhy = why;
    }
    if (!failed.empty() && lateFromStart && !waitAllRanks)
      fail(c10::str("[Rank 0]: Rank 0 timed out in monitoredBarrier after ", elapsed(),
                    " ms (timeout ", tmo, " ms): no time was left to wait for rank ",
                    failed[0], "; ranks that had arrived: ",
                    passed.empty() ? "none" : join(passed)));
    if (!failed.empty())
      fail(c10::str("[Rank 0]: ", waitAllRanks ? "Ranks " : "Rank ", join(failed),
                    " failed to pass monitoredBarrier in ", tmo, " ms (",
                    failed.size() == 1 ? "" : "the first: ", firstWhy, ")",
                    waitAllRanks ? "" : "; wait_all_ranks=True waits for and names every rank "
                                        "that fails"));
    if (!unsent.empty())
      fail(c10::str("[Rank 0]: monitoredBarrier: every rank arrived, but releasing ",
                    unsent.size() == 1 ? "rank " : "ranks ", join(unsent), " failed (",
                    unsentWhy, ")"));
  }

  void setSequenceNumberForGroup() override {}  // 0 on every rank at creation

  uint64_t getSequenceNumberForGroup() override { return seq_.load(); }

  void abort() { chorus_comm_abort(comm()); }

 private:
  static constexpr int kMonitoredBarrierTag = INT_MAX - 1;
  static constexpr int64_t kSparseMagic = 0x63686f7275735350;  // "chorusSP"

  // Issues one operation: call(&handle) enters the library (in the
  // asynchronous form) under the issue mutex.
  template <class F>
  c10::intrusive_ptr<ChorusWork> issue(OpType type, const char* title,
                                       const std::vector<at::Tensor>* inputs,
                                       std::vector<at::Tensor> outputs,
                                       std::vector<at::Tensor> keep, TensorPairs copies,
                                       bool collective, F&& call, int srcRank = -1,
                                       const std::vector<std::vector<at::Tensor>>* nested =
                                           nullptr) {
    auto w = c10::make_intrusive<ChorusWork>(rank_, type, title, inputs, comm_, completer_,
                                             std::move(outputs), std::move(keep),
                                             std::move(copies), srcRank);
    if (nested) w->setNested(*nested);
    std::string err;
    {
      std::lock_guard<std::mutex> g(comm_->issueMu);
      chorus_result_t rc = call(w->handle());
      if (rc != CHORUS_OK) {
        *w->handle() = nullptr;
        err = resultText(rc, chorus_comm_last_error(comm()));
      } else if (collective) {
        seq_++;
      }
    }
    if (!err.empty()) throw LibraryError(err);
    return w;
  }

  void checkRoot(const char* fn, int64_t root) const {
    if (root < 0 || root >= size_)
      fail(c10::str("chorus ", fn, ": invalid root rank: ", root, " is not in [0, ", size_, ")"));
  }

  // peer: a rank of the group, or CHORUS_ANY_SOURCE where anyOk (recv).
  void checkPeer(const char* fn, int peer, int tag, bool anyOk = false) const {
    if (anyOk && peer == CHORUS_ANY_SOURCE) {
      if (size_ < 2)
        fail(c10::str("chorus ", fn, ": receiving from any source in a group of one rank: no "
                      "rank can send"));
    } else if (peer < 0 || peer >= size_) {
      fail(c10::str("chorus ", fn, ": peer rank ", peer, " is not in [0, ", size_, ")"));
    }
    if (tag < 0)
      fail(c10::str("chorus ", fn, ": tag ", tag, " is negative; chorus tags are >= 0"));
  }

  // A list of size_ tensors, each of the reference's dtype and sizes.
  void checkList(const char* fn, const std::vector<at::Tensor>& list, const at::Tensor& ref,
                 const char* what, const char* side = nullptr,
                 const char* Side = nullptr) const {
    // side, Side: "input", "Input" (scatter) or "output", "Output" (gather).
    if (list.size() != static_cast<size_t>(size_))
      fail(c10::str("chorus ", fn, ": ",
                    side ? c10::str("Incorrect ", side, " list size ", list.size(), ". ", Side,
                                    " list size should be ", size_,
                                    ", same as size of the process group: ")
                         : std::string(),
                    what, " has ", list.size(), " tensors; it needs one per rank (", size_,
                    ")"));
    for (size_t r = 0; r < list.size(); r++) {
      checkTensor(fn, list[r], "a list entry");
      checkSameTypeAndSizes(fn, ref, list[r], c10::str("entry ", r, " of ", what),
                            "this rank's tensor");
    }
  }

  // Split sizes (in rows of dim 0) to counts and displacements (elements).
  void splits(const char* fn, const char* what, const at::Tensor& t,
              const std::vector<int64_t>& split, std::vector<size_t>& counts,
              std::vector<size_t>& displs) const {
    if (t.dim() == 0)
      fail(c10::str("chorus ", fn, ": the ", what, " is a scalar; it needs a first dimension"));
    int64_t rows = t.size(0);
    size_t row = rows ? nelem(t) / static_cast<size_t>(rows) : 0;
    counts.assign(size_, 0);
    displs.assign(size_, 0);
    if (split.empty()) {
      if (rows % size_)
        fail(c10::str("chorus ", fn, ": the ", what, "'s first dimension (", rows,
                      ") does not divide equally across the ", size_, " ranks; give split sizes"));
      for (int r = 0; r < size_; r++) {
        counts[r] = static_cast<size_t>(rows / size_) * row;
        displs[r] = r * counts[r];
      }
      return;
    }
    if (split.size() != static_cast<size_t>(size_))
      fail(c10::str("chorus ", fn, ": ", split.size(), " ", what, " split sizes given; one per "
                    "rank (", size_, ") is needed"));
    int64_t sum = 0;
    for (int r = 0; r < size_; r++) {
      if (split[r] < 0 || split[r] > rows - sum)
        fail(c10::str("chorus ", fn, ": ", what, " split size ", r, " (", split[r], ") is "
                      "negative or runs past the tensor's ", rows, " rows"));
      displs[r] = static_cast<size_t>(sum) * row;
      counts[r] = static_cast<size_t>(split[r]) * row;
      sum += split[r];
    }
    if (sum != rows)
      fail(c10::str("chorus ", fn, ": the ", what, " split sizes add up to ", sum,
                    " but its first dimension is ", rows));
  }

  // The local part of a multi-tensor allreduce: op over tensors, in a fresh
  // contiguous tensor.
  static at::Tensor localReduce(const std::vector<at::Tensor>& ts, ReduceOp::RedOpType op) {
    at::Tensor acc = ts[0].clone(at::MemoryFormat::Contiguous);
    for (size_t i = 1; i < ts.size(); i++) {
      switch (op) {
        case ReduceOp::SUM: acc.add_(ts[i]); break;
        case ReduceOp::PRODUCT: acc.mul_(ts[i]); break;
        case ReduceOp::MIN: acc = at::minimum(acc, ts[i]); break;
        case ReduceOp::MAX: acc = at::maximum(acc, ts[i]); break;
        case ReduceOp::BAND: acc.bitwise_and_(ts[i]); break;
        case ReduceOp::BOR: acc.bitwise_or_(ts[i]); break;
        case ReduceOp::BXOR: acc.bitwise_xor_(ts[i]); break;
        default: fail("chorus allreduce: unsupported ReduceOp with several tensors");
      }
    }
    return acc.contiguous();
  }

  std::shared_ptr<Comm> comm_;
  std::shared_ptr<Completer> completer_;
  std::atomic<uint64_t> seq_{0};
  int timeoutMs_ = 0;
};

// ------------------------------------------------------------------ Store

// A c10d::Store over chorus's store (chorusrun serves one at
// MASTER_ADDR:MASTER_PORT, authenticated with the job secret).
class ChorusStore : public c10d::Store {
 public:
  ChorusStore(const std::string& host, int port, std::chrono::milliseconds timeout,
              const std::string& secret)
      : c10d::Store(timeout), host_(host), port_(port) {
    chorus_result_t rc = chorus_store_connect(host.c_str(), port,
                                              secret.empty() ? nullptr : secret.c_str(),
                                              clampMs(timeout), &c_);
    if (rc != CHORUS_OK)
      fail(c10::str("ChorusStore: cannot connect to chorus's store at ", host, ":", port, ": ",
                    chorus_result_name(rc), ": ", chorus_strerror(rc),
                    " (is chorusrun serving it, and is the job secret, CHORUS_JOB_SECRET or "
                    "CHORUS_JOB_SECRET_FILE, the job's?)"));
  }
  ~ChorusStore() override {
    if (c_) chorus_store_close(c_);
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    std::lock_guard<std::mutex> g(mu_);
    ok(chorus_store_set(c_, key.c_str(), value.data(), value.size()), "set", key);
  }

  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override {
    std::lock_guard<std::mutex> g(mu_);
    void* cur = nullptr;
    size_t curLen = 0;
    ok(chorus_store_compare_set(c_, key.c_str(), expected.empty() ? nullptr : expected.data(),
                                   expected.size(), desired.data(), desired.size(), &cur, &curLen),
          "compare_set", key);
    std::vector<uint8_t> out;
    if (cur) {
      auto* p = static_cast<uint8_t*>(cur);
      out.assign(p, p + curLen);
      chorus_free(cur);
    } else {
      out = expected;  // absent key, expected value given: torch returns it
    }
    return out;
  }

  std::vector<uint8_t> get(const std::string& key) override {
    std::lock_guard<std::mutex> g(mu_);
    const char* k = key.c_str();
    ok(chorus_store_wait(c_, &k, 1, clampMs(timeout_)), "get (wait)", key);
    void* val = nullptr;
    size_t len = 0;
    ok(chorus_store_get(c_, k, &val, &len), "get", key);
    auto* p = static_cast<uint8_t*>(val);
    std::vector<uint8_t> out(p, p + len);
    chorus_free(val);
    return out;
  }

  int64_t add(const std::string& key, int64_t value) override {
    std::lock_guard<std::mutex> g(mu_);
    int64_t out = 0;
    ok(chorus_store_add(c_, key.c_str(), value, &out), "add", key);
    return out;
  }

  bool deleteKey(const std::string& key) override {
    std::lock_guard<std::mutex> g(mu_);
    int deleted = 0;
    ok(chorus_store_delete(c_, key.c_str(), &deleted), "delete_key", key);
    return deleted != 0;
  }

  bool check(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<const char*> ks;
    for (auto& k : keys) ks.push_back(k.c_str());
    int exists = 0;
    ok(chorus_store_check(c_, ks.data(), static_cast<int>(ks.size()), &exists), "check",
          keys.empty() ? "" : keys[0]);
    return exists != 0;
  }

  int64_t getNumKeys() override {
    std::lock_guard<std::mutex> g(mu_);
    int64_t n = 0;
    ok(chorus_store_num_keys(c_, &n), "num_keys", "");
    return n;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<const char*> ks;
    for (auto& k : keys) ks.push_back(k.c_str());
    ok(chorus_store_wait(c_, ks.data(), static_cast<int>(ks.size()), clampMs(timeout)),
          "wait", keys.empty() ? "" : keys[0]);
  }

 private:
  static int clampMs(std::chrono::milliseconds t) {
    if (t.count() <= 0) return -1;  // the client's default
    return static_cast<int>(std::min<int64_t>(t.count(), INT_MAX));
  }
  void ok(chorus_result_t rc, const char* what, const std::string& key) {
    if (rc != CHORUS_OK)
      fail(c10::str("ChorusStore ", what, "('", key, "') at ", host_, ":", port_, ": ",
                    resultText(rc, chorus_store_last_error(c_))));
  }

  std::string host_;
  int port_;
  chorus_store_t* c_ = nullptr;
  std::mutex mu_;
};

static c10::intrusive_ptr<c10d::ProcessGroup> createProcessGroup(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout) {
  return c10::make_intrusive<ProcessGroupChorus>(store, rank, size, timeout);
}

}  // namespace chorus_torch

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace chorus_torch;
  // The base classes (ProcessGroup, Store, Work) are torch's.
  py::module_::import("torch.distributed");
  m.doc() = "chorus as a torch.distributed backend (torch 1.13 c10d::ProcessGroup)";
  m.attr("CHORUS_VERSION") = py::int_(chorus_version());

  py::class_<ProcessGroupChorus, c10d::ProcessGroup, c10::intrusive_ptr<ProcessGroupChorus>>(
      m, "ProcessGroupChorus",
      "A chorus world bootstrapped through a c10d Store (one per torch group).")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) {
             return c10::make_intrusive<ProcessGroupChorus>(store, rank, size, timeout);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout") = std::chrono::milliseconds(kTorchDefaultTimeoutMs),
           py::call_guard<py::gil_scoped_release>())
      .def("abort", &ProcessGroupChorus::abort,
           "chorus_comm_abort: pending and later operations fail with CHORUS_ERR_ABORTED.",
           py::call_guard<py::gil_scoped_release>())
      .def("status",
           [](const ProcessGroupChorus& pg) {
             return std::string(chorus_result_name(chorus_comm_status(pg.comm())));
           },
           "The communicator's sticky state: 'CHORUS_OK' or the error that failed it.")
      .def("last_error",
           [](const ProcessGroupChorus& pg) {
             return std::string(chorus_comm_last_error(pg.comm()));
           })
      .def_property_readonly("timeout_ms", &ProcessGroupChorus::timeoutMs)
      // What torch reads of a group's options (ProcessGroupGloo and NCCL
      // have the property): the backend's name and the group's timeout.
      .def_property_readonly(
          "options",
          [](const ProcessGroupChorus& pg) {
            return c10::make_intrusive<c10d::ProcessGroup::Options>(
                "chorus", std::chrono::milliseconds(pg.timeoutMs()));
          })
      .def("same_host",
           [](const ProcessGroupChorus& pg, int peer) {
             return chorus_comm_same_host(pg.comm(), peer);
           },
           py::arg("peer"));

  py::class_<ChorusStore, c10d::Store, c10::intrusive_ptr<ChorusStore>>(
      m, "ChorusStore", "A c10d Store over chorus's authenticated store (chorusrun's).")
      .def(py::init([](const std::string& host, int port, std::chrono::milliseconds timeout,
                       const std::string& secret) {
             return c10::make_intrusive<ChorusStore>(host, port, timeout, secret);
           }),
           py::arg("host"), py::arg("port"),
           py::arg("timeout") = std::chrono::milliseconds(300000), py::arg("secret") = "",
           py::call_guard<py::gil_scoped_release>());

  m.def("create_process_group", &createProcessGroup, py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
        "The creator torch.distributed calls for backend 'chorus'.");
}
