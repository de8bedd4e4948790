/*
 * _chorus.c - the CPython extension under `import chorus`: communicators,
 * work handles and the store of libchorus, over anything with the buffer
 * protocol (NumPy arrays, bytearray, memoryview, array.array).
 *
 * This layer is deliberately thin.  It turns buffers into (pointer, count,
 * dtype) with the checks the C API cannot make -- contiguity, writability,
 * element type, sizes that agree -- calls the library with the GIL released,
 * and turns a failing result code into the exception class registered for
 * it (chorus/_errors.py), carrying the library's message unchanged.  The
 * torch.distributed-shaped API (groups, global ranks, lists, objects) is
 * chorus/__init__.py.
 *
 * Lifetimes.  An asynchronous call returns a Work that holds the buffers it
 * names (Py_buffer views: the arrays cannot be freed or resized meanwhile)
 * and a reference to its Comm.  A Comm keeps a list of its live Works so
 * that destroy() can finish them first (the C API wants every handle freed
 * before the communicator).  Calls that block count themselves in
 * `inflight`; destroy() refuses while another thread is inside one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#include "chorus.h"

/* ----------------------------------------------------------------- errors */

#define NCODES 12 /* -0 .. -11 */
static PyObject *g_err_class[NCODES]; /* by -code; [0]: the base class */

/* Raises the class registered for st with msg (the library's words). */
static PyObject *raise_code(chorus_result_t st, const char *msg) {
  int i = -(int)st;
  PyObject *cls = (i > 0 && i < NCODES && g_err_class[i]) ? g_err_class[i] : g_err_class[0];
  if (!cls) cls = PyExc_RuntimeError;
  if (!msg || !*msg) msg = chorus_strerror(st);
  PyErr_Format(cls, "%s: %s", chorus_result_name(st), msg);
  return NULL;
}

/* ------------------------------------------------------------------ dtypes */

/* The chorus dtype of a buffer from its struct-module format, or -1 with
 * a ValueError.  Native or little-endian only (this is a little-endian
 * library on little-endian hosts). */
static int dtype_of_format(const Py_buffer *v) {
  const char *f = v->format ? v->format : "B";
  if (*f == '@' || *f == '=' || *f == '<') f++;
  if (f[0] && !f[1]) {
    switch (f[0]) {
      case 'b': return CHORUS_INT8;
      case 'B': return CHORUS_UINT8;
      case 'e': return CHORUS_FLOAT16;
      case 'f': return CHORUS_FLOAT32;
      case 'd': return CHORUS_FLOAT64;
      case 'i': case 'l': case 'q':
        if (v->itemsize == 4) return CHORUS_INT32;
        if (v->itemsize == 8) return CHORUS_INT64;
        break;
      default: break;
    }
  }
  PyErr_Format(PyExc_ValueError, "chorus: element type '%s' (%zd bytes) is not one chorus "
               "reduces; use int8, uint8, int32, int64, float16, float32, float64, or pass "
               "dtype='bfloat16' with 2-byte elements", v->format ? v->format : "B",
               v->itemsize);
  return -1;
}

/* A buffer argument.  `want`: the dtype the caller named (-1: from the
 * buffer's format).  Fills the view (released by the caller) and returns
 * its dtype and element count, or -1 with an exception. */
typedef struct {
  Py_buffer view;
  int held;
  int dtype;
  size_t count;
} buf_t;

static int buf_get(PyObject *obj, int writable, int want, buf_t *b, const char *what) {
  b->held = 0;
  if (PyObject_GetBuffer(obj, &b->view, PyBUF_FORMAT | PyBUF_STRIDES |
                                            (writable ? PyBUF_WRITABLE : 0)) < 0) {
    if (PyErr_ExceptionMatches(PyExc_TypeError) && !PyObject_CheckBuffer(obj)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "chorus: %s must support the buffer protocol (a NumPy array, "
                   "bytearray, memoryview), not %.100s", what, Py_TYPE(obj)->tp_name);
    } else if (writable && PyErr_ExceptionMatches(PyExc_BufferError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError, "chorus: %s must be writable (it receives the result)",
                   what);
    }
    return -1;
  }
  b->held = 1;
  if (!PyBuffer_IsContiguous(&b->view, 'C')) {
    PyErr_Format(PyExc_ValueError, "chorus: %s is not C-contiguous; pass a contiguous copy "
                 "(numpy.ascontiguousarray) and copy the result back", what);
    return -1;
  }
  int dt = want;
  if (want < 0) {
    if ((dt = dtype_of_format(&b->view)) < 0) return -1;
  } else {
    size_t es = chorus_dtype_size((chorus_dtype_t)want);
    if (es == 0) {
      PyErr_Format(PyExc_ValueError, "chorus: dtype code %d is not valid", want);
      return -1;
    }
    int raw_bytes = b->view.itemsize == 1 && b->view.len % (Py_ssize_t)es == 0;
    if ((size_t)b->view.itemsize != es && !raw_bytes) {
      PyErr_Format(PyExc_ValueError, "chorus: %s has %zd-byte elements but dtype %s has %zu",
                   what, b->view.itemsize, chorus_dtype_name((chorus_dtype_t)want), es);
      return -1;
    }
  }
  b->dtype = dt;
  b->count = (size_t)b->view.len / chorus_dtype_size((chorus_dtype_t)dt);
  return 0;
}

static void buf_release(buf_t *b) {
  if (b->held) PyBuffer_Release(&b->view);
  b->held = 0;
}

/* ------------------------------------------------------------------ Comm */

typedef struct WorkObject WorkObject;

typedef struct {
  PyObject_HEAD
  chorus_comm_t comm;
  int inflight;       /* blocking calls in progress on other threads */
  WorkObject *works;  /* live async works (borrowed; they unlink themselves) */
  PyObject *weakrefs;
} CommObject;

struct WorkObject {
  PyObject_HEAD
  chorus_work_t h;
  CommObject *comm; /* strong */
  WorkObject *next, *prev;
  chorus_result_t result; /* INPROGRESS until known */
  int busy;               /* threads waiting on h */
  char *error;            /* the library's message, once failed */
  double duration;
  int source; /* a receive's sender (group rank), once done; else -1 */
  buf_t bufs[2];
  buf_t *list; /* all_gather_list outputs */
  Py_ssize_t nlist;
  PyObject *keep; /* objects to keep alive (lists) */
};

static PyTypeObject CommType, WorkType;

static chorus_comm_t comm_ok(CommObject *c) {
  if (!c->comm) {
    PyErr_SetString(g_err_class[1] ? g_err_class[1] : PyExc_ValueError,
                    "chorus: this process group was destroyed");
    return NULL;
  }
  return c->comm;
}

static PyObject *comm_error(CommObject *c, chorus_result_t st) {
  return raise_code(st, c->comm ? chorus_comm_last_error(c->comm) : "");
}

static PyObject *comm_wrap(chorus_comm_t comm) {
  CommObject *c = PyObject_New(CommObject, &CommType);
  if (!c) {
    Py_BEGIN_ALLOW_THREADS
    chorus_comm_destroy(comm);
    Py_END_ALLOW_THREADS
    return NULL;
  }
  c->comm = comm;
  c->inflight = 0;
  c->works = NULL;
  c->weakrefs = NULL;
  return (PyObject *)c;
}

/* Frees a settled work's handle and buffers, once no thread waits on it. */
static void work_release(WorkObject *w) {
  if (!w->h || w->result == CHORUS_INPROGRESS || w->busy) return;
  chorus_work_t h = w->h;
  w->h = NULL;
  chorus_work_free(h);
  for (int i = 0; i < 2; i++) buf_release(&w->bufs[i]);
  for (Py_ssize_t i = 0; i < w->nlist; i++) buf_release(&w->list[i]);
  PyMem_Free(w->list);
  w->list = NULL;
  w->nlist = 0;
  Py_CLEAR(w->keep);
  /* Off the comm's list: nothing left to finish before destroy. */
  if (w->prev) w->prev->next = w->next;
  else if (w->comm && w->comm->works == w) w->comm->works = w->next;
  if (w->next) w->next->prev = w->prev;
  w->next = w->prev = NULL;
}

/* Waits for a work up to timeout_ms (GIL released; -1: its outcome, which
 * the communicator's timeout bounds), records the outcome once, and frees
 * the handle when no other thread waits on it too. */
static void work_settle(WorkObject *w, int timeout_ms) {
  if (w->h && w->result == CHORUS_INPROGRESS) {
    chorus_work_t h = w->h;
    chorus_result_t st;
    w->busy++;
    w->comm->inflight++;
    Py_BEGIN_ALLOW_THREADS
    st = chorus_work_wait(h, timeout_ms);
    Py_END_ALLOW_THREADS
    w->comm->inflight--;
    w->busy--;
    if (st != CHORUS_INPROGRESS && w->result == CHORUS_INPROGRESS) {
      w->result = st;
      w->duration = chorus_work_duration(h);
      w->source = chorus_work_source(h);
      if (st != CHORUS_OK) {
        const char *m = chorus_work_error(h);
        w->error = strdup(m && *m ? m : chorus_strerror(st));
      }
    }
  }
  work_release(w);
}

static void comm_finish_works(CommObject *c) {
  /* c->comm is already NULL, so no new call starts.  A work another
   * thread still waits on (Work.wait) stays linked until that thread
   * leaves its wait, which the operation's end (bounded by the timeout)
   * lets it do: give it the GIL until then. */
  while (c->works) {
    WorkObject *w = c->works;
    work_settle(w, -1);
    if (c->works == w) {
      Py_BEGIN_ALLOW_THREADS
      struct timespec ts = {0, 1000000};
      nanosleep(&ts, NULL);
      Py_END_ALLOW_THREADS
    }
  }
}

static chorus_result_t comm_destroy_now(CommObject *c) {
  if (!c->comm) return CHORUS_OK;
  chorus_comm_t comm = c->comm;
  c->comm = NULL; /* before the GIL is let go: no call may start now */
  comm_finish_works(c);
  chorus_result_t st;
  Py_BEGIN_ALLOW_THREADS
  st = chorus_comm_destroy(comm);
  Py_END_ALLOW_THREADS
  return st;
}

static void Comm_dealloc(CommObject *c) {
  if (c->weakrefs) PyObject_ClearWeakRefs((PyObject *)c);
  (void)comm_destroy_now(c);
  PyObject_Free(c);
}

static PyObject *Comm_destroy(CommObject *c, PyObject *unused) {
  if (c->inflight) {
    PyErr_SetString(PyExc_RuntimeError, "chorus: destroy() while another thread is inside a call "
                    "on this group; abort() it first or wait for that call");
    return NULL;
  }
  chorus_result_t st = comm_destroy_now(c);
  if (st != CHORUS_OK) return raise_code(st, "destroying the communicator");
  Py_RETURN_NONE;
}

static PyObject *Comm_abort(CommObject *c, PyObject *unused) {
  if (c->comm) chorus_comm_abort(c->comm);
  Py_RETURN_NONE;
}

/* Comm_<name>(): conv(fn(comm)), or the "destroyed" error. */
#define COMM_GETTER(name, fn, conv)                                            \
  static PyObject *Comm_##name(CommObject *c, PyObject *u) {                   \
    chorus_comm_t m = comm_ok(c);                                              \
    return m ? conv(fn(m)) : NULL;                                             \
  }
COMM_GETTER(rank, chorus_comm_rank, PyLong_FromLong)
COMM_GETTER(size, chorus_comm_size, PyLong_FromLong)
COMM_GETTER(local_rank, chorus_comm_local_rank, PyLong_FromLong)
COMM_GETTER(local_size, chorus_comm_local_size, PyLong_FromLong)
COMM_GETTER(timeout_ms, chorus_comm_timeout_ms, PyLong_FromLong)
COMM_GETTER(status, chorus_comm_status, PyLong_FromLong)
COMM_GETTER(last_error, chorus_comm_last_error, PyUnicode_FromString)
#undef COMM_GETTER
static PyObject *Comm_destroyed(CommObject *c, PyObject *u) { return PyBool_FromLong(!c->comm); }

static PyObject *Comm_same_host(CommObject *c, PyObject *arg) {
  chorus_comm_t m = comm_ok(c);
  if (!m) return NULL;
  long peer = PyLong_AsLong(arg);
  if (peer == -1 && PyErr_Occurred()) return NULL;
  return PyLong_FromLong(chorus_comm_same_host(m, (int)peer));
}

static int arg_int(PyObject *o, int *out, const char *what) {
  long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "chorus: %s out of range", what);
    return -1;
  }
  *out = (int)v;
  return 0;
}

static int nargs_is(Py_ssize_t nargs, Py_ssize_t want, const char *sig) {
  if (nargs == want) return 0;
  PyErr_Format(PyExc_TypeError, "chorus: %s takes %zd arguments (%zd given)", sig, want, nargs);
  return -1;
}

/* ranks: a sequence of ints -> a malloc'd int array. */
static int *int_array(PyObject *seq, Py_ssize_t *n, const char *what) {
  PyObject *fast = PySequence_Fast(seq, "chorus: expected a sequence of ints");
  if (!fast) return NULL;
  *n = PySequence_Fast_GET_SIZE(fast);
  int *out = PyMem_Malloc(sizeof(int) * (size_t)(*n > 0 ? *n : 1));
  if (!out) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return NULL;
  }
  for (Py_ssize_t i = 0; i < *n; i++) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    if ((v == -1 && PyErr_Occurred()) || v < INT32_MIN || v > INT32_MAX) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "chorus: %s[%zd] out of range", what, i);
      PyMem_Free(out);
      Py_DECREF(fast);
      return NULL;
    }
    out[i] = (int)v;
  }
  Py_DECREF(fast);
  return out;
}

/* The outcome of a call that makes a communicator: the new Comm, None
 * (this rank is not a member), or the error. */
static PyObject *comm_made(CommObject *c, chorus_result_t st, chorus_comm_t out) {
  if (st != CHORUS_OK) return comm_error(c, st);
  if (!out) Py_RETURN_NONE;
  return comm_wrap(out);
}

static PyObject *Comm_new_group(CommObject *c, PyObject *arg) {
  chorus_comm_t m = comm_ok(c);
  if (!m) return NULL;
  Py_ssize_t n = 0;
  int *ranks = int_array(arg, &n, "ranks");
  if (!ranks) return NULL;
  chorus_comm_t out = NULL;
  chorus_result_t st;
  c->inflight++;
  Py_BEGIN_ALLOW_THREADS
  st = chorus_comm_new_group(m, ranks, (int)n, &out);
  Py_END_ALLOW_THREADS
  c->inflight--;
  PyMem_Free(ranks);
  return comm_made(c, st, out);
}

static PyObject *Comm_split(CommObject *c, PyObject *const *args, Py_ssize_t nargs) {
  int color, key;
  if (nargs_is(nargs, 2, "split(color, key)") || arg_int(args[0], &color, "color") ||
      arg_int(args[1], &key, "key"))
    return NULL;
  chorus_comm_t m = comm_ok(c), out = NULL;
  if (!m) return NULL;
  chorus_result_t st;
  c->inflight++;
  Py_BEGIN_ALLOW_THREADS
  st = chorus_comm_split(m, color, key, &out);
  Py_END_ALLOW_THREADS
  c->inflight--;
  return comm_made(c, st, out);
}

static PyObject *Comm_shrink(CommObject *c, PyObject *arg) {
  int ms;
  if (arg_int(arg, &ms, "timeout_ms")) return NULL;
  chorus_comm_t m = comm_ok(c), out = NULL;
  if (!m) return NULL;
  chorus_result_t st;
  c->inflight++;
  Py_BEGIN_ALLOW_THREADS
  st = chorus_comm_shrink(m, ms, &out);
  Py_END_ALLOW_THREADS
  c->inflight--;
  return comm_made(c, st, out);
}

static PyObject *Comm_set_algo(CommObject *c, PyObject *const *args, Py_ssize_t nargs) {
  chorus_comm_t m = comm_ok(c);
  if (!m) return NULL;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "set_algo(coll, name)");
    return NULL;
  }
  long coll = PyLong_AsLong(args[0]);
  const char *name = args[1] == Py_None ? NULL : PyUnicode_AsUTF8(args[1]);
  if (PyErr_Occurred()) return NULL;
  chorus_result_t st = chorus_comm_set_algo(m, (chorus_coll_t)coll, name);
  if (st != CHORUS_OK) return comm_error(c, st);
  Py_RETURN_NONE;
}

/* ------------------------------------------------------ calling a collective
 *
 * Every collective method takes positional arguments only (METH_FASTCALL:
 * the Python layer is the keyword-friendly face) and ends with `async_op`.
 * A call owns up to two buffers (bufs[0] the input, bufs[1] the output);
 * issue() runs the library call with the GIL released: blocking, it
 * releases them and returns None; asynchronous, they move into a Work.
 */

typedef struct {
  CommObject *c;
  chorus_comm_t comm;
  buf_t bufs[2];
  buf_t *list;
  Py_ssize_t nlist;
  PyObject *keep;
  int async;
} call_t;

static void call_release(call_t *k) {
  for (int i = 0; i < 2; i++) buf_release(&k->bufs[i]);
  for (Py_ssize_t i = 0; i < k->nlist; i++) buf_release(&k->list[i]);
  PyMem_Free(k->list);
  k->list = NULL;
  k->nlist = 0;
  Py_CLEAR(k->keep);
}

static int call_begin(call_t *k, CommObject *c, PyObject *async_obj) {
  memset(k, 0, sizeof *k);
  k->c = c;
  int a = PyObject_IsTrue(async_obj); /* may run Python code: before the comm */
  if (a < 0) return -1;
  k->async = a;
  if (!(k->comm = comm_ok(c))) return -1;
  return 0;
}

/* After the library call: st and (when async) the handle. */
static PyObject *call_end(call_t *k, chorus_result_t st, chorus_work_t h) {
  if (st != CHORUS_OK) {
    call_release(k);
    return comm_error(k->c, st);
  }
  if (!k->async) {
    call_release(k);
    Py_RETURN_NONE;
  }
  WorkObject *w = PyObject_New(WorkObject, &WorkType);
  if (!w) {
    Py_BEGIN_ALLOW_THREADS
    chorus_work_wait(h, -1);
    chorus_work_free(h);
    Py_END_ALLOW_THREADS
    call_release(k);
    return NULL;
  }
  w->h = h;
  Py_INCREF(k->c);
  w->comm = k->c;
  w->result = CHORUS_INPROGRESS;
  w->busy = 0;
  w->error = NULL;
  w->duration = 0;
  w->source = -1;
  memcpy(w->bufs, k->bufs, sizeof w->bufs);
  w->list = k->list;
  w->nlist = k->nlist;
  w->keep = k->keep;
  memset(k, 0, sizeof *k);
  w->prev = NULL;
  w->next = w->comm->works;
  if (w->next) w->next->prev = w;
  w->comm->works = w;
  return (PyObject *)w;
}

/* res = the outcome of expr, the library call (which names `work`: NULL
 * when blocking), run with the GIL released.  The communicator is fetched
 * again first: converting the arguments may have run Python code
 * (__index__, __bool__) that destroyed the group. */
#define ISSUE_INTO(res, k, expr)                                               \
  do {                                                                         \
    if (!((k)->comm = comm_ok((k)->c))) {                                      \
      call_release(k);                                                         \
      (res) = NULL;                                                            \
      break;                                                                   \
    }                                                                          \
    chorus_work_t h_ = NULL;                                                   \
    chorus_work_t *work = (k)->async ? &h_ : NULL;                             \
    chorus_result_t st_;                                                       \
    (k)->c->inflight++;                                                        \
    Py_BEGIN_ALLOW_THREADS                                                     \
    st_ = (expr);                                                              \
    Py_END_ALLOW_THREADS                                                       \
    (k)->c->inflight--;                                                        \
    (res) = call_end((k), st_, h_);                                            \
  } while (0)

#define ISSUE(k, expr)                                                         \
  do {                                                                         \
    PyObject *res_;                                                            \
    ISSUE_INTO(res_, k, expr);                                                 \
    return res_;                                                               \
  } while (0)

static int same_dtype(const buf_t *a, const buf_t *b) {
  if (a->dtype == b->dtype) return 0;
  PyErr_Format(PyExc_TypeError, "chorus: input is %s but output is %s",
               chorus_dtype_name((chorus_dtype_t)a->dtype),
               chorus_dtype_name((chorus_dtype_t)b->dtype));
  return -1;
}

/* Input and output of an element-wise collective: same dtype and count. */
static int check_same(const buf_t *in, const buf_t *out, const char *coll) {
  if (same_dtype(in, out) < 0) return -1;
  if (in->count == out->count) return 0;
  PyErr_Format(PyExc_ValueError, "chorus: %s input has %zu elements, output %zu", coll,
               in->count, out->count);
  return -1;
}

/* broadcast(buf, root, dtype, async) */
static PyObject *Comm_broadcast(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int root, dt;
  if (nargs_is(n, 4, "broadcast(buf, root, dtype, async_op)") || arg_int(a[1], &root, "root") ||
      arg_int(a[2], &dt, "dtype") ||
      call_begin(&k, c, a[3]))
    return NULL;
  if (buf_get(a[0], root != chorus_comm_rank(k.comm), dt, &k.bufs[0], "the tensor") < 0) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_broadcast(k.comm, k.bufs[0].view.buf, k.bufs[0].count,
                             (chorus_dtype_t)k.bufs[0].dtype, root, work));
}

/* all_reduce(send, recv, op, dtype, async) */
static PyObject *Comm_all_reduce(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int op, dt;
  if (nargs_is(n, 5, "all_reduce(send, recv, op, dtype, async_op)") || arg_int(a[2], &op, "op") ||
      arg_int(a[3], &dt, "dtype") ||
      call_begin(&k, c, a[4]))
    return NULL;
  if (buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      (a[0] != a[1] && buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0)) {
    call_release(&k);
    return NULL;
  }
  const buf_t *in = a[0] == a[1] ? &k.bufs[1] : &k.bufs[0];
  if (check_same(in, &k.bufs[1], "all_reduce") < 0) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_all_reduce(k.comm, in->view.buf, k.bufs[1].view.buf, in->count,
                              (chorus_dtype_t)in->dtype, (chorus_op_t)op, work));
}

/* reduce(send, recv|None, op, root, dtype, async) */
static PyObject *Comm_reduce(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int op, root, dt;
  if (nargs_is(n, 6, "reduce(send, recv, op, root, dtype, async_op)") ||
      arg_int(a[2], &op, "op") || arg_int(a[3], &root, "root") ||
      arg_int(a[4], &dt, "dtype") ||
      call_begin(&k, c, a[5]))
    return NULL;
  int is_root = root == chorus_comm_rank(k.comm);
  int inplace = a[0] == a[1];
  if (buf_get(a[0], inplace && is_root, dt, &k.bufs[0], "the input") < 0 ||
      (is_root && !inplace && a[1] != Py_None &&
       buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0)) {
    call_release(&k);
    return NULL;
  }
  void *recv = NULL;
  if (is_root) {
    if (inplace) recv = k.bufs[0].view.buf;
    else if (!k.bufs[1].held) {
      call_release(&k);
      PyErr_SetString(PyExc_ValueError, "chorus: reduce needs an output on the root");
      return NULL;
    } else {
      if (check_same(&k.bufs[0], &k.bufs[1], "reduce") < 0) {
        call_release(&k);
        return NULL;
      }
      recv = k.bufs[1].view.buf;
    }
  }
  ISSUE(&k, chorus_reduce(k.comm, k.bufs[0].view.buf, recv, k.bufs[0].count,
                          (chorus_dtype_t)k.bufs[0].dtype, (chorus_op_t)op, root, work));
}

/* Shared by scatter/gather/all_gather/reduce_scatter/all_to_all: the "big"
 * side must hold size * count elements of the small side's dtype. */
static int check_blocks(const buf_t *small, const buf_t *big, size_t size, const char *coll,
                        const char *sname, const char *bname) {
  if (same_dtype(small, big) < 0) return -1;
  if (big->count != small->count * size) {
    PyErr_Format(PyExc_ValueError, "chorus: %s: %s has %zu elements, %s %zu; it must hold "
                 "group size (%zu) x %zu", coll, bname, big->count, sname, small->count, size,
                 small->count);
    return -1;
  }
  return 0;
}

/* scatter(send|None, recv, root, dtype, async) */
static PyObject *Comm_scatter(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int root, dt;
  if (nargs_is(n, 5, "scatter(send, recv, root, dtype, async_op)") ||
      arg_int(a[2], &root, "root") ||
      arg_int(a[3], &dt, "dtype") ||
      call_begin(&k, c, a[4]))
    return NULL;
  int is_root = root == chorus_comm_rank(k.comm);
  size_t size = (size_t)chorus_comm_size(k.comm);
  if (buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      (is_root && buf_get(a[0], 0, dt, &k.bufs[0], "the scatter input") < 0) ||
      (is_root && check_blocks(&k.bufs[1], &k.bufs[0], size, "scatter", "the output",
                               "the input") < 0)) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_scatter(k.comm, is_root ? k.bufs[0].view.buf : NULL, k.bufs[1].view.buf,
                           k.bufs[1].count, (chorus_dtype_t)k.bufs[1].dtype, root, work));
}

/* gather(send, recv|None, root, dtype, async) */
static PyObject *Comm_gather(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int root, dt;
  if (nargs_is(n, 5, "gather(send, recv, root, dtype, async_op)") || arg_int(a[2], &root, "root") ||
      arg_int(a[3], &dt, "dtype") ||
      call_begin(&k, c, a[4]))
    return NULL;
  int is_root = root == chorus_comm_rank(k.comm);
  size_t size = (size_t)chorus_comm_size(k.comm);
  if (buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0 ||
      (is_root && buf_get(a[1], 1, dt, &k.bufs[1], "the gather output") < 0) ||
      (is_root && check_blocks(&k.bufs[0], &k.bufs[1], size, "gather", "the input",
                               "the output") < 0)) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_gather(k.comm, k.bufs[0].view.buf, is_root ? k.bufs[1].view.buf : NULL,
                          k.bufs[0].count, (chorus_dtype_t)k.bufs[0].dtype, root, work));
}

/* all_gather(send, recv, dtype, async): into one buffer. */
static PyObject *Comm_all_gather(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int dt;
  if (nargs_is(n, 4, "all_gather(send, recv, dtype, async_op)") || arg_int(a[2], &dt, "dtype") ||
      call_begin(&k, c, a[3]))
    return NULL;
  size_t size = (size_t)chorus_comm_size(k.comm);
  if (buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0 ||
      buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      check_blocks(&k.bufs[0], &k.bufs[1], size, "all_gather", "the input", "the output") < 0) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_all_gather(k.comm, k.bufs[0].view.buf, k.bufs[1].view.buf, k.bufs[0].count,
                              (chorus_dtype_t)k.bufs[0].dtype, work));
}

/* all_gather_list(send, [recv...], dtype, async) */
static PyObject *Comm_all_gather_list(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int dt;
  if (nargs_is(n, 4, "all_gather_list(send, outputs, dtype, async_op)") ||
      arg_int(a[2], &dt, "dtype") ||
      call_begin(&k, c, a[3]))
    return NULL;
  Py_ssize_t size = chorus_comm_size(k.comm);
  if (buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0) goto fail;
  if (!(k.keep = PySequence_Fast(a[1], "chorus: all_gather's outputs must be a list"))) goto fail;
  if (PySequence_Fast_GET_SIZE(k.keep) != size) {
    PyErr_Format(PyExc_ValueError, "chorus: all_gather needs one output per rank (%zd), got %zd",
                 size, PySequence_Fast_GET_SIZE(k.keep));
    goto fail;
  }
  if (!(k.list = PyMem_Calloc((size_t)size, sizeof *k.list))) {
    PyErr_NoMemory();
    goto fail;
  }
  void **ptrs = PyMem_Malloc(sizeof(void *) * (size_t)size);
  if (!ptrs) {
    PyErr_NoMemory();
    goto fail;
  }
  for (Py_ssize_t i = 0; i < size; i++) {
    char what[64];
    snprintf(what, sizeof what, "output %zd", i);
    k.nlist = i + 1;
    if (buf_get(PySequence_Fast_GET_ITEM(k.keep, i), 1, dt, &k.list[i], what) < 0 ||
        check_blocks(&k.bufs[0], &k.list[i], 1, "all_gather", "the input", what) < 0) {
      PyMem_Free(ptrs);
      goto fail;
    }
    ptrs[i] = k.list[i].view.buf;
  }
  PyObject *res;
  ISSUE_INTO(res, &k, chorus_all_gather_list(k.comm, k.bufs[0].view.buf, ptrs, k.bufs[0].count,
                                             (chorus_dtype_t)k.bufs[0].dtype, work));
  PyMem_Free(ptrs); /* the library copied the array */
  return res;
fail:
  call_release(&k);
  return NULL;
}

/* reduce_scatter(send, recv, op, dtype, async) */
static PyObject *Comm_reduce_scatter(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int op, dt;
  if (nargs_is(n, 5, "reduce_scatter(send, recv, op, dtype, async_op)") ||
      arg_int(a[2], &op, "op") || arg_int(a[3], &dt, "dtype") ||
      call_begin(&k, c, a[4]))
    return NULL;
  size_t size = (size_t)chorus_comm_size(k.comm);
  if (buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0 ||
      buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      check_blocks(&k.bufs[1], &k.bufs[0], size, "reduce_scatter", "the output",
                   "the input") < 0) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_reduce_scatter(k.comm, k.bufs[0].view.buf, k.bufs[1].view.buf,
                                  k.bufs[1].count, (chorus_dtype_t)k.bufs[1].dtype,
                                  (chorus_op_t)op, work));
}

/* all_to_all(send, recv, dtype, async): equal blocks. */
static PyObject *Comm_all_to_all(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int dt;
  if (nargs_is(n, 4, "all_to_all(send, recv, dtype, async_op)") || arg_int(a[2], &dt, "dtype") ||
      call_begin(&k, c, a[3]))
    return NULL;
  size_t size = (size_t)chorus_comm_size(k.comm);
  int inplace = a[0] == a[1];
  if (buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      (!inplace && buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0)) {
    call_release(&k);
    return NULL;
  }
  const buf_t *in = inplace ? &k.bufs[1] : &k.bufs[0];
  if (same_dtype(in, &k.bufs[1]) < 0 || in->count != k.bufs[1].count ||
      in->count % size) {
    if (!PyErr_Occurred())
      PyErr_Format(PyExc_ValueError, "chorus: all_to_all input (%zu elements) and output (%zu) "
                   "must be equal and divisible by the group size (%zu)", in->count,
                   k.bufs[1].count, size);
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_all_to_all(k.comm, in->view.buf, k.bufs[1].view.buf, in->count / size,
                              (chorus_dtype_t)in->dtype, work));
}

/* Counts/displacements: a sequence of size non-negative ints. */
static size_t *size_array(PyObject *seq, Py_ssize_t want, const char *what) {
  PyObject *fast = PySequence_Fast(seq, "chorus: expected a sequence of ints");
  if (!fast) return NULL;
  if (PySequence_Fast_GET_SIZE(fast) != want) {
    PyErr_Format(PyExc_ValueError, "chorus: %s has %zd entries, the group %zd ranks", what,
                 PySequence_Fast_GET_SIZE(fast), want);
    Py_DECREF(fast);
    return NULL;
  }
  size_t *out = PyMem_Malloc(sizeof(size_t) * (size_t)(want ? want : 1));
  if (!out) {
    Py_DECREF(fast);
    PyErr_NoMemory();
    return NULL;
  }
  for (Py_ssize_t i = 0; i < want; i++) {
    Py_ssize_t v = PyNumber_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i), PyExc_OverflowError);
    if (v < 0) {
      if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "chorus: %s[%zd] is negative", what, i);
      PyMem_Free(out);
      Py_DECREF(fast);
      return NULL;
    }
    out[i] = (size_t)v;
  }
  Py_DECREF(fast);
  return out;
}

/* Every block [displ, displ + count) lies inside a buffer of `total`. */
static int check_layout(const size_t *counts, const size_t *displs, Py_ssize_t n, size_t total,
                        const char *what) {
  for (Py_ssize_t i = 0; i < n; i++)
    if (displs[i] > total || counts[i] > total - displs[i]) {
      PyErr_Format(PyExc_ValueError, "chorus: all_to_all %s block %zd (%zu elements at %zu) runs "
                   "past the buffer's %zu elements", what, i, counts[i], displs[i], total);
      return -1;
    }
  return 0;
}

/* all_to_allv(send, scounts, sdispls, recv, rcounts, rdispls, dtype, async) */
static PyObject *Comm_all_to_allv(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int dt;
  if (nargs_is(n, 8, "all_to_allv(send, scounts, sdispls, recv, rcounts, rdispls, dtype, "
                     "async_op)") ||
      arg_int(a[6], &dt, "dtype") ||
      call_begin(&k, c, a[7]))
    return NULL;
  Py_ssize_t size = chorus_comm_size(k.comm);
  size_t *sc = NULL, *sd = NULL, *rc = NULL, *rd = NULL;
  PyObject *res = NULL;
  if (buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0 ||
      buf_get(a[3], 1, dt, &k.bufs[1], "the output") < 0 || same_dtype(&k.bufs[0], &k.bufs[1]) ||
      !(sc = size_array(a[1], size, "input split sizes")) ||
      !(sd = size_array(a[2], size, "input offsets")) ||
      !(rc = size_array(a[4], size, "output split sizes")) ||
      !(rd = size_array(a[5], size, "output offsets")) ||
      check_layout(sc, sd, size, k.bufs[0].count, "input") ||
      check_layout(rc, rd, size, k.bufs[1].count, "output")) {
    call_release(&k);
    goto out;
  }
  ISSUE_INTO(res, &k, chorus_all_to_allv(k.comm, k.bufs[0].view.buf, sc, sd, k.bufs[1].view.buf,
                                         rc, rd, (chorus_dtype_t)k.bufs[0].dtype, work));
out:
  PyMem_Free(sc);
  PyMem_Free(sd);
  PyMem_Free(rc);
  PyMem_Free(rd);
  return res;
}

/* barrier(async) */
static PyObject *Comm_barrier(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  if (nargs_is(n, 1, "barrier(async_op)") || call_begin(&k, c, a[0])) return NULL;
  ISSUE(&k, chorus_barrier(k.comm, work));
}

/* send(buf, peer, tag, dtype, async) / recv(...) */
static PyObject *p2p(CommObject *c, PyObject *const *a, Py_ssize_t n, int is_send) {
  call_t k;
  int peer, tag, dt;
  if (nargs_is(n, 5, is_send ? "send(buf, peer, tag, dtype, async_op)"
                             : "recv(buf, peer, tag, dtype, async_op)") ||
      arg_int(a[1], &peer, "peer") || arg_int(a[2], &tag, "tag") ||
      arg_int(a[3], &dt, "dtype") || call_begin(&k, c, a[4]))
    return NULL;
  if (buf_get(a[0], !is_send, dt, &k.bufs[0], "the tensor") < 0) {
    call_release(&k);
    return NULL;
  }
  if (is_send)
    ISSUE(&k, chorus_send(k.comm, k.bufs[0].view.buf, k.bufs[0].count,
                          (chorus_dtype_t)k.bufs[0].dtype, peer, tag, work));
  ISSUE(&k, chorus_recv(k.comm, k.bufs[0].view.buf, k.bufs[0].count,
                        (chorus_dtype_t)k.bufs[0].dtype, peer, tag, work));
}
static PyObject *Comm_send(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  return p2p(c, a, n, 1);
}
static PyObject *Comm_recv(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  return p2p(c, a, n, 0);
}

/* Variable-size byte gathers -> a list of bytes (None off the root). */
static PyObject *bytes_list(const char *data, const size_t *lens, int size) {
  PyObject *out = PyList_New(size);
  if (!out) return NULL;
  size_t off = 0;
  for (int i = 0; i < size; i++) {
    PyObject *b = PyBytes_FromStringAndSize(data + off, (Py_ssize_t)lens[i]);
    if (!b) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, i, b);
    off += lens[i];
  }
  return out;
}

static PyObject *gather_bytes(CommObject *c, PyObject *const *a, Py_ssize_t n, int all) {
  chorus_comm_t m = comm_ok(c);
  int root = 0;
  if (!m || nargs_is(n, all ? 1 : 2, all ? "all_gather_bytes(data)" : "gather_bytes(data, root)") ||
      (!all && arg_int(a[1], &root, "root")))
    return NULL;
  buf_t b;
  if (buf_get(a[0], 0, CHORUS_UINT8, &b, "the data") < 0) {
    buf_release(&b);
    return NULL;
  }
  int size = chorus_comm_size(m);
  size_t *lens = PyMem_Calloc((size_t)size, sizeof *lens);
  if (!lens) {
    buf_release(&b);
    return PyErr_NoMemory();
  }
  void *out = NULL;
  chorus_result_t st;
  c->inflight++;
  Py_BEGIN_ALLOW_THREADS
  st = all ? chorus_all_gather_bytes(m, b.view.buf, (size_t)b.view.len, &out, lens)
           : chorus_gather_bytes(m, b.view.buf, (size_t)b.view.len, root, &out, lens);
  Py_END_ALLOW_THREADS
  c->inflight--;
  buf_release(&b);
  PyObject *res;
  if (st != CHORUS_OK) res = comm_error(c, st);
  else if (!out && !all && root != chorus_comm_rank(m)) {
    Py_INCREF(Py_None);
    res = Py_None;
  } else res = bytes_list(out ? out : "", lens, size);
  chorus_free(out);
  PyMem_Free(lens);
  return res;
}
static PyObject *Comm_gather_bytes(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  return gather_bytes(c, a, n, 0);
}
static PyObject *Comm_all_gather_bytes(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  return gather_bytes(c, a, n, 1);
}

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))Comm_##name, METH_FASTCALL, doc}
static PyMethodDef Comm_methods[] = {
    {"rank", (PyCFunction)Comm_rank, METH_NOARGS, "rank in this group"},
    {"size", (PyCFunction)Comm_size, METH_NOARGS, "number of ranks"},
    {"local_rank", (PyCFunction)Comm_local_rank, METH_NOARGS, "LOCAL_RANK or -1"},
    {"local_size", (PyCFunction)Comm_local_size, METH_NOARGS, "LOCAL_WORLD_SIZE or -1"},
    {"timeout_ms", (PyCFunction)Comm_timeout_ms, METH_NOARGS, "timeout of every wait"},
    {"status", (PyCFunction)Comm_status, METH_NOARGS, "0 or the code that failed it"},
    {"last_error", (PyCFunction)Comm_last_error, METH_NOARGS, "the last error's message"},
    {"destroyed", (PyCFunction)Comm_destroyed, METH_NOARGS, "True after destroy()"},
    {"same_host", (PyCFunction)Comm_same_host, METH_O, "1 if peer shares this host"},
    {"new_group", (PyCFunction)Comm_new_group, METH_O, "subgroup of the listed ranks"},
    {"shrink", (PyCFunction)Comm_shrink, METH_O, "survivors' communicator"},
    {"destroy", (PyCFunction)Comm_destroy, METH_NOARGS, "finish and release"},
    {"abort", (PyCFunction)Comm_abort, METH_NOARGS, "fail every pending and future call"},
    FAST(split, "split(color, key)"),
    FAST(set_algo, "set_algo(coll, name)"),
    FAST(broadcast, NULL),
    FAST(all_reduce, NULL),
    FAST(reduce, NULL),
    FAST(scatter, NULL),
    FAST(gather, NULL),
    FAST(all_gather, NULL),
    FAST(all_gather_list, NULL),
    FAST(reduce_scatter, NULL),
    FAST(all_to_all, NULL),
    FAST(all_to_allv, NULL),
    FAST(barrier, NULL),
    FAST(send, NULL),
    FAST(recv, NULL),
    FAST(gather_bytes, NULL),
    FAST(all_gather_bytes, NULL),
    {NULL, NULL, 0, NULL}};

static PyTypeObject CommType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "chorus._chorus.Comm",
    .tp_basicsize = sizeof(CommObject),
    .tp_dealloc = (destructor)Comm_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A libchorus communicator (use chorus.init_process_group / new_group).",
    .tp_methods = Comm_methods,
    .tp_weaklistoffset = offsetof(CommObject, weakrefs),
};

/* ------------------------------------------------------------------ Work */

static void Work_dealloc(WorkObject *w) {
  work_settle(w, -1); /* the buffers must outlive the operation */
  free(w->error);
  Py_CLEAR(w->comm);
  PyObject_Free(w);
}

static PyObject *work_outcome(WorkObject *w) {
  if (w->result == CHORUS_OK) Py_RETURN_TRUE;
  return raise_code(w->result, w->error);
}

/* wait(timeout_ms=-1): True, or raises the operation's error; a timeout
 * that passes first raises TimeoutError (the operation goes on). */
static PyObject *Work_wait(WorkObject *w, PyObject *const *a, Py_ssize_t n) {
  long ms = -1;
  if (n > 1) {
    PyErr_SetString(PyExc_TypeError, "wait(timeout_ms=-1)");
    return NULL;
  }
  if (n == 1 && a[0] != Py_None) {
    ms = PyLong_AsLong(a[0]);
    if (ms == -1 && PyErr_Occurred()) return NULL;
    if (ms > INT32_MAX) ms = INT32_MAX;
    if (ms < 0) ms = -1;
  }
  work_settle(w, (int)ms);
  if (w->result == CHORUS_INPROGRESS) {
    PyErr_Format(g_err_class[4] ? g_err_class[4] : PyExc_TimeoutError,
                 "chorus: the operation did not complete within %ld ms (it goes on; wait again)",
                 ms);
    return NULL;
  }
  return work_outcome(w);
}

/* Settles w if it is done; never blocks. */
static void work_poll(WorkObject *w) {
  if (w->h && w->result == CHORUS_INPROGRESS && chorus_work_test(w->h) != CHORUS_INPROGRESS)
    work_settle(w, 0);
}

static PyObject *Work_is_completed(WorkObject *w, PyObject *u) {
  work_poll(w);
  return PyBool_FromLong(w->result != CHORUS_INPROGRESS);
}

static PyObject *Work_is_success(WorkObject *w, PyObject *u) {
  work_poll(w);
  return PyBool_FromLong(w->result == CHORUS_OK);
}

/* The error as an exception object (not raised), or None. */
static PyObject *Work_exception(WorkObject *w, PyObject *u) {
  work_poll(w);
  if (w->result == CHORUS_INPROGRESS || w->result == CHORUS_OK) Py_RETURN_NONE;
  raise_code(w->result, w->error);
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
}

static PyObject *Work_duration(WorkObject *w, PyObject *u) {
  work_poll(w);
  return PyFloat_FromDouble(w->result == CHORUS_INPROGRESS ? 0.0 : w->duration);
}

/* The rank (in the call's group) a completed receive got its message
 * from -- the sender matched by a receive from any source; -1 otherwise. */
static PyObject *Work_source_rank(WorkObject *w, PyObject *u) {
  work_poll(w);
  return PyLong_FromLong(w->result == CHORUS_OK ? w->source : -1);
}

static PyMethodDef Work_methods[] = {
    {"wait", (PyCFunction)(void (*)(void))Work_wait, METH_FASTCALL,
     "wait(timeout_ms=-1): True, or raises the operation's error"},
    {"is_completed", (PyCFunction)Work_is_completed, METH_NOARGS, "never blocks"},
    {"is_success", (PyCFunction)Work_is_success, METH_NOARGS, "completed without error"},
    {"exception", (PyCFunction)Work_exception, METH_NOARGS, "the error, or None"},
    {"duration", (PyCFunction)Work_duration, METH_NOARGS, "seconds it ran (0 until done)"},
    {"source_rank", (PyCFunction)Work_source_rank, METH_NOARGS,
     "a completed receive's sender, as a rank of the call's group (-1 otherwise)"},
    {"_source_rank", (PyCFunction)Work_source_rank, METH_NOARGS, "torch's name of source_rank"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject WorkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "chorus._chorus.Work",
    .tp_basicsize = sizeof(WorkObject),
    .tp_dealloc = (destructor)Work_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An asynchronous operation (async_op=True): wait(), is_completed().",
    .tp_methods = Work_methods,
};

/* ------------------------------------------------------- making a world */

/* init_env(): chorus_comm_init_env (RANK/WORLD_SIZE/MASTER_*, srun, mpirun). */
static PyObject *mod_init_env(PyObject *m, PyObject *u) {
  chorus_comm_t comm = NULL;
  chorus_result_t st;
  Py_BEGIN_ALLOW_THREADS
  st = chorus_comm_init_env(&comm);
  Py_END_ALLOW_THREADS
  if (st != CHORUS_OK) return raise_code(st, chorus_last_init_error());
  return comm_wrap(comm);
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
  if (st != CHORUS_OK) return raise_code(st, chorus_last_init_error());
  return comm_wrap(comm);
}

/* ----------------------------------------------------------------- Store */

typedef struct {
  PyObject_HEAD
  chorus_store_t *client;
  chorus_store_server_t *server;
  int timeout_ms;
  int busy; /* calls in flight on other threads */
} StoreObject;

static PyTypeObject StoreType;

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
    raise_code(st, why);
    return -1;
  }
  return 0;
}

static chorus_store_t *store_ok(StoreObject *s) {
  if (!s->client) PyErr_SetString(PyExc_ValueError, "chorus: the store is closed");
  return s->client;
}

static PyObject *store_error(StoreObject *s, chorus_result_t st) {
  return raise_code(st, s->client ? chorus_store_last_error(s->client) : "");
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
  if (!c || nargs_is(n, 2, "set(key, value)")) return NULL;
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
  if (!c || nargs_is(n, 2, "add(key, amount)")) return NULL;
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
  if (!c || nargs_is(n, 3, "compare_set(key, expected, desired)")) return NULL;
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

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "chorus._chorus.Store",
    .tp_basicsize = sizeof(StoreObject),
    .tp_dealloc = (destructor)Store_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "chorus's key-value store (torch.distributed.TCPStore's methods).",
    .tp_methods = Store_methods,
    .tp_init = (initproc)Store_init,
    .tp_new = PyType_GenericNew,
};

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
    Py_XSETREF(g_err_class[i], cls);
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
  if (buf_get(obj, 0, -1, &b, "the tensor") < 0) {
    buf_release(&b);
    return NULL;
  }
  int dt = b.dtype;
  buf_release(&b);
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
  if (PyType_Ready(&CommType) < 0 || PyType_Ready(&WorkType) < 0 ||
      PyType_Ready(&StoreType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&mod_def);
  if (!m) return NULL;
  Py_INCREF(&CommType);
  Py_INCREF(&WorkType);
  Py_INCREF(&StoreType);
  if (PyModule_AddObject(m, "Comm", (PyObject *)&CommType) < 0 ||
      PyModule_AddObject(m, "Work", (PyObject *)&WorkType) < 0 ||
      PyModule_AddObject(m, "Store", (PyObject *)&StoreType) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
