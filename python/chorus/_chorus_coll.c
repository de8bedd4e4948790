/*
 * _chorus_coll.c - the collectives of `chorus._chorus`'s Comm over buffer
 * arguments: a buffer turned into (pointer, count, dtype) with the checks
 * the C API cannot make, each collective's arguments checked, the library
 * called with the GIL released, and a Work made for an asynchronous call.
 */
#include "_chorus.h"

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

/* A buffer argument (buf_t, _chorus.h). */
int chorus__buf_get(PyObject *obj, int writable, int want, buf_t *b, const char *what) {
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

void chorus__buf_release(buf_t *b) {
  if (b->held) PyBuffer_Release(&b->view);
  b->held = 0;
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
  for (int i = 0; i < 2; i++) chorus__buf_release(&k->bufs[i]);
  for (Py_ssize_t i = 0; i < k->nlist; i++) chorus__buf_release(&k->list[i]);
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
  if (!(k->comm = chorus__comm_ok(c))) return -1;
  return 0;
}

/* After the library call: st and (when async) the handle. */
static PyObject *call_end(call_t *k, chorus_result_t st, chorus_work_t h) {
  if (st != CHORUS_OK) {
    call_release(k);
    return chorus__comm_error(k->c, st);
  }
  if (!k->async) {
    call_release(k);
    Py_RETURN_NONE;
  }
  WorkObject *w = PyObject_New(WorkObject, &chorus__WorkType);
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
    if (!((k)->comm = chorus__comm_ok((k)->c))) {                                      \
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
PyObject *chorus__Comm_broadcast(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int root, dt;
  if (chorus__nargs_is(n, 4, "broadcast(buf, root, dtype, async_op)") ||
      chorus__arg_int(a[1], &root, "root") || chorus__arg_int(a[2], &dt, "dtype") ||
      call_begin(&k, c, a[3]))
    return NULL;
  if (chorus__buf_get(a[0], root != chorus_comm_rank(k.comm), dt, &k.bufs[0], "the tensor") < 0) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_broadcast(k.comm, k.bufs[0].view.buf, k.bufs[0].count,
                             (chorus_dtype_t)k.bufs[0].dtype, root, work));
}

/* all_reduce(send, recv, op, dtype, async) */
PyObject *chorus__Comm_all_reduce(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int op, dt;
  if (chorus__nargs_is(n, 5, "all_reduce(send, recv, op, dtype, async_op)") ||
      chorus__arg_int(a[2], &op, "op") || chorus__arg_int(a[3], &dt, "dtype") ||
      call_begin(&k, c, a[4]))
    return NULL;
  if (chorus__buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      (a[0] != a[1] && chorus__buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0)) {
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
PyObject *chorus__Comm_reduce(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int op, root, dt;
  if (chorus__nargs_is(n, 6, "reduce(send, recv, op, root, dtype, async_op)") ||
      chorus__arg_int(a[2], &op, "op") || chorus__arg_int(a[3], &root, "root") ||
      chorus__arg_int(a[4], &dt, "dtype") ||
      call_begin(&k, c, a[5]))
    return NULL;
  int is_root = root == chorus_comm_rank(k.comm);
  int inplace = a[0] == a[1];
  if (chorus__buf_get(a[0], inplace && is_root, dt, &k.bufs[0], "the input") < 0 ||
      (is_root && !inplace && a[1] != Py_None &&
       chorus__buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0)) {
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
PyObject *chorus__Comm_scatter(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int root, dt;
  if (chorus__nargs_is(n, 5, "scatter(send, recv, root, dtype, async_op)") ||
      chorus__arg_int(a[2], &root, "root") ||
      chorus__arg_int(a[3], &dt, "dtype") ||
      call_begin(&k, c, a[4]))
    return NULL;
  int is_root = root == chorus_comm_rank(k.comm);
  size_t size = (size_t)chorus_comm_size(k.comm);
  if (chorus__buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      (is_root && chorus__buf_get(a[0], 0, dt, &k.bufs[0], "the scatter input") < 0) ||
      (is_root && check_blocks(&k.bufs[1], &k.bufs[0], size, "scatter", "the output",
                               "the input") < 0)) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_scatter(k.comm, is_root ? k.bufs[0].view.buf : NULL, k.bufs[1].view.buf,
                           k.bufs[1].count, (chorus_dtype_t)k.bufs[1].dtype, root, work));
}

/* gather(send, recv|None, root, dtype, async) */
PyObject *chorus__Comm_gather(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int root, dt;
  if (chorus__nargs_is(n, 5, "gather(send, recv, root, dtype, async_op)") ||
      chorus__arg_int(a[2], &root, "root") || chorus__arg_int(a[3], &dt, "dtype") ||
      call_begin(&k, c, a[4]))
    return NULL;
  int is_root = root == chorus_comm_rank(k.comm);
  size_t size = (size_t)chorus_comm_size(k.comm);
  if (chorus__buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0 ||
      (is_root && chorus__buf_get(a[1], 1, dt, &k.bufs[1], "the gather output") < 0) ||
      (is_root && check_blocks(&k.bufs[0], &k.bufs[1], size, "gather", "the input",
                               "the output") < 0)) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_gather(k.comm, k.bufs[0].view.buf, is_root ? k.bufs[1].view.buf : NULL,
                          k.bufs[0].count, (chorus_dtype_t)k.bufs[0].dtype, root, work));
}

/* all_gather(send, recv, dtype, async): into one buffer. */
PyObject *chorus__Comm_all_gather(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int dt;
  if (chorus__nargs_is(n, 4, "all_gather(send, recv, dtype, async_op)") ||
      chorus__arg_int(a[2], &dt, "dtype") || call_begin(&k, c, a[3]))
    return NULL;
  size_t size = (size_t)chorus_comm_size(k.comm);
  if (chorus__buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0 ||
      chorus__buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      check_blocks(&k.bufs[0], &k.bufs[1], size, "all_gather", "the input", "the output") < 0) {
    call_release(&k);
    return NULL;
  }
  ISSUE(&k, chorus_all_gather(k.comm, k.bufs[0].view.buf, k.bufs[1].view.buf, k.bufs[0].count,
                              (chorus_dtype_t)k.bufs[0].dtype, work));
}

/* all_gather_list(send, [recv...], dtype, async) */
PyObject *chorus__Comm_all_gather_list(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int dt;
  if (chorus__nargs_is(n, 4, "all_gather_list(send, outputs, dtype, async_op)") ||
      chorus__arg_int(a[2], &dt, "dtype") ||
      call_begin(&k, c, a[3]))
    return NULL;
  Py_ssize_t size = chorus_comm_size(k.comm);
  if (chorus__buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0) goto fail;
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
    if (chorus__buf_get(PySequence_Fast_GET_ITEM(k.keep, i), 1, dt, &k.list[i], what) < 0 ||
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
PyObject *chorus__Comm_reduce_scatter(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int op, dt;
  if (chorus__nargs_is(n, 5, "reduce_scatter(send, recv, op, dtype, async_op)") ||
      chorus__arg_int(a[2], &op, "op") || chorus__arg_int(a[3], &dt, "dtype") ||
      call_begin(&k, c, a[4]))
    return NULL;
  size_t size = (size_t)chorus_comm_size(k.comm);
  if (chorus__buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0 ||
      chorus__buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
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
PyObject *chorus__Comm_all_to_all(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int dt;
  if (chorus__nargs_is(n, 4, "all_to_all(send, recv, dtype, async_op)") ||
      chorus__arg_int(a[2], &dt, "dtype") || call_begin(&k, c, a[3]))
    return NULL;
  size_t size = (size_t)chorus_comm_size(k.comm);
  int inplace = a[0] == a[1];
  if (chorus__buf_get(a[1], 1, dt, &k.bufs[1], "the output") < 0 ||
      (!inplace && chorus__buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0)) {
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
PyObject *chorus__Comm_all_to_allv(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  int dt;
  if (chorus__nargs_is(n, 8, "all_to_allv(send, scounts, sdispls, recv, rcounts, rdispls, dtype, "
                     "async_op)") ||
      chorus__arg_int(a[6], &dt, "dtype") ||
      call_begin(&k, c, a[7]))
    return NULL;
  Py_ssize_t size = chorus_comm_size(k.comm);
  size_t *sc = NULL, *sd = NULL, *rc = NULL, *rd = NULL;
  PyObject *res = NULL;
  if (chorus__buf_get(a[0], 0, dt, &k.bufs[0], "the input") < 0 ||
      chorus__buf_get(a[3], 1, dt, &k.bufs[1], "the output") < 0 ||
      same_dtype(&k.bufs[0], &k.bufs[1]) || !(sc = size_array(a[1], size, "input split sizes")) ||
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
PyObject *chorus__Comm_barrier(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  call_t k;
  if (chorus__nargs_is(n, 1, "barrier(async_op)") || call_begin(&k, c, a[0])) return NULL;
  ISSUE(&k, chorus_barrier(k.comm, work));
}

/* send(buf, peer, tag, dtype, async) / recv(...) */
static PyObject *p2p(CommObject *c, PyObject *const *a, Py_ssize_t n, int is_send) {
  call_t k;
  int peer, tag, dt;
  if (chorus__nargs_is(n, 5, is_send ? "send(buf, peer, tag, dtype, async_op)"
                             : "recv(buf, peer, tag, dtype, async_op)") ||
      chorus__arg_int(a[1], &peer, "peer") || chorus__arg_int(a[2], &tag, "tag") ||
      chorus__arg_int(a[3], &dt, "dtype") || call_begin(&k, c, a[4]))
    return NULL;
  if (chorus__buf_get(a[0], !is_send, dt, &k.bufs[0], "the tensor") < 0) {
    call_release(&k);
    return NULL;
  }
  if (is_send)
    ISSUE(&k, chorus_send(k.comm, k.bufs[0].view.buf, k.bufs[0].count,
                          (chorus_dtype_t)k.bufs[0].dtype, peer, tag, work));
  ISSUE(&k, chorus_recv(k.comm, k.bufs[0].view.buf, k.bufs[0].count,
                        (chorus_dtype_t)k.bufs[0].dtype, peer, tag, work));
}
PyObject *chorus__Comm_send(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  return p2p(c, a, n, 1);
}
PyObject *chorus__Comm_recv(CommObject *c, PyObject *const *a, Py_ssize_t n) {
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
  chorus_comm_t m = chorus__comm_ok(c);
  int root = 0;
  if (!m ||
      chorus__nargs_is(n, all ? 1 : 2,
                       all ? "all_gather_bytes(data)" : "gather_bytes(data, root)") ||
      (!all && chorus__arg_int(a[1], &root, "root")))
    return NULL;
  buf_t b;
  if (chorus__buf_get(a[0], 0, CHORUS_UINT8, &b, "the data") < 0) {
    chorus__buf_release(&b);
    return NULL;
  }
  int size = chorus_comm_size(m);
  size_t *lens = PyMem_Calloc((size_t)size, sizeof *lens);
  if (!lens) {
    chorus__buf_release(&b);
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
  chorus__buf_release(&b);
  PyObject *res;
  if (st != CHORUS_OK) res = chorus__comm_error(c, st);
  else if (!out && !all && root != chorus_comm_rank(m)) {
    Py_INCREF(Py_None);
    res = Py_None;
  } else res = bytes_list(out ? out : "", lens, size);
  chorus_free(out);
  PyMem_Free(lens);
  return res;
}
PyObject *chorus__Comm_gather_bytes(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  return gather_bytes(c, a, n, 0);
}
PyObject *chorus__Comm_all_gather_bytes(CommObject *c, PyObject *const *a, Py_ssize_t n) {
  return gather_bytes(c, a, n, 1);
}
