/*
 * _chorus.h - what the files of the CPython extension (`chorus._chorus`)
 * share and Python never sees: the Comm and Work objects' layout, a buffer
 * argument, the registered error classes and the three type objects.
 *
 *   _chorus.c        the module: errors, making a world, init
 *   _chorus_comm.c   the Comm and Work objects
 *   _chorus_coll.c   buffer arguments and the collectives on them
 *   _chorus_store.c  the Store object
 */
#ifndef CHORUS_PYTHON_CHORUS_H
#define CHORUS_PYTHON_CHORUS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "chorus.h"

/* ----------------------------------------------------------------- errors */

#define NCODES 12 /* -0 .. -11 */
extern PyObject *chorus__err_class[NCODES]; /* by -code; [0]: the base class */

/* Raises the class registered for st with msg (the library's words). */
PyObject *chorus__raise_code(chorus_result_t st, const char *msg);

/* ---------------------------------------------------------------- buffers */

/* A buffer argument.  `want`: the dtype the caller named (-1: from the
 * buffer's format).  Fills the view (released by the caller) and returns
 * its dtype and element count, or -1 with an exception. */
typedef struct {
  Py_buffer view;
  int held;
  int dtype;
  size_t count;
} buf_t;

int chorus__buf_get(PyObject *obj, int writable, int want, buf_t *b, const char *what);
void chorus__buf_release(buf_t *b);

/* ------------------------------------------------------------ Comm, Work */

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

extern PyTypeObject chorus__CommType, chorus__WorkType, chorus__StoreType;

/* c's communicator, or NULL with the "destroyed" error. */
chorus_comm_t chorus__comm_ok(CommObject *c);
/* Raises st with c's last error message. */
PyObject *chorus__comm_error(CommObject *c, chorus_result_t st);
/* A new Comm owning comm (destroyed if the object cannot be made). */
PyObject *chorus__comm_wrap(chorus_comm_t comm);

/* Positional arguments: an int that fits (what names it in the error),
 * and the count a method takes (sig names it). */
int chorus__arg_int(PyObject *o, int *out, const char *what);
int chorus__nargs_is(Py_ssize_t nargs, Py_ssize_t want, const char *sig);

/* The collective methods of Comm (_chorus_coll.c), in its method table:
 * positional arguments, the last one async_op. */
PyObject *chorus__Comm_broadcast(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_all_reduce(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_reduce(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_scatter(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_gather(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_all_gather(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_all_gather_list(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_reduce_scatter(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_all_to_all(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_all_to_allv(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_barrier(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_send(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_recv(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_gather_bytes(CommObject *c, PyObject *const *a, Py_ssize_t n);
PyObject *chorus__Comm_all_gather_bytes(CommObject *c, PyObject *const *a, Py_ssize_t n);

#endif
