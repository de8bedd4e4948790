/*
 * _torch.h - what the files of the PyTorch backend (`chorus._torch`, torch
 * 1.13's c10d::ProcessGroup over chorus.h, a thin C++17 shim) share: the
 * communicator a group and its Works hold, ChorusWork, ProcessGroupChorus,
 * and the checks and buffers between torch's tensors and chorus's calls.
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
 * roots, split sizes) and raise at call time, leaving the group usable as
 * Gloo's does: when the other ranks did enter the call, this rank's next
 * collective meets theirs and every rank fails with CHORUS_ERR_MISMATCH
 * (_torch_coll.cpp).  The library's errors read "CHORUS_ERR_<CODE>: <its
 * message>".
 * Non-contiguous tensors go through contiguous temporaries, copied back on
 * completion.
 *
 *   _torch.cpp          the module: bootstrap, ChorusStore, pybind11 registration
 *   _torch_tensors.cpp  torch's tensors to chorus's arguments: checks, dtypes,
 *                       ops, contiguous temporaries
 *   _torch_work.cpp     ChorusWork and the group's completion thread
 *   _torch_coll.cpp     the collectives of ProcessGroupChorus
 *   _torch_p2p.cpp      send, recv and the monitored barrier
 */
#ifndef CHORUS_PYTHON_TORCH_H
#define CHORUS_PYTHON_TORCH_H

#include <Python.h>

#include <ATen/ATen.h>
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

[[noreturn]] void fail(const std::string& msg);

// The library refused a call (its message, prefixed with the code's name).
struct LibraryError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// _torch_tensors.cpp: an error's text and names for messages; argument
// checks that throw, naming the call (fn); chorus's dtype and op of a
// tensor and a ReduceOp; the contiguous buffers chorus reads and writes.
std::string resultText(chorus_result_t rc, const char* msg);
std::string dtypeName(at::ScalarType t);
std::string sizesStr(const at::Tensor& t);
const char* redOpName(ReduceOp::RedOpType op);
void checkTensor(const char* fn, const at::Tensor& t, const char* what);
void checkPair(const char* fn, const at::Tensor& input, const at::Tensor& output);
void checkSameTypeAndSizes(const char* fn, const at::Tensor& expected, const at::Tensor& t,
                           const std::string& what, const char* expectedWhat);
void checkSingle(const char* fn, size_t n, const char* what);
chorus_dtype_t dtypeOf(const char* fn, const at::Tensor& t, bool reducing);
chorus_op_t opOf(const char* fn, const ReduceOp& op, chorus_dtype_t dt);
at::Tensor premulInput(const char* fn, const ReduceOp& op, const at::Tensor& t, size_t idx);
size_t nelem(const at::Tensor& t);
bool overlaps(const at::Tensor& a, const at::Tensor& b);
char* bytePtr(const at::Tensor& t);
bool consecutive(const std::vector<at::Tensor>& ts);
at::Tensor flatOver(const std::vector<at::Tensor>& ts);
at::Tensor inputBuffer(const at::Tensor& t);
at::Tensor outputBuffer(const char* fn, const at::Tensor& t, TensorPairs& copies, bool keepData);
at::Tensor pack(const std::vector<at::Tensor>& ts, const at::TensorOptions& opts);
void unpackInto(const at::Tensor& flat, const std::vector<at::Tensor>& ts, TensorPairs& copies);

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

// ------------------------------------------------------------------- Work

// The handle of one operation (_torch_work.cpp).
class ChorusWork : public c10d::Work {
 public:
  ChorusWork(int rank, OpType type, const char* title, const std::vector<at::Tensor>* inputs,
             std::shared_ptr<Comm> comm, std::shared_ptr<Completer> completer,
             std::vector<at::Tensor> outputs, std::vector<at::Tensor> keep,
             TensorPairs copies, int srcRank);
  ~ChorusWork() override;

  chorus_work_t* handle() { return &h_; }

  bool isCompleted() override;
  bool wait(std::chrono::milliseconds timeout) override;

  void synchronize() override {}

  void abort() override { chorus_comm_abort(comm_->comm); }

  int sourceRank() const override;

  // srcRank of a receive from any source: sourceRank() asks the library.
  static constexpr int kFromAnyRank = -2;

  std::vector<at::Tensor> result() override { return outputs_; }
  // The Future's value is this list of lists (allgather with several
  // tensors per rank, as Gloo's); set before anyone can ask for it.
  void setNested(std::vector<std::vector<at::Tensor>> v) { nested_ = std::move(v); }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  void completeBlocking();
  bool complete(chorus_result_t rc);

 private:
  static bool profiling();
  static const c10::TypePtr& listOfTensors();
  static const c10::TypePtr& listOfLists();
  c10::IValue value() const;
  bool done();
  c10::intrusive_ptr<c10::ivalue::Future> future();
  void settle(const c10::intrusive_ptr<c10::ivalue::Future>& f, std::exception_ptr e);
  bool finishing();
  void awaitFinish();

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

// ------------------------------------------------------------ ProcessGroup

class ProcessGroupChorus : public c10d::ProcessGroup {
 public:
  // Bootstraps the group's chorus world through store (_torch.cpp).
  ProcessGroupChorus(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                     std::chrono::milliseconds timeout);

  ~ProcessGroupChorus() override { completer_->shutdown(); }

  const std::string getBackendName() const override { return "chorus"; }

  chorus_comm_t comm() const { return comm_->comm; }
  int timeoutMs() const { return timeoutMs_; }

  // ---- collectives (_torch_coll.cpp)
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> allgatherSeveral(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs);
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions&) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outSplits,
                                               std::vector<int64_t>& inSplits,
                                               const c10d::AllToAllOptions&) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions&) override;

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override;
  // all_reduce of sparse tensors
  c10::intrusive_ptr<ChorusWork> sparseAllreduce(std::vector<at::Tensor>& tensors,
                                                 const c10d::AllreduceOptions& opts);
  [[noreturn]] void sparseMismatch(int r, const std::string& what) const;

  // ---- point-to-point (_torch_p2p.cpp)
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> receive(std::vector<at::Tensor>& tensors, int srcRank, int tag);
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

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

  // Argument checks and the local part of an allreduce (_torch_coll.cpp;
  // checkPeer: _torch_p2p.cpp).
  void checkRoot(const char* fn, int64_t root) const;
  void checkPeer(const char* fn, int peer, int tag, bool anyOk = false) const;
  void checkList(const char* fn, const std::vector<at::Tensor>& list, const at::Tensor& ref,
                 const char* what, const char* side = nullptr, const char* Side = nullptr) const;
  void splits(const char* fn, const char* what, const at::Tensor& t,
              const std::vector<int64_t>& split, std::vector<size_t>& counts,
              std::vector<size_t>& displs) const;
  static at::Tensor localReduce(const std::vector<at::Tensor>& ts, ReduceOp::RedOpType op);

  std::shared_ptr<Comm> comm_;
  std::shared_ptr<Completer> completer_;
  std::atomic<uint64_t> seq_{0};
  int timeoutMs_ = 0;
};

}  // namespace chorus_torch

#endif
