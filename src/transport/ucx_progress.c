/*
 * ucx_progress.c - driving the UCX channel and its calls other than
 * sending: acting on what UCX's callbacks noted (drive), the heartbeats of
 * links with a message in flight, the worker's event descriptor, making a
 * peer's UCX endpoint, cancelling an endpoint's messages, closing a peer,
 * describing a link, and tearing the channel down (also at exit).
 *
 * Progress.  UCX calls back from ucp_worker_progress; the callbacks only
 * note what happened, and drive() acts on it afterwards (routing calls
 * into the endpoint layer, which may send, fail peers or close them --
 * none of which may happen inside a UCX callback).  The progress thread
 * sleeps on the worker's event descriptor, armed before it sleeps.
 *
 * Every function here runs with the context's lock held (chan.h).
 */
#include "transport/chan.h"

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

/* -------------------------------------------------------------- progress */

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
  ucx_link_t *l = arg;
  (void)ep;
  chorus__ucx_defer_fail(l, 0, "became unreachable (its UCX endpoint failed: %s)",
                         ucs_status_string(status));
}

int chorus__ucx_ensure_ep(ucx_link_t *l) {
  if (l->ep) return 0;
  ucx_chan_t *ch = l->ch;
  int r = l->peer->rank;
  ucp_ep_params_t prm = {
      .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER,
      .address = (const ucp_address_t *)ch->addrs[r],
      .err_mode = UCP_ERR_HANDLING_MODE_PEER,
      .err_handler = {.cb = ep_err_cb, .arg = l}};
  ucs_status_t st = ucp_ep_create(ch->worker, &prm, &l->ep);
  if (st != UCS_OK) {
    l->ep = NULL;
    char why[160];
    snprintf(why, sizeof why, "cannot be reached (UCX endpoint: %s)", ucs_status_string(st));
    chorus__tp_peer_failed(ch->base.tp, l->peer, why, CHORUS_ERR_REMOTE);
    return -1;
  }
  return 0;
}

/* The endpoint layer sends a peer heartbeats only while nothing is queued
 * to it (over TCP the queued bytes themselves say the sender is alive).
 * Here a large message waits at the sender until the receiver fetches it,
 * which may take longer than the peer timeout on a slow link: so a link
 * with a message in flight and nothing else sent for a heartbeat period
 * gets a bare acknowledgement, which the peer counts as hearing from us. */
static void heartbeats(ucx_chan_t *ch) {
  int64_t now = chorus__now_ns(), period = (int64_t)CHORUS__HEARTBEAT_MS * 1000000;
  ucx_link_t *due = NULL;
  for (sent_t *s = ch->inflight; s; s = s->next) {
    ucx_link_t *l = s->l;
    if (l->hb_due || l->closed || l->fail_what || !l->ep || now - l->last_sent < period) continue;
    l->hb_due = 1;
    l->next_hb = due;
    due = l;
  }
  while (due) {
    ucx_link_t *l = due;
    due = l->next_hb;
    l->hb_due = 0;
    if (!l->closed) chorus__ucx_post(l, NULL);
  }
}

/* Acts on what the callbacks noted, until UCX has nothing more. */
static void drive(ucx_chan_t *ch) {
  chorus__tp_t *tp = ch->base.tp;
  if (ch->driving) return;
  ch->driving = 1;
  for (int rounds = 0; rounds < 64; rounds++) {
    unsigned n = 0;
    for (int k = 0; k < 256 && ucp_worker_progress(ch->worker); k++) n++;
    int did = 0;
    while (ch->completed) {
      sent_t *s = ch->completed;
      LIST_DEL(ch->completed, s);
      did = 1;
      ucx_link_t *l = s->l;
      if (s->req) ucp_request_free(s->req);
      s->req = NULL;
      chorus__tx_t *it = s->it;
      /* A receiver that had nowhere to put a rendezvous payload
       * declines it: delivered as far as this rank is concerned. */
      ucs_status_t status = s->status;
      int ok = status == UCS_OK || (status == UCS_ERR_CANCELED && !l->closed);
      if (!it || ok) {
        free(s);
        if (it) chorus__tp_tx_done(tp, it);
        continue;
      }
      /* The peer fails first, after what it sent before (its endpoints
       * fail and tell the others why), then this message is lost with it. */
      if (!l->closed)
        chorus__ucx_defer_fail(l, 0, "could not be sent to (UCX: %s)", ucs_status_string(status));
      s->next = ch->failed_sends;
      ch->failed_sends = s;
    }
    while (ch->pulled) {
      pull_t *pl = ch->pulled;
      LIST_DEL(ch->pulled, pl);
      did = 1;
      chorus__ucx_pull_finish(ch, pl);
    }
    /* Messages first, failures after: what a peer sent before its
     * endpoint failed (a goodbye, an ABORT naming the real cause) is
     * routed before the failure is acted on. */
    ucx_link_t *batch = NULL;
    while (ch->ready) {
      ucx_link_t *l = ch->ready;
      ch->ready = l->next_ready;
      l->ready = 0;
      l->next_batch = batch;
      batch = l;
      did = 1;
    }
    for (ucx_link_t *l = batch; l; l = l->next_batch) {
      if (l->closed || l->fail_protocol) continue;
      if (!l->ep && !l->fail_what && chorus__ucx_ensure_ep(l) < 0) continue;
      chorus__ucx_route(l);
      if (!l->fail_what) chorus__ucx_flush(l);
    }
    for (ucx_link_t *l = batch; l; l = l->next_batch) {
      if (l->closed || !l->fail_what) continue;
      if (l->fail_protocol) chorus__tp_protocol_error(tp, l->peer, l->fail_what);
      else chorus__tp_peer_failed(tp, l->peer, l->fail_what, CHORUS_ERR_REMOTE);
    }
    while (ch->failed_sends) { /* their peers failed just now */
      sent_t *s = ch->failed_sends;
      ch->failed_sends = s->next;
      chorus__tp_tx_lost(tp, s->l->peer, s->it);
      free(s);
      did = 1;
    }
    while (ch->failed_pulls) {
      pull_t *pl = ch->failed_pulls;
      ch->failed_pulls = pl->next;
      chorus__tp_rx_detach(pl->l->peer, &pl->rx);
      free(pl);
      did = 1;
    }
    if (!n && !did) break;
  }
  heartbeats(ch);
  ch->driving = 0;
}

void chorus__ucx_on_efd(void *arg, uint32_t events) {
  (void)events;
  drive(arg);
}

static void ucx_poll(chorus__chan_t *base) { drive((ucx_chan_t *)base); }

static int ucx_idle(chorus__chan_t *base, int sleeping) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  if (!sleeping) return 0;
  for (int k = 0; k < 16; k++) {
    drive(ch);
    ucs_status_t st = ucp_worker_arm(ch->worker);
    /* Armed, but work of ours left (a heartbeat failed a peer): again. */
    if (st == UCS_OK) return ch->ready || ch->completed || ch->pulled;
    if (st != UCS_ERR_BUSY) {
      /* Cannot arm: the progress thread's heartbeat tick (and the
       * channel's poll) keep it going, slower; said once. */
      if (!ch->warned_arm) {
        ch->warned_arm = 1;
        CHORUS_WARN(CHORUS__SUB_TCP, "chorus: cannot arm the UCX worker's event descriptor "
                    "(%s): UCX progresses every %d ms only", ucs_status_string(st),
                    CHORUS__HEARTBEAT_MS / 2);
      }
      return 0;
    }
  }
  return 1; /* still busy: look again at once */
}

/* ------------------------------------------------------ the other calls */

static void ep_drop(ucx_chan_t *ch, ucx_link_t *l, int force);

/* Progresses UCX (callbacks only note) until ep's operations with l are
 * done or the deadline passed: 0 when they are. */
static int wait_ops(ucx_link_t *l, const chorus__ep_t *ep, int64_t deadline) {
  ucx_chan_t *ch = l->ch;
  for (;;) {
    int busy = 0;
    for (sent_t *s = ch->inflight; s && !busy; s = s->next)
      if (s->l == l && s->it && s->it->ep == ep) busy = 1;
    for (pull_t *pl = ch->pulls; pl && !busy; pl = pl->next)
      if (pl->l == l && pl->owner == ep) busy = 1;
    if (!busy) return 0;
    if (chorus__now_ns() >= deadline) return -1;
    ucp_worker_progress(ch->worker);
  }
}

static int ucx_cancel(chorus__chan_t *base, chorus__peer_t *p, chorus__ep_t *ep) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  ucx_link_t *l = p->link;
  int rc = chorus__txq_cancel(&l->q, ep);
  /* Handed to UCX: its sends read ep's buffers and its fetches write them
   * until they complete; they must before the caller frees them.  With a
   * peer that failed (its endpoints are failing now, before its close),
   * the endpoint is closed at once, which cancels its sends.  A live peer
   * finishes them within a round trip (it declines what its own failed
   * endpoint no longer wants); one that does not within CANCEL_WAIT_MS is
   * stopped, cut off or holding the message back for its receive budget,
   * and fails (-1), which ends them. */
  if (p->dead) ep_drop(ch, l, 1);
  if (wait_ops(l, ep, chorus__now_ns() + (int64_t)(p->dead ? 0 : CANCEL_WAIT_MS) * 1000000) < 0)
    return -1;
  for (sent_t *s = ch->completed; s; s = s->next)
    if (s->l == l && s->it && s->it->ep == ep) {
      s->it->req = NULL;
      s->it->ep = NULL;
    }
  for (pull_t *pl = ch->pulled; pl; pl = pl->next)
    if (pl->l == l && pl->owner == ep) pl->owner = NULL;
  return rc;
}

static int ucx_pending(chorus__chan_t *base, chorus__peer_t *p, const chorus__ep_t *ep) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  ucx_link_t *l = p->link;
  if (chorus__txq_has(&l->q, ep)) return 1;
  for (sent_t *s = ch->inflight; s; s = s->next)
    if (s->l == l && s->it && (!ep || s->it->ep == ep)) return 1;
  for (sent_t *s = ch->completed; s; s = s->next)
    if (s->l == l && s->it && (!ep || s->it->ep == ep)) return 1;
  return 0;
}

/* Closes l's endpoint at once (FORCE: its sends complete as cancelled). */
static void ep_drop(ucx_chan_t *ch, ucx_link_t *l, int force) {
  if (!l->ep) return;
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
  ucs_status_ptr_t r = ucp_ep_close_nbx(l->ep, &prm);
  l->ep = NULL;
  if (r && UCS_PTR_IS_PTR(r)) {
    int64_t until = chorus__now_ns() + (int64_t)(force ? 1000 : 2000) * 1000000;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && chorus__now_ns() < until)
      ucp_worker_progress(ch->worker);
    if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(ch->worker, r);
    ucp_request_free(r);
  }
}

static void ucx_close(chorus__chan_t *base, chorus__peer_t *p) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  chorus__tp_t *tp = base->tp;
  ucx_link_t *l = p->link;
  if (l->closed) return;
  l->closed = 1;
  ep_drop(ch, l, 1);
  /* Every message to it comes back lost: the ones UCX finished (or
   * cancelled) now, the ones it still holds when their callbacks run.
   * Losing one fails endpoints, which may run UCX's callbacks (cancel
   * waits) and move entries between the lists: each search starts over. */
  for (;;) {
    sent_t *s = NULL;
    for (sent_t *x = ch->completed; x && !s; x = x->next)
      if (x->l == l && x->it) s = x;
    for (sent_t *x = ch->inflight; x && !s; x = x->next)
      if (x->l == l && x->it) s = x;
    if (!s) break;
    chorus__tx_t *it = s->it;
    s->it = NULL;
    chorus__tp_tx_lost(tp, p, it);
  }
  chorus__txq_lose(tp, p, &l->q);
  while (l->held) {
    held_t *m = l->held;
    l->held = m->next;
    chorus__ucx_held_release(ch, m);
  }
}

/* "ucx posix/memory cma/memory": the transports of the endpoint's lanes,
 * read from what ucp_ep_print_info prints ("lane[0]:  8:posix/memory.0 ..."). */
static void ucx_link_desc(chorus__chan_t *base, chorus__peer_t *p, char *buf, size_t cap) {
  ucx_link_t *l = p->link;
  (void)base;
  if (l->closed) {
    snprintf(buf, cap, "ucx (connection gone)");
    return;
  }
  if (!l->ep) {
    snprintf(buf, cap, "ucx (not connected yet)");
    return;
  }
  char text[4096] = "";
  FILE *f = fmemopen(text, sizeof text - 1, "w");
  if (f) {
    ucp_ep_print_info(l->ep, f);
    fclose(f);
  }
  size_t off = (size_t)snprintf(buf, cap, "ucx");
  for (char *line = text; line && *line && off < cap; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
    char *lane = strstr(line, "lane[");
    char *eol = strchr(line, '\n');
    if (!lane || (eol && lane > eol)) continue;
    char *c = strchr(lane, ':');
    if (!c || (eol && c > eol)) continue;
    c++;
    while (*c == ' ') c++;
    while (*c >= '0' && *c <= '9') c++;
    if (*c == ':') c++;
    size_t n = strcspn(c, " \n");
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)CHORUS__MIN(n, sizeof name - 1), c);
    char *dot = strrchr(name, '.');
    if (dot && dot > strchr(name, '/')) *dot = '\0';
    if (!name[0] || strstr(buf, name)) continue; /* each transport once */
    off += (size_t)snprintf(buf + off, cap - off, " %s", name);
  }
}

static int ucx_link_state(chorus__chan_t *base, chorus__peer_t *p, int64_t *since) {
  ucx_link_t *l = p->link;
  (void)base;
  (void)since;
  return l->ep || l->closed ? CHORUS__LINK_READY : CHORUS__LINK_NONE;
}

static void free_sent(sent_t *s) {
  if (s->it) chorus__tx_free(s->it);
  free(s);
}

static void free_pull(pull_t *pl) {
  chorus__tp_rx_detach(pl->l->peer, &pl->rx);
  free(pl);
}

/* Closes every endpoint side by side -- a peer that said goodbye is
 * flushed (unless all_force), the others closed with FORCE, so that their
 * requests complete as cancelled -- cancels the fetches in flight, and
 * progresses the worker until the closes are done or ms passed.  UCX does
 * not allow destroying a worker whose endpoints still hold requests (it
 * asserts, and a process that exited with a collective in flight died of
 * SIGABRT: issue 42). */
static void close_endpoints(ucx_chan_t *ch, int all_force, int ms) {
  chorus__tp_t *tp = ch->base.tp;
  void **closing = calloc((size_t)tp->size, sizeof *closing);
  int nclosing = 0;
  for (int r = 0; ch->links && r < tp->size; r++) {
    ucx_link_t *l = &ch->links[r];
    if (!l->peer || !l->ep) continue;
    int force = all_force || !closing || l->peer->dead || !l->peer->bye_received;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                               .flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    ucs_status_ptr_t rq = ucp_ep_close_nbx(l->ep, &prm);
    l->ep = NULL;
    if (rq && UCS_PTR_IS_PTR(rq)) {
      if (closing) closing[nclosing++] = rq;
      else ucp_request_free(rq);
    }
  }
  for (pull_t *pl = ch->pulls; pl; pl = pl->next)
    if (pl->req && ucp_request_check_status(pl->req) == UCS_INPROGRESS)
      ucp_request_cancel(ch->worker, pl->req);
  int64_t until = chorus__now_ns() + (int64_t)ms * 1000000;
  for (;;) {
    int busy = 0;
    for (int i = 0; i < nclosing && !busy; i++)
      if (ucp_request_check_status(closing[i]) == UCS_INPROGRESS) busy = 1;
    if (!busy || chorus__now_ns() >= until) break;
    ucp_worker_progress(ch->worker);
  }
  for (int i = 0; i < nclosing; i++) {
    if (ucp_request_check_status(closing[i]) == UCS_INPROGRESS)
      ucp_request_cancel(ch->worker, closing[i]);
    ucp_request_free(closing[i]);
  }
  /* What the cancellations completed. */
  for (int i = 0; i < 16; i++) ucp_worker_progress(ch->worker);
  free(closing);
}

void chorus__ucx_destroy(chorus__chan_t *base) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  chorus__tp_t *tp = base->tp;
  if (ch->links) {
    for (int r = 0; r < tp->size; r++) {
      ucx_link_t *l = &ch->links[r];
      if (!l->peer) continue;
      l->closed = 1;
      while (l->held) {
        held_t *m = l->held;
        l->held = m->next;
        chorus__ucx_held_release(ch, m);
      }
      chorus__txq_free(&l->q);
    }
  }
  /* Flushed for a peer that said goodbye; the others are dead, stopped or
   * gone silent (tp_destroy waited for them): nothing to wait for.  Only
   * the flushing closes are waited for. */
  if (ch->worker) close_endpoints(ch, 0, 1000);
  /* Requests UCX finished are released while the worker lives; those it
   * never finished go with it (their callbacks may run as it goes, so the
   * structures outlive it). */
  for (sent_t *s = ch->completed; s; s = s->next) {
    if (s->req) ucp_request_free(s->req);
    s->req = NULL;
  }
  for (pull_t *pl = ch->pulled; pl; pl = pl->next) {
    if (pl->req) ucp_request_free(pl->req);
    pl->req = NULL;
  }
  if (ch->efd >= 0) chorus__tp_unwatch(tp, ch->efd);
  if (ch->worker) ucp_worker_destroy(ch->worker);
  if (ch->ctx) ucp_cleanup(ch->ctx);
  while (ch->completed) {
    sent_t *s = ch->completed;
    LIST_DEL(ch->completed, s);
    free_sent(s);
  }
  while (ch->inflight) {
    sent_t *s = ch->inflight;
    LIST_DEL(ch->inflight, s);
    free_sent(s);
  }
  while (ch->failed_sends) {
    sent_t *s = ch->failed_sends;
    ch->failed_sends = s->next;
    free_sent(s);
  }
  while (ch->pulled) {
    pull_t *pl = ch->pulled;
    LIST_DEL(ch->pulled, pl);
    free_pull(pl);
  }
  while (ch->pulls) {
    pull_t *pl = ch->pulls;
    LIST_DEL(ch->pulls, pl);
    free_pull(pl);
  }
  while (ch->failed_pulls) {
    pull_t *pl = ch->failed_pulls;
    ch->failed_pulls = pl->next;
    free_pull(pl);
  }
  if (ch->addrs)
    for (int r = 0; r < tp->size; r++) free(ch->addrs[r]);
  free(ch->addrs);
  free(ch->links);
  free(ch);
}

/* The process exits with the channel open (endpoint_progress.c's tp_on_exit, after
 * the progress thread stopped): the endpoints are closed with FORCE and the
 * worker and the context go now, which
 * stops UCX's own async thread.  Left running, that thread races UCX's
 * library destructors at exit (a lock destroyed while it holds it).  The
 * channel's structures stay for the process's end; nothing calls the
 * channel again. */
static void ucx_on_exit(chorus__chan_t *base) {
  ucx_chan_t *ch = (ucx_chan_t *)base;
  if (ch->efd >= 0) chorus__tp_unwatch(base->tp, ch->efd);
  ch->efd = -1;
  /* The endpoints first, and their requests with them (see
   * close_endpoints): a process leaving with a collective in flight. */
  if (ch->worker) close_endpoints(ch, 1, 500);
  if (ch->worker) ucp_worker_destroy(ch->worker);
  if (ch->ctx) ucp_cleanup(ch->ctx);
  ch->worker = NULL;
  ch->ctx = NULL;
  for (int r = 0; ch->links && r < base->tp->size; r++) {
    ch->links[r].ep = NULL;
    ch->links[r].closed = 1;
  }
}

const chorus__chan_ops_t chorus__ucx_ops = {
    .name = "ucx",
    .send = chorus__ucx_send,
    .rx_pause = chorus__ucx_rx_pause,
    .cancel = ucx_cancel,
    .pending = ucx_pending,
    .close = ucx_close,
    .link_desc = ucx_link_desc,
    .link_state = ucx_link_state,
    .poll = ucx_poll,
    .idle = ucx_idle,
    .destroy = chorus__ucx_destroy,
    .on_exit = ucx_on_exit,
};

#endif
