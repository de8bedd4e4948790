/*
 * _chorus_store.c - the Store object of `chorus._chorus`: a client of
 * chorus's key-value store (and, with is_master, its server), with
 * torch.distributed.TCPStore's methods.
 */
#include "_chorus.h"

#include <stdio.h>

/* ----------------------------------------------------------------- Store */

typedef struct {
  PyObject_HEAD
  chorus_store_t *client;
  chorus_store_server_t *server;
  int timeout_ms;
  int busy; /* calls in flight on other threads */
} StoreObject;

static void store_close(StoreObject *s) {
  chorus_store_t *c = s->client;
  chorus_store_server_t *sv = s->server;
  s->client = NULL;
  s->server = NULL;
  Py_BEGIN_ALLOW_THREADS
  chorus_store_close(c);
  chorus_store_server_stop(sv);
  Py_END_ALLOW_THREADS
}

static void Store_dealloc(StoreObject *s) {
  store_close(s);
  Py_TYPE(s)->tp_free((PyObject *)s); /* a Python subclass's instance is GC-allocated */
}

/* Store(host, port, is_master=False, secret=None, timeout_ms=300000) */
static int Store_init(StoreObject *s, PyObject *args, PyObject *kw) {
  static char *names[] = {"host", "port", "is_master", "secret", "timeout_ms", NULL};
  const char *host = NULL, *secret = NULL;
  int port = 0, master = 0, ms = 300000;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "zi|pzi", names, &host, &port, &master, &secret,
                                   &ms))
    return -1;
  if (s->client || s->server) {
    PyErr_SetString(PyExc_RuntimeError, "chorus: Store already initialised");
    return -1;
  }
  s->timeout_ms = ms;
  chorus_result_t st = CHORUS_OK;
  char why[600] = "";
  Py_BEGIN_ALLOW_THREADS
  if (master) {
    st = chorus_store_server_start(host, port, secret, &s->server);
    if (st == CHORUS_OK) port = chorus_store_server_port(s->server);
    else snprintf(why, sizeof why, "cannot serve a store on %s:%d (port in use? no job secret "
                  "and CHORUS_INSECURE unset?)", host ? host : "*", port);
  }
  if (st == CHORUS_OK) {
    st = chorus_store_connect(host && *host ? host : "127.0.0.1", port, secret, ms, &s->client);
    if (st != CHORUS_OK)
      snprintf(why, sizeof why, "cannot connect to the store at %s:%d", host ? host : "127.0.0.1",
               port);
  }
  Py_END_ALLOW_THREADS
  if (st != CHORUS_OK) {
    store_close(s);
    chorus__raise_code(st, why);
    return -1;
  }
  return 0;
}

static chorus_store_t *store_ok(StoreObject *s) {
  if (!s->client) PyErr_SetString(PyExc_ValueError, "chorus: the store is closed");
  return s->client;
}

static PyObject *store_error(StoreObject *s, chorus_result_t st) {
  return chorus__raise_code(st, s->client ? chorus_store_last_error(s->client) : "");
}

/* key: str (UTF-8) */
static const char *key_of(PyObject *o) {
  if (!PyUnicode_Check(o)) {
    PyErr_SetString(PyExc_TypeError, "chorus: store keys are str");
    return NULL;
  }
  return PyUnicode_AsUTF8(o);
}

/* st = expr, with the GIL released and the store marked busy. */
#define STORE_CALL(s, st, expr)                                                \
  do {                                                                         \
    (s)->busy++;                                                               \
    Py_BEGIN_ALLOW_THREADS                                                     \
    st = (expr);                                                               \
    Py_END_ALLOW_THREADS                                                       \
    (s)->busy--;                                                               \
  } while (0)

static PyObject *Store_set(StoreObject *s, PyObject *const *a, Py_ssize_t n) {
  chorus_store_t *c = store_ok(s);
  if (!c || chorus__nargs_is(n, 2, "set(key, value)")) return NULL;
  const char *key = key_of(a[0]);
  if (!key) return NULL;
  Py_buffer v;
  PyObject *enc = NULL;
  if (PyUnicode_Check(a[1])) {
    if (!(enc = PyUnicode_AsUTF8String(a[1]))) return NULL;
  }
  if (PyObject_GetBuffer(enc ? enc : a[1], &v, PyBUF_SIMPLE) < 0) {
    Py_XDECREF(enc);
    return NULL;
  }
  chorus_result_t st;
  STORE_CALL(s, st, chorus_store_set(c, key, v.buf, (size_t)v.len));
  PyBuffer_Release(&v);
  Py_XDECREF(enc);
  if (st != CHORUS_OK) return store_error(s, st);
  Py_RETURN_NONE;
}

static PyObject *Store_get(StoreObject *s, PyObject *arg) {
  chorus_store_t *c = store_ok(s);
  const char *key = c ? key_of(arg) : NULL;
  if (!key) return NULL;
  void *val = NULL;
  size_t len = 0;
  chorus_result_t st;
  STORE_CALL(s, st, chorus_store_get(c, key, &val, &len));
  if (st != CHORUS_OK) return store_error(s, st);
  PyObject *out = PyBytes_FromStringAndSize(val, (Py_ssize_t)len);
  chorus_free(val);
  return out;
}

static PyObject *Store_add(StoreObject *s, PyObject *const *a, Py_ssize_t n) {
  chorus_store_t *c = store_ok(s);
  if (!c || chorus__nargs_is(n, 2, "add(key, amount)")) return NULL;
  const char *key = key_of(a[0]);
  long long d = PyLong_AsLongLong(a[1]);
  if (!key || (d == -1 && PyErr_Occurred())) return NULL;
  int64_t res = 0;
  chorus_result_t st;
  STORE_CALL(s, st, chorus_store_add(c, key, d, &res));
  if (st != CHORUS_OK) return store_error(s, st);
  return PyLong_FromLongLong(res);
}

static PyObject *Store_compare_set(StoreObject *s, PyObject *const *a, Py_ssize_t n) {
  chorus_store_t *c = store_ok(s);
  if (!c || chorus__nargs_is(n, 3, "compare_set(key, expected, desired)")) return NULL;
  const char *key = key_of(a[0]);
  if (!key) return NULL;
  Py_buffer e, d;
  if (PyObject_GetBuffer(a[1], &e, PyBUF_SIMPLE) < 0) return NULL;
  if (PyObject_GetBuffer(a[2], &d, PyBUF_SIMPLE) < 0) {
    PyBuffer_Release(&e);
    return NULL;
  }
  void *cur = NULL;
  size_t cl = 0;
  chorus_result_t st;
  STORE_CALL(s, st, chorus_store_compare_set(c, key, e.len ? e.buf : NULL, (size_t)e.len, d.buf,
                                  (size_t)d.len, &cur, &cl));
  PyBuffer_Release(&e);
  PyBuffer_Release(&d);
  if (st != CHORUS_OK) return store_error(s, st);
  PyObject *out = PyBytes_FromStringAndSize(cur, (Py_ssize_t)cl);
  chorus_free(cur);
  return out;
}

/* A list of str keys -> a C array (pointers into the str objects, kept
 * alive by *hold). */
static const char **keys_of(PyObject *seq, Py_ssize_t *n, PyObject **hold) {
  if (!(*hold = PySequence_Fast(seq, "chorus: expected a list of keys"))) return NULL;
  *n = PySequence_Fast_GET_SIZE(*hold);
  const char **keys = PyMem_Malloc(sizeof(char *) * (size_t)(*n ? *n : 1));
  if (!keys) {
    Py_CLEAR(*hold);
    PyErr_NoMemory();
    return NULL;
  }
  for (Py_ssize_t i = 0; i < *n; i++)
    if (!(keys[i] = key_of(PySequence_Fast_GET_ITEM(*hold, i)))) {
      PyMem_Free(keys);
      Py_CLEAR(*hold);
      return NULL;
    }
  return keys;
}

static PyObject *Store_check(StoreObject *s, PyObject *arg) {
  chorus_store_t *c = store_ok(s);
  if (!c) return NULL;
  PyObject *hold;
  Py_ssize_t n;
  const char **keys = keys_of(arg, &n, &hold);
  if (!keys) return NULL;
  int exists = 0;
  chorus_result_t st;
  STORE_CALL(s, st, chorus_store_check(c, keys, (int)n, &exists));
  PyMem_Free(keys);
  Py_DECREF(hold);
  if (st != CHORUS_OK) return store_error(s, st);
  return PyBool_FromLong(exists);
}

static PyObject *Store_wait(StoreObject *s, PyObject *const *a, Py_ssize_t n) {
  chorus_store_t *c = store_ok(s);
  if (!c) return NULL;
  if (n < 1 || n > 2) {
    PyErr_SetString(PyExc_TypeError, "wait(keys, timeout_ms=None)");
    return NULL;
  }
  long ms = -1;
  if (n == 2 && a[1] != Py_None && (ms = PyLong_AsLong(a[1])) == -1 && PyErr_Occurred())
    return NULL;
  PyObject *hold;
  Py_ssize_t nk;
  const char **keys = keys_of(a[0], &nk, &hold);
  if (!keys) return NULL;
  chorus_result_t st;
  STORE_CALL(s, st, chorus_store_wait(c, keys, (int)nk, (int)ms));
  PyMem_Free(keys);
  Py_DECREF(hold);
  if (st != CHORUS_OK) return store_error(s, st);
  Py_RETURN_NONE;
}

static PyObject *Store_delete_key(StoreObject *s, PyObject *arg) {
  chorus_store_t *c = store_ok(s);
  const char *key = c ? key_of(arg) : NULL;
  if (!key) return NULL;
  int del = 0;
  chorus_result_t st;
  STORE_CALL(s, st, chorus_store_delete(c, key, &del));
  if (st != CHORUS_OK) return store_error(s, st);
  return PyBool_FromLong(del);
}

static PyObject *Store_num_keys(StoreObject *s, PyObject *u) {
  chorus_store_t *c = store_ok(s);
  if (!c) return NULL;
  int64_t num = 0;
  chorus_result_t st;
  STORE_CALL(s, st, chorus_store_num_keys(c, &num));
  if (st != CHORUS_OK) return store_error(s, st);
  return PyLong_FromLongLong(num);
}

static PyObject *Store_port(StoreObject *s, PyObject *u) {
  if (!s->server) Py_RETURN_NONE;
  return PyLong_FromLong(chorus_store_server_port(s->server));
}

static PyObject *Store_close(StoreObject *s, PyObject *u) {
  if (s->busy) {
    PyErr_SetString(PyExc_RuntimeError, "chorus: close() while another thread uses the store");
    return NULL;
  }
  store_close(s);
  Py_RETURN_NONE;
}

static PyMethodDef Store_methods[] = {
    {"set", (PyCFunction)(void (*)(void))Store_set, METH_FASTCALL, "set(key, value)"},
    {"get", (PyCFunction)Store_get, METH_O, "get(key) -> bytes (waits for the key)"},
    {"add", (PyCFunction)(void (*)(void))Store_add, METH_FASTCALL, "add(key, amount) -> int"},
    {"compare_set", (PyCFunction)(void (*)(void))Store_compare_set, METH_FASTCALL,
     "compare_set(key, expected, desired) -> bytes"},
    {"check", (PyCFunction)Store_check, METH_O, "check(keys) -> bool, never waits"},
    {"wait", (PyCFunction)(void (*)(void))Store_wait, METH_FASTCALL,
     "wait(keys, timeout_ms=None)"},
    {"delete_key", (PyCFunction)Store_delete_key, METH_O, "delete_key(key) -> bool"},
    {"num_keys", (PyCFunction)Store_num_keys, METH_NOARGS, "number of keys"},
    {"port", (PyCFunction)Store_port, METH_NOARGS, "the port served (is_master) or None"},
    {"close", (PyCFunction)Store_close, METH_NOARGS, "disconnect (and stop serving)"},
    {NULL, NULL, 0, NULL}};

PyTypeObject chorus__StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "chorus._chorus.Store",
    .tp_basicsize = sizeof(StoreObject),
    .tp_dealloc = (destructor)Store_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "chorus's key-value store (torch.distributed.TCPStore's methods).",
    .tp_methods = Store_methods,
    .tp_init = (initproc)Store_init,
    .tp_new = PyType_GenericNew,
};
