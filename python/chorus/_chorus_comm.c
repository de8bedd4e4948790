/*
 * _chorus_comm.c - the Comm and Work objects of `chorus._chorus`: a
 * communicator's life (made, split, shrunk, destroyed), its getters, and the
 * handle an asynchronous call returns.
 *
 * Lifetimes.  An asynchronous call returns a Work that holds the buffers it
 * names (Py_buffer views: the arrays cannot be freed or resized meanwhile)
 * and a reference to its Comm.  A Comm keeps a list of its live Works so
 * that destroy() can finish them first (the C API wants every handle freed
 * before the communicator).  Calls that block count themselves in
 * `inflight`; destroy() refuses while another thread is inside one.
 */
#include "_chorus.h"

#include <time.h>

/* ------------------------------------------------------------------ Comm */

chorus_comm_t chorus__comm_ok(CommObject *c) {
  if (!c->comm) {
    PyErr_SetString(chorus__err_class[1] ? chorus__err_class[1] : PyExc_ValueError,
                    "chorus: this process group was destroyed");
    return NULL;
  }
  return c->comm;
}

PyObject *chorus__comm_error(CommObject *c, chorus_result_t st) {
  return chorus__raise_code(st, c->comm ? chorus_comm_last_error(c->comm) : "");
}

PyObject *chorus__comm_wrap(chorus_comm_t comm) {
  CommObject *c = PyObject_New(CommObject, &chorus__CommType);
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
  for (int i = 0; i < 2; i++) chorus__buf_release(&w->bufs[i]);
  for (Py_ssize_t i = 0; i < w->nlist; i++) chorus__buf_release(&w->list[i]);
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
  if (st != CHORUS_OK) return chorus__raise_code(st, "destroying the communicator");
  Py_RETURN_NONE;
}

static PyObject *Comm_abort(CommObject *c, PyObject *unused) {
  if (c->comm) chorus_comm_abort(c->comm);
  Py_RETURN_NONE;
}

/* Comm_<name>(): conv(fn(comm)), or the "destroyed" error. */
#define COMM_GETTER(name, fn, conv)                                            \
  static PyObject *Comm_##name(CommObject *c, PyObject *u) {                   \
    chorus_comm_t m = chorus__comm_ok(c);                                              \
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
  chorus_comm_t m = chorus__comm_ok(c);
  if (!m) return NULL;
  long peer = PyLong_AsLong(arg);
  if (peer == -1 && PyErr_Occurred()) return NULL;
  return PyLong_FromLong(chorus_comm_same_host(m, (int)peer));
}

int chorus__arg_int(PyObject *o, int *out, const char *what) {
  long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred()) return -1;
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_Format(PyExc_ValueError, "chorus: %s out of range", what);
    return -1;
  }
  *out = (int)v;
  return 0;
}

int chorus__nargs_is(Py_ssize_t nargs, Py_ssize_t want, const char *sig) {
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
  if (st != CHORUS_OK) return chorus__comm_error(c, st);
  if (!out) Py_RETURN_NONE;
  return chorus__comm_wrap(out);
}

static PyObject *Comm_new_group(CommObject *c, PyObject *arg) {
  chorus_comm_t m = chorus__comm_ok(c);
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
  if (chorus__nargs_is(nargs, 2, "split(color, key)") ||
      chorus__arg_int(args[0], &color, "color") || chorus__arg_int(args[1], &key, "key"))
    return NULL;
  chorus_comm_t m = chorus__comm_ok(c), out = NULL;
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
  if (chorus__arg_int(arg, &ms, "timeout_ms")) return NULL;
  chorus_comm_t m = chorus__comm_ok(c), out = NULL;
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
  chorus_comm_t m = chorus__comm_ok(c);
  if (!m) return NULL;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "set_algo(coll, name)");
    return NULL;
  }
  long coll = PyLong_AsLong(args[0]);
  const char *name = args[1] == Py_None ? NULL : PyUnicode_AsUTF8(args[1]);
  if (PyErr_Occurred()) return NULL;
  chorus_result_t st = chorus_comm_set_algo(m, (chorus_coll_t)coll, name);
  if (st != CHORUS_OK) return chorus__comm_error(c, st);
  Py_RETURN_NONE;
}

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))Comm_##name, METH_FASTCALL, doc}
/* The collectives: _chorus_coll.c. */
#define COLL(name) {#name, (PyCFunction)(void (*)(void))chorus__Comm_##name, METH_FASTCALL, NULL}
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
    COLL(broadcast),
    COLL(all_reduce),
    COLL(reduce),
    COLL(scatter),
    COLL(gather),
    COLL(all_gather),
    COLL(all_gather_list),
    COLL(reduce_scatter),
    COLL(all_to_all),
    COLL(all_to_allv),
    COLL(barrier),
    COLL(send),
    COLL(recv),
    COLL(gather_bytes),
    COLL(all_gather_bytes),
    {NULL, NULL, 0, NULL}};

PyTypeObject chorus__CommType = {
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
  return chorus__raise_code(w->result, w->error);
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
    PyErr_Format(chorus__err_class[4] ? chorus__err_class[4] : PyExc_TimeoutError,
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
  chorus__raise_code(w->result, w->error);
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

PyTypeObject chorus__WorkType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "chorus._chorus.Work",
    .tp_basicsize = sizeof(WorkObject),
    .tp_dealloc = (destructor)Work_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An asynchronous operation (async_op=True): wait(), is_completed().",
    .tp_methods = Work_methods,
};
