/*
 * _torch_coll.cpp - the collectives of ProcessGroupChorus: each checks its
 * tensors, picks chorus's buffers for them and issues one chorus collective
 * as a ChorusWork (the sparse all_reduce gathers and sums in place).
 */
#include "_torch.h"

namespace chorus_torch {

// ---- collectives
//
// An argument error (this rank's, or one the library refused before
// anything was sent) only throws: the group stays usable, as Gloo's does
// (issue 42).  When the other ranks did enter the call, the next
// collective of this rank meets theirs and every rank fails with
// CHORUS_ERR_MISMATCH; one that never calls again leaves them to their
// timeout, as on Gloo.

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions&) {
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
c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allgatherSeveral(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::_allgather_base(at::Tensor& output,
                                                                   at::Tensor& input,
                                                                   const c10d::AllgatherOptions&) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions&) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::alltoall_base(at::Tensor& output,
                                                                 at::Tensor& input,
                                                                 std::vector<int64_t>& outSplits,
                                                                 std::vector<int64_t>& inSplits,
                                                                 const c10d::AllToAllOptions&) {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions&) {
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

// all_reduce of a sparse COO tensor (SUM), as Gloo does it: every rank's
// coalesced indices and values go to every rank (one variable-size
// all-gather: a header -- dtype, dims, sizes, nnz -- then the indices,
// then the values), which sums them by coalescing and writes the result
// into the tensor.  Blocking: the Work it returns has completed.  What
// arrives is checked (lengths, and the header against this rank's own);
// every rank sees the same bytes, so a mismatch fails every rank alike.
c10::intrusive_ptr<ChorusWork> ProcessGroupChorus::sparseAllreduce(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
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

void ProcessGroupChorus::sparseMismatch(int r, const std::string& what) const {
  fail(c10::str("chorus allreduce: sparse tensors differ between the ranks: rank ", r, " ",
                what, "; every rank must pass a tensor of the same dtype, sparse dimension "
                "and size"));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupChorus::barrier(const c10d::BarrierOptions&) {
  return issue(OpType::BARRIER, "chorus:barrier", nullptr, {}, {}, {}, true,
               [&](chorus_work_t* w) { return chorus_barrier(comm(), w); });
}

void ProcessGroupChorus::checkRoot(const char* fn, int64_t root) const {
  if (root < 0 || root >= size_)
    fail(c10::str("chorus ", fn, ": invalid root rank: ", root, " is not in [0, ", size_, ")"));
}

// A list of size_ tensors, each of the reference's dtype and sizes.
void ProcessGroupChorus::checkList(const char* fn, const std::vector<at::Tensor>& list,
                                   const at::Tensor& ref, const char* what, const char* side,
                                   const char* Side) const {
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
void ProcessGroupChorus::splits(const char* fn, const char* what, const at::Tensor& t,
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
at::Tensor ProcessGroupChorus::localReduce(const std::vector<at::Tensor>& ts,
                                           ReduceOp::RedOpType op) {
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

}  // namespace chorus_torch
