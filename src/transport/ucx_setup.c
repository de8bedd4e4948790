/*
 * ucx_setup.c - setting the UCX channel up: a worker made before the
 * ranks exchange addresses (and whether UCX can use an RDMA device), then
 * the channel over it, one link per peer with its tokens; and the same
 * calls in a library built without UCX.
 */
#include "transport/chan.h"

#include <stdio.h>

#ifdef CHORUS_HAVE_UCX

#include "transport/ucx_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>

#include "util/clock.h"
#include "util/le.h"
#include "util/net.h"
#include "util/util.h"

/* ---------------------------------------------------------------- set-up */

int chorus__ucx_built(void) { return 1; }

/* The RDMA transports UCX found ("rc_mlx5/mlx5_0:1 ud_verbs/..."), read from
 * what ucp_context_print_info lists ("resource 2 : md 1 dev 2 flags --
 * rc_verbs/mlx5_0:1"): how many. */
static int rdma_resources(ucp_context_h ctx, char *names, size_t cap) {
  char text[8192] = "";
  FILE *f = fmemopen(text, sizeof text - 1, "w");
  if (!f) return 0;
  ucp_context_print_info(ctx, f);
  fclose(f);
  int n = 0;
  size_t off = 0;
  if (cap) names[0] = '\0';
  char *save = NULL;
  for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    if (!strstr(line, "resource") || !strstr(line, "flags")) continue;
    char *tl = strrchr(line, ' ');
    if (!tl) continue;
    tl++;
    if (strncmp(tl, "rc_", 3) && strncmp(tl, "dc_", 3) && strncmp(tl, "ud_", 3)) continue;
    n++;
    if (off < cap) off += (size_t)snprintf(names + off, cap - off, "%s%s", off ? " " : "", tl);
  }
  return n;
}

chorus_result_t chorus__ucx_worker_new(chorus__ucx_worker_t **out, char **addr_hex, int need_rdma,
                                       char *errmsg, size_t errcap) {
  *out = NULL;
  *addr_hex = NULL;
  const char *load_error = chorus__ucx_load();
  if (load_error) {
    snprintf(errmsg, errcap, "%s", load_error);
    return CHORUS_ERR_NOT_SUPPORTED;
  }
  chorus__ucx_worker_t *w = calloc(1, sizeof *w);
  if (!w) return CHORUS_ERR_NO_MEMORY;
  ucp_config_t *conf = NULL;
  ucs_status_t st = ucp_config_read(NULL, NULL, &conf);
  if (st == UCS_OK) {
    ucp_params_t prm = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
    st = chorus__ucx_fn.ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &prm, conf, &w->ctx);
    ucp_config_release(conf);
  }
  if (st == UCS_OK) {
    /* Chosen for an RDMA device, UCX must be able to use it (its verbs
     * library, a provider for the card), or TCP is the better channel;
     * forced, it is told what UCX will use. */
    char names[256];
    int nr = rdma_resources(w->ctx, names, sizeof names);
    if (need_rdma && nr == 0) {
      snprintf(errmsg, errcap, "UCX found no RDMA transport (rc, dc or ud) for the device");
      chorus__ucx_worker_free(w);
      return CHORUS_ERR_NOT_SUPPORTED;
    }
    CHORUS_INFO(CHORUS__SUB_INIT, "UCX %s RDMA transports: %s", need_rdma ? "chosen," : "forced;",
                nr ? names : "none (UCX will use TCP or shared memory)");
  }
  if (st == UCS_OK) {
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    st = ucp_worker_create(w->ctx, &wp, &w->worker);
  }
  ucp_address_t *a = NULL;
  size_t alen = 0;
  if (st == UCS_OK) st = ucp_worker_get_address(w->worker, &a, &alen);
  if (st != UCS_OK) {
    snprintf(errmsg, errcap, "cannot start UCX (%s); check UCX_TLS and UCX_NET_DEVICES",
             ucs_status_string(st));
    chorus__ucx_worker_free(w);
    return CHORUS_ERR_SYSTEM;
  }
  char *hex = malloc(2 * alen + 1);
  if (hex) chorus__hex(hex, a, alen);
  ucp_worker_release_address(w->worker, a);
  if (!hex) {
    chorus__ucx_worker_free(w);
    return CHORUS_ERR_NO_MEMORY;
  }
  *out = w;
  *addr_hex = hex;
  return CHORUS_OK;
}

void chorus__ucx_worker_free(chorus__ucx_worker_t *w) {
  if (!w) return;
  if (w->worker) ucp_worker_destroy(w->worker);
  if (w->ctx) ucp_cleanup(w->ctx);
  free(w);
}

static int unhex(const char *s, uint8_t **out) {
  size_t n = strlen(s);
  if (n == 0 || n % 2 || n > 2 * CHORUS__UCX_ADDR_MAX) return -1;
  uint8_t *b = malloc(n / 2);
  if (!b) return -1;
  for (size_t i = 0; i < n / 2; i++) {
    int v = 0;
    for (int k = 0; k < 2; k++) {
      char c = s[2 * i + (size_t)k];
      int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (d < 0) {
        free(b);
        return -1;
      }
      v = v * 16 + d;
    }
    b[i] = (uint8_t)v;
  }
  *out = b;
  return 0;
}

chorus_result_t chorus__ucx_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                 chorus__chan_t **out, char *errmsg, size_t errcap) {
  *out = NULL;
  chorus__ucx_worker_t *w = cfg->ucx;
  ucx_chan_t *ch = calloc(1, sizeof *ch);
  if (!ch) {
    chorus__ucx_worker_free(w);
    return CHORUS_ERR_NO_MEMORY;
  }
  ch->base.ops = &chorus__ucx_ops;
  ch->base.tp = tp;
  ch->ctx = w->ctx;
  ch->worker = w->worker;
  free(w);
  ch->efd = -1;
  ch->watch = (chorus__watch_t){chorus__ucx_on_efd, ch};
  ch->links = calloc((size_t)cfg->size, sizeof *ch->links);
  ch->addrs = calloc((size_t)cfg->size, sizeof *ch->addrs);
  chorus_result_t st = CHORUS_ERR_NO_MEMORY;
  if (!ch->links || !ch->addrs) goto fail;
  for (int r = 0; r < cfg->size; r++) {
    /* Every rank of another host is touched now: the addresses are all
     * here (UCX forms its worlds with every record). */
    if (r == cfg->rank || chorus__tp_chan_of(tp, r)) continue;
    chorus__peer_t *p = chorus__tp_peer(tp, r);
    if (!p) goto fail;
    /* Ours are named by their host ("rank 3 (ucx:10.0.0.8)"): their TCP
     * listener is not used. */
    char host[64];
    int port;
    if (cfg->addrs && chorus__net_split_addr(cfg->addrs[r], ' ', host, sizeof host, &port) == 0)
      snprintf(p->addr, sizeof p->addr, "ucx:%s", host);
    if (!cfg->ucx_addrs || !cfg->ucx_addrs[r] ||
        unhex(cfg->ucx_addrs[r], &ch->addrs[r]) < 0) {
      snprintf(errmsg, errcap, "rank %d published no UCX address: every rank must set "
               "CHORUS_TRANSPORT=ucx (or none)", r);
      st = CHORUS_ERR_INVALID_ARG;
      goto fail;
    }
    ucx_link_t *l = &ch->links[r];
    l->peer = p;
    l->ch = ch;
    chorus__ucx_token(cfg->key, cfg->world_id, r, cfg->rank, l->tok_in);
    chorus__ucx_token(cfg->key, cfg->world_id, cfg->rank, r, l->tok_out);
    chorus__tp_rx_attach(tp, p, &l->rx, &ch->base, l);
    p->chan = &ch->base;
    p->link = l;
  }
  ucp_am_handler_param_t hp = {
      .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                    UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG,
      .id = AM_ID,
      .flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA,
      .cb = chorus__ucx_am_cb,
      .arg = ch};
  ucs_status_t us = ucp_worker_set_am_recv_handler(ch->worker, &hp);
  if (us == UCS_OK) us = ucp_worker_get_efd(ch->worker, &ch->efd);
  if (us != UCS_OK) {
    ch->efd = -1;
    snprintf(errmsg, errcap, "UCX worker: %s", ucs_status_string(us));
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  if (chorus__tp_watch(tp, ch->efd, EPOLLIN, &ch->watch) < 0) {
    snprintf(errmsg, errcap, "epoll on the UCX worker: %s", strerror(errno));
    ch->efd = -1;
    st = CHORUS_ERR_SYSTEM;
    goto fail;
  }
  *out = &ch->base;
  return CHORUS_OK;
fail:
  CHORUS__FOR_PEERS(tp, p) {
    if (p->chan != &ch->base) continue;
    chorus__tp_rx_detach(p, &ch->links[p->rank].rx);
    p->chan = NULL;
    p->link = NULL;
  }
  chorus__ucx_destroy(&ch->base);
  return st;
}

#else /* !CHORUS_HAVE_UCX */

int chorus__ucx_built(void) { return 0; }

chorus_result_t chorus__ucx_worker_new(chorus__ucx_worker_t **out, char **addr_hex, int need_rdma,
                                       char *errmsg, size_t errcap) {
  (void)need_rdma;
  *out = NULL;
  *addr_hex = NULL;
  snprintf(errmsg, errcap, "this libchorus was built without UCX (install libucx-dev and "
           "rebuild), so CHORUS_TRANSPORT=ucx is not available");
  return CHORUS_ERR_INVALID_ARG;
}

void chorus__ucx_worker_free(chorus__ucx_worker_t *w) { (void)w; }

chorus_result_t chorus__ucx_open(chorus__tp_t *tp, const chorus__tp_config_t *cfg,
                                 chorus__chan_t **out, char *errmsg, size_t errcap) {
  (void)tp;
  (void)cfg;
  *out = NULL;
  snprintf(errmsg, errcap, "built without UCX");
  return CHORUS_ERR_INVALID_ARG;
}

#endif
