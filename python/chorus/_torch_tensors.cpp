/*
 * _torch_tensors.cpp - torch's tensors made into chorus's arguments: the
 * checks that refuse a call naming it (dense CPU tensors, dtypes and sizes
 * that agree), chorus's dtype and op of a tensor and a ReduceOp, and the
 * contiguous buffers (or temporaries, copied back) chorus reads and writes.
 */
#include "_torch.h"

#include <ATen/MemoryOverlap.h>

namespace chorus_torch {

[[noreturn]] void fail(const std::string& msg) {
  throw std::runtime_error(msg);
}

// "CHORUS_ERR_...: what happened".  A timeout also says so in torch's
// words ("Timed out waiting", as Gloo says it), which torch's own tests
// and users' log scrapers look for; chorus's message follows, naming the
// call, the ranks waited for and what to do.
std::string resultText(chorus_result_t rc, const char* msg) {
  std::string s = chorus_result_name(rc);
  s += ": ";
  if (rc == CHORUS_ERR_TIMEOUT) s += "Timed out waiting for other ranks: ";
  s += (msg && *msg) ? msg : chorus_strerror(rc);
  return s;
}

std::string dtypeName(at::ScalarType t) {
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

std::string sizesStr(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); i++) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  return s + "]";
}

const char* redOpName(ReduceOp::RedOpType op) {
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
void checkTensor(const char* fn, const at::Tensor& t, const char* what) {
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
void checkPair(const char* fn, const at::Tensor& input, const at::Tensor& output) {
  checkTensor(fn, input, "the input");
  checkTensor(fn, output, "the output");
  if (output.scalar_type() != input.scalar_type())
    fail(c10::str("chorus ", fn, ": the output has dtype ", dtypeName(output.scalar_type()),
                  " but the input has ", dtypeName(input.scalar_type())));
}

// chorus's element type of t.  torch.bool travels as uint8 in ops that only
// move bytes (reducing == false).
chorus_dtype_t dtypeOf(const char* fn, const at::Tensor& t, bool reducing) {
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
chorus_op_t opOf(const char* fn, const ReduceOp& op, chorus_dtype_t dt) {
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
at::Tensor premulInput(const char* fn, const ReduceOp& op, const at::Tensor& t,
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

size_t nelem(const at::Tensor& t) {
  return static_cast<size_t>(t.numel());
}

// Byte ranges of two contiguous tensors intersect.
bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  auto a0 = reinterpret_cast<uintptr_t>(a.data_ptr()), a1 = a0 + a.nbytes();
  auto b0 = reinterpret_cast<uintptr_t>(b.data_ptr()), b1 = b0 + b.nbytes();
  return a0 < b1 && b0 < a1;
}

char* bytePtr(const at::Tensor& t) {
  return static_cast<char*>(t.data_ptr());
}

// ts are contiguous and lie one after the other in memory, each of the same
// size: one flat buffer that chorus can use as is.
bool consecutive(const std::vector<at::Tensor>& ts) {
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
at::Tensor flatOver(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (auto& t : ts) n += t.numel();
  if (n == 0) return at::empty({0}, ts[0].options());
  return at::from_blob(ts[0].data_ptr(), {n}, ts[0].options());
}

// An input chorus may read: t itself when contiguous, else a contiguous copy.
at::Tensor inputBuffer(const at::Tensor& t) {
  return t.is_contiguous() ? t : t.contiguous();
}

// An output chorus may write: t itself when contiguous, else a contiguous
// temporary that is copied into t when the operation completes.  An output
// with internal overlap (an expanded tensor) cannot hold a result.
at::Tensor outputBuffer(const char* fn, const at::Tensor& t, TensorPairs& copies,
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
at::Tensor pack(const std::vector<at::Tensor>& ts, const at::TensorOptions& opts) {
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
void unpackInto(const at::Tensor& flat, const std::vector<at::Tensor>& ts,
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
void checkSameTypeAndSizes(const char* fn, const at::Tensor& expected,
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

void checkSingle(const char* fn, size_t n, const char* what) {
  if (n != 1)
    fail(c10::str("chorus ", fn, ": takes exactly one ", what, " per rank (got ", n,
                  "); lists of several tensors per rank (the multi-device forms) are not "
                  "supported on CPU"));
}

}  // namespace chorus_torch
