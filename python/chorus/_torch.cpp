/*
 * _torch.cpp - the module `chorus._torch`: the creator torch.distributed
 * calls for backend "chorus", the group's bootstrap through torch's
 * c10d::Store, ChorusStore and the pybind11 registration.  _torch.h names
 * the other files.
 *
 * ChorusStore is a c10d::Store over chorus's own (authenticated) store, for
 * jobs started by chorusrun, whose MASTER_ADDR:MASTER_PORT is that store
 * (python/chorus/torch.py uses it for env:// there).
 */
#include <torch/extension.h>

#include <pybind11/chrono.h>

#include "_torch.h"

namespace chorus_torch {

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

ProcessGroupChorus::ProcessGroupChorus(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                       int size, std::chrono::milliseconds timeout)
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
