/*
 * _chorus.c - the module of the CPython extension under `import chorus`:
 * its error classes, making a world (init, init_env), its functions and
 * its init.  The extension wraps the communicators, work handles and the
 * store of libchorus, over anything with the buffer protocol (NumPy arrays,
 * bytearray, memoryview, array.array); _chorus.h names its other files.
 *
 * This layer is deliberately thin.  It turns buffers into (pointer, count,
 * dtype) with the checks the C API cannot make -- contiguity, writability,
 * element type, sizes that agree -- calls the library with the GIL released,
 * and turns a failing result code into the exception class registered for
 * it (chorus/_errors.py), carrying the library's message unchanged.  The
 * torch.distributed-shaped API (groups, global ranks, lists, objects) is
 * chorus/__init__.py.
 */
#include "_chorus.h"

/* ----------------------------------------------------------------- errors */

PyObject *chorus__err_class[NCODES];

PyObject *chorus__raise_code(chorus_result_t st, const char *msg) {
  int i = -(int)st;
  PyObject *cls =
      (i > 0 && i < NCODES && chorus__err_class[i]) ? chorus__err_class[i] : chorus__err_class[0];
  if (!cls) cls = PyExc_RuntimeError;
  if (!msg || !*msg) msg = chorus_strerror(st);
  PyErr_Format(cls, "%s: %s", chorus_result_name(st), msg);
  return NULL;
}

/* ------------------------------------------------------- making a world */

/* init_env(): chorus_comm_init_env (RANK/WORLD_SIZE/MASTER_*, srun, mpirun). */
static PyObject *mod_init_env(PyObject *m, PyObject *u) {
  chorus_comm_t comm = NULL;
  chorus_result_t st;
  Py_BEGIN_ALLOW_THREADS
  st = chorus_comm_init_env(&comm);
  Py_END_ALLOW_THREADS
  if (st != CHORUS_OK) return chorus__raise_code(st, chorus_last_init_error());
  return chorus__comm_wrap(comm);
}

/* init(rank, world_size, host, port, timeout_ms, secret, local_rank,
 *      local_world_size, host_store, store_prefix) */
static PyObject *mod_init(PyObject *m, PyObject *args, PyObject *kw) {
  static char *names[] = {"rank",  "world_size", "host",       "port",       "timeout_ms",
                          "secret", "local_rank", "local_world_size", "host_store",
                          "store_prefix", NULL};
  chorus_config_t cfg = CHORUS_CONFIG_INITIALIZER;
  const char *host = NULL, *secret = NULL, *prefix = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "iisi|iziiiz", names, &cfg.rank, &cfg.world_size,
                                   &host, &cfg.store_port, &cfg.timeout_ms, &secret,
                                   &cfg.local_rank, &cfg.local_world_size, &cfg.host_store,
                                   &prefix))
    return NULL;
  cfg.store_host = host;
  cfg.job_secret = secret;
  cfg.store_prefix = prefix;
  chorus_comm_t comm = NULL;
  chorus_result_t st;
  Py_BEGIN_ALLOW_THREADS
  st = chorus_comm_init(&cfg, &comm);
  Py_END_ALLOW_THREADS
  if (st != CHORUS_OK) return chorus__raise_code(st, chorus_last_init_error());
  return chorus__comm_wrap(comm);
}

/* --------------------------------------------------------------- module */

/* _set_error_classes({code: class, 0: base}) */
static PyObject *mod_set_error_classes(PyObject *m, PyObject *d) {
  if (!PyDict_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "expected a dict");
    return NULL;
  }
  for (int i = 0; i < NCODES; i++) {
    PyObject *k = PyLong_FromLong(-i);
    PyObject *cls = k ? PyDict_GetItemWithError(d, k) : NULL;
    Py_XDECREF(k);
    if (!cls && PyErr_Occurred()) return NULL;
    Py_XINCREF(cls);
    Py_XSETREF(chorus__err_class[i], cls);
  }
  Py_RETURN_NONE;
}

static PyObject *mod_names(PyObject *m, PyObject *u) {
  /* {"dtypes": {...}, "ops": {...}, "colls": {...}, "results": {...}} */
  PyObject *out = PyDict_New(), *d;
#define ADD(dict, name, val)                                                   \
  do {                                                                         \
    PyObject *v_ = PyLong_FromLong(val);                                       \
    if (!v_ || PyDict_SetItemString(dict, name, v_) < 0) {                     \
      Py_XDECREF(v_);                                                          \
      goto fail;                                                               \
    }                                                                          \
    Py_DECREF(v_);                                                             \
  } while (0)
  if (!out) return NULL;
  if (!(d = PyDict_New()) || PyDict_SetItemString(out, "dtypes", d) < 0) goto fail_d;
#define DT(NAME, name, sz) ADD(d, #name, CHORUS_##NAME);
  CHORUS_DTYPE_MAP(DT)
#undef DT
  Py_DECREF(d);
  if (!(d = PyDict_New()) || PyDict_SetItemString(out, "ops", d) < 0) goto fail_d;
#define OP(NAME, name) ADD(d, #NAME, CHORUS_##NAME);
  CHORUS_OP_MAP(OP)
#undef OP
  Py_DECREF(d);
  if (!(d = PyDict_New()) || PyDict_SetItemString(out, "colls", d) < 0) goto fail_d;
#define CO(NAME, name) ADD(d, #name, CHORUS_COLL_##NAME);
  CHORUS_COLL_MAP(CO)
#undef CO
  Py_DECREF(d);
  if (!(d = PyDict_New()) || PyDict_SetItemString(out, "results", d) < 0) goto fail_d;
#define RE(NAME, val, desc) ADD(d, "CHORUS_" #NAME, val);
  CHORUS_RESULT_MAP(RE)
#undef RE
  Py_DECREF(d);
  return out;
fail_d:
  Py_XDECREF(d);
  Py_DECREF(out);
  return NULL;
fail:
  Py_DECREF(d);
  Py_DECREF(out);
  return NULL;
#undef ADD
}

/* dtype_of(obj) -> the chorus dtype code its buffer format names. */
static PyObject *mod_dtype_of(PyObject *m, PyObject *obj) {
  buf_t b;
  if (chorus__buf_get(obj, 0, -1, &b, "the tensor") < 0) {
    chorus__buf_release(&b);
    return NULL;
  }
  int dt = b.dtype;
  chorus__buf_release(&b);
  return PyLong_FromLong(dt);
}

static PyObject *mod_strerror(PyObject *m, PyObject *arg) {
  long code = PyLong_AsLong(arg);
  if (code == -1 && PyErr_Occurred()) return NULL;
  return PyUnicode_FromString(chorus_strerror((chorus_result_t)code));
}

static PyObject *mod_version(PyObject *m, PyObject *u) { return PyLong_FromLong(chorus_version()); }

/* A no-op: the floor under every measurement of this layer's cost. */
static PyObject *mod_noop(PyObject *m, PyObject *const *a, Py_ssize_t n) { Py_RETURN_NONE; }

static PyMethodDef mod_methods[] = {
    {"init_env", mod_init_env, METH_NOARGS, "communicator from the environment"},
    {"init", (PyCFunction)(void (*)(void))mod_init, METH_VARARGS | METH_KEYWORDS,
     "communicator from explicit values"},
    {"_set_error_classes", mod_set_error_classes, METH_O, NULL},
    {"names", mod_names, METH_NOARGS, "dtype, op, collective and result codes"},
    {"strerror", mod_strerror, METH_O, "description of a result code"},
    {"dtype_of", mod_dtype_of, METH_O, "chorus dtype code of a buffer"},
    {"version", mod_version, METH_NOARGS, "CHORUS_VERSION of the library"},
    {"_noop", (PyCFunction)(void (*)(void))mod_noop, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef mod_def = {PyModuleDef_HEAD_INIT, "_chorus",
                                     "libchorus for Python (see chorus/__init__.py)", -1,
                                     mod_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__chorus(void) {
  if (PyType_Ready(&chorus__CommType) < 0 || PyType_Ready(&chorus__WorkType) < 0 ||
      PyType_Ready(&chorus__StoreType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&mod_def);
  if (!m) return NULL;
  Py_INCREF(&chorus__CommType);
  Py_INCREF(&chorus__WorkType);
  Py_INCREF(&chorus__StoreType);
  if (PyModule_AddObject(m, "Comm", (PyObject *)&chorus__CommType) < 0 ||
      PyModule_AddObject(m, "Work", (PyObject *)&chorus__WorkType) < 0 ||
      PyModule_AddObject(m, "Store", (PyObject *)&chorus__StoreType) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
