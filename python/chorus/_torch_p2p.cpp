/*
 * _torch_p2p.cpp - point-to-point on ProcessGroupChorus: send, recv (from a
 * rank or any source), and monitoredBarrier, built on tagged messages.
 */
#include "_torch.h"

namespace chorus_torch {

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::send(std::vector<at::Tensor>& tensors,
                                                        int dstRank, int tag) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::recv(std::vector<at::Tensor>& tensors,
                                                        int srcRank, int tag) {
  return receive(tensors, srcRank, tag);
}

// dist.recv / irecv without src: the first message with the tag from any
// rank, matched in the order receives were posted (chorus_recv with
// CHORUS_ANY_SOURCE); Work.source_rank() names the sender.
c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::recvAnysource(std::vector<at::Tensor>& tensors,
                                                                 int tag) {
  return receive(tensors, CHORUS_ANY_SOURCE, tag);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::receive(std::vector<at::Tensor>& tensors,
                                                           int srcRank, int tag) {
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

// peer: a rank of the group, or CHORUS_ANY_SOURCE where anyOk (recv).
void ProcessGroupChorus::checkPeer(const char* fn, int peer, int tag, bool anyOk) const {
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

// Gloo's protocol and messages over tagged point-to-point messages: every
// rank reports to rank 0 and waits for its answer; only rank 0 applies
// the barrier's timeout (the others wait as long as the group's timeout
// allows, so that rank 0, not they, names the rank that failed).  Unlike
// Gloo, rank 0 answers every rank, failed or not, with the verdict (which
// ranks failed), so the ranks that did arrive fail at once with rank 0's
// finding instead of at their own timeout, and every message posted has
// its match.  A late rank gets the verdict when it arrives.
void ProcessGroupChorus::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
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

}  // namespace chorus_torch
