/*
 * ucx_load.c - loading libucp into the table of its functions
 * (ucx_internal.h), and choosing UCX, in either build: the active RDMA
 * devices, and whether the ranks' published fields make a world use UCX.
 *
 * Loading.  libucp is opened with dlopen() by the first rank that asks
 * for UCX (CHORUS_TRANSPORT=ucx), never linked: UCX's memory hooks
 * (libucm intercepts mmap and friends when it loads) stay out of every
 * process that does not use it.
 */
#include "transport/chan.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>

#ifdef CHORUS_HAVE_UCX

#include <dlfcn.h>
#include <pthread.h>

/* The functions' own names here: this file fills the table. */
#define CHORUS__UCX_LOADER
#include "transport/ucx_internal.h"

/* ---------------------------------------------------------- loading UCX */

chorus__ucx_fns_t chorus__ucx_fn;
static pthread_once_t g_ucx_once = PTHREAD_ONCE_INIT;
static char g_ucx_error[256];

static void ucx_load(void) {
  void *lib = dlopen("libucp.so.0", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(g_ucx_error, sizeof g_ucx_error, "cannot load UCX (libucp.so.0: %s); install "
             "Debian's libucx0", dlerror());
    return;
  }
  /* dlsym returns void *; POSIX guarantees the conversion works. */
#define X(f)                                                                     \
  if (!(*(void **)&chorus__ucx_fn.f = dlsym(lib, #f))) {                         \
    snprintf(g_ucx_error, sizeof g_ucx_error, "libucp.so.0 lacks %s (UCX older " \
             "than 1.13?)", #f);                                                 \
    return;                                                                      \
  }
  UCX_FUNCS(X)
#undef X
  /* Kept loaded: UCX's hooks and threads outlive any one context. */
}

const char *chorus__ucx_load(void) {
  pthread_once(&g_ucx_once, ucx_load);
  return g_ucx_error[0] ? g_ucx_error : NULL;
}

#endif

/* ------------------------------------------- choosing UCX (either build) */

int chorus__rdma_active(const char *dir, char *names, size_t cap) {
  if (cap) names[0] = '\0';
  DIR *d = opendir(dir);
  if (!d) return 0;
  int found = 0;
  size_t off = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char ports[512];
    snprintf(ports, sizeof ports, "%s/%s/ports", dir, e->d_name);
    DIR *pd = opendir(ports);
    if (!pd) continue;
    int active = 0;
    struct dirent *p;
    while (!active && (p = readdir(pd))) {
      if (p->d_name[0] == '.') continue;
      char path[800], state[64] = "";
      snprintf(path, sizeof path, "%s/%s/state", ports, p->d_name);
      FILE *f = fopen(path, "r");
      if (!f) continue;
      /* "4: ACTIVE" */
      if (fgets(state, sizeof state, f) && strstr(state, "ACTIVE")) active = 1;
      fclose(f);
    }
    closedir(pd);
    if (!active) continue;
    found++;
    if (off < cap)
      off += (size_t)snprintf(names + off, cap - off, "%s%s", off ? "," : "", e->d_name);
  }
  closedir(d);
  return found;
}

int chorus__ucx_decide(const char *const *fields, int n, int *bad) {
  int forced = 0, all = 1;
  *bad = -1;
  for (int r = 0; r < n; r++) {
    const char *f = fields[r];
    if (f[0] == 'U') forced = 1;
    if (f[0] != 'U' && f[0] != 'A') {
      all = 0;
      if (*bad < 0) *bad = r;
    }
  }
  if (all) return 1;
  return forced ? -1 : 0;
}
