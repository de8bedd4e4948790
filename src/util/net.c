/*
 * net.c - see net.h.  Name resolution uses getaddrinfo (IPv4 and IPv6);
 * everything that waits goes through poll() with the remaining time of the
 * caller's deadline, so no call here can block past it.
 */

#include "net.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "env.h"

int chorus__net_split_addr(const char *s, char sep, char *host, size_t cap, int *port) {
  const char *at = s ? strrchr(s, sep) : NULL;
  if (!at || (size_t)(at - s) >= cap) return -1;
  memcpy(host, s, (size_t)(at - s));
  host[at - s] = '\0';
  long p;
  if (chorus__parse_long(at + 1, &p) < 0 || p <= 0 || p > 65535) return -1;
  *port = (int)p;
  return 0;
}

int chorus__net_set_nonblock(int fd, int on) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0) return -errno;
  fl = on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK);
  return fcntl(fd, F_SETFL, fl) < 0 ? -errno : 0;
}

int chorus__net_set_nodelay(int fd) {
  int one = 1;
  return setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) < 0 ? -errno : 0;
}

/* flags: getaddrinfo's (AI_PASSIVE to listen, AI_NUMERICHOST to never
 * look a name up). */
static int resolve(const char *host, int port, int flags, struct addrinfo **res) {
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  char svc[16];
  snprintf(svc, sizeof svc, "%d", port);
  int rc = getaddrinfo(host && *host ? host : NULL, svc, &hints, res);
  if (rc != 0) return rc == EAI_SYSTEM ? -errno : -EHOSTUNREACH;
  return 0;
}

int chorus__net_listen(const char *host, int port, int backlog, int *bound_port) {
  if (port < 0 || port > 65535) return -EINVAL;
  struct addrinfo *res = NULL;
  int rc = resolve(host, port, AI_PASSIVE, &res);
  if (rc < 0) return rc;
  int fd = -1;
  rc = -EADDRNOTAVAIL;
  /* Prefer IPv4 when listening on all interfaces: peers usually resolve
   * MASTER_ADDR to an IPv4 address. */
  for (int pass = 0; pass < 2 && fd < 0; pass++) {
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
      if ((pass == 0) != (ai->ai_family == AF_INET)) continue;
      fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) {
        rc = -errno;
        continue;
      }
      int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, backlog) == 0) break;
      rc = -errno;
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(res);
  if (fd < 0) return rc;
  if (bound_port) {
    char tmp[64];
    rc = chorus__net_local_addr(fd, tmp, sizeof tmp, bound_port);
    if (rc < 0) {
      close(fd);
      return rc;
    }
  }
  return fd;
}

static int wait_fd(int fd, short events, int64_t deadline) {
  for (;;) {
    struct pollfd p = {.fd = fd, .events = events};
    int ms = chorus__ms_left(deadline);
    if (ms == 0 && deadline != CHORUS__NO_DEADLINE) return -ETIMEDOUT;
    int rc = poll(&p, 1, ms > 1000 ? 1000 : ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (rc > 0) return 0;
  }
}

static int connect_once(const struct addrinfo *ai, const char *src, int64_t deadline) {
  int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                  ai->ai_protocol);
  if (fd < 0) return -errno;
  int rc = 0;
  if (src && *src) { /* leave from this address (any port) */
    struct addrinfo *sa = NULL;
    rc = resolve(src, 0, AI_NUMERICHOST | AI_PASSIVE, &sa);
    if (rc == 0 && (!sa || bind(fd, sa->ai_addr, sa->ai_addrlen) < 0)) rc = sa ? -errno : -EINVAL;
    if (sa) freeaddrinfo(sa);
    if (rc < 0) {
      close(fd);
      return rc;
    }
  }
  rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
  if (rc < 0 && errno != EINPROGRESS) {
    rc = -errno;
    close(fd);
    return rc;
  }
  if (rc < 0) {
    rc = wait_fd(fd, POLLOUT, deadline);
    if (rc == 0) {
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err ? -err : 0;
    }
    if (rc < 0) {
      close(fd);
      return rc;
    }
  }
  if ((rc = chorus__net_set_nonblock(fd, 0)) < 0 || (rc = chorus__net_set_nodelay(fd)) < 0) {
    close(fd);
    return rc;
  }
  return fd;
}

int chorus__net_connect(const char *host, int port, int64_t deadline, int retry_ms) {
  return chorus__net_connect_from(host, port, NULL, deadline, retry_ms);
}

int chorus__net_connect_from(const char *host, int port, const char *src, int64_t deadline,
                             int retry_ms) {
  if (port <= 0 || port > 65535) return -EINVAL;
  if (retry_ms <= 0) retry_ms = 50;
  for (;;) {
    struct addrinfo *res = NULL;
    int rc = resolve(host, port, 0, &res);
    if (rc == 0) {
      rc = -ECONNREFUSED;
      for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        rc = connect_once(ai, src, deadline);
        if (rc >= 0) break;
      }
      freeaddrinfo(res);
      if (rc >= 0) return rc;
    }
    /* Refused / unreachable / not resolvable yet: the peer may still be
     * starting.  Anything else is final. */
    if (rc != -ECONNREFUSED && rc != -EHOSTUNREACH && rc != -ENETUNREACH &&
        rc != -ETIMEDOUT && rc != -ECONNRESET && rc != -EAGAIN)
      return rc;
    int left = chorus__ms_left(deadline);
    if (left == 0) return rc;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(left < retry_ms ? left : retry_ms) * 1000000};
    nanosleep(&ts, NULL);
    if (chorus__ms_left(deadline) == 0) return rc;
  }
}

int chorus__net_connect_start(const char *host, int port) {
  if (!host || !*host || port <= 0 || port > 65535) return -EINVAL;
  struct addrinfo *res = NULL;
  if (resolve(host, port, AI_NUMERICHOST, &res) < 0 || !res) return -EINVAL;
  int fd = socket(res->ai_family, res->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                  res->ai_protocol);
  int rc = fd < 0 ? -errno : 0;
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) < 0 && errno != EINPROGRESS) {
    rc = -errno;
    close(fd);
  }
  freeaddrinfo(res);
  return rc < 0 ? rc : fd;
}

int chorus__net_accept(int listen_fd, int64_t deadline) {
  for (;;) {
    int rc = wait_fd(listen_fd, POLLIN, deadline);
    if (rc < 0) return rc;
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd >= 0) {
      chorus__net_set_nonblock(fd, 0);
      chorus__net_set_nodelay(fd);
      return fd;
    }
    if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
    return -errno;
  }
}

int chorus__net_write_full(int fd, const void *buf, size_t len, int64_t deadline) {
  const char *p = buf;
  while (len > 0) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int rc = wait_fd(fd, POLLOUT, deadline);
      if (rc < 0) return rc;
      continue;
    }
    return n < 0 ? -errno : -EIO;
  }
  return 0;
}

int chorus__net_read_full(int fd, void *buf, size_t len, int64_t deadline) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
      continue;
    }
    if (n == 0) return -ECONNRESET;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int rc = wait_fd(fd, POLLIN, deadline);
      if (rc < 0) return rc;
      continue;
    }
    return -errno;
  }
  return 0;
}

static int sockaddr_str(const struct sockaddr_storage *ss, char *host, size_t cap, int *port) {
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *in = (const void *)ss;
    if (!inet_ntop(AF_INET, &in->sin_addr, host, (socklen_t)cap)) return -errno;
    if (port) *port = ntohs(in->sin_port);
  } else if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *in6 = (const void *)ss;
    if (!inet_ntop(AF_INET6, &in6->sin6_addr, host, (socklen_t)cap)) return -errno;
    if (port) *port = ntohs(in6->sin6_port);
  } else {
    return -EAFNOSUPPORT;
  }
  return 0;
}

/* The numeric address of one getifaddrs entry: 0, or < 0 when it has no
 * IPv4/IPv6 address. */
static int if_addr_str(const struct ifaddrs *i, char *host, size_t cap) {
  if (!i->ifa_addr) return -EINVAL;
  return sockaddr_str((const struct sockaddr_storage *)(const void *)i->ifa_addr, host, cap, NULL);
}

int chorus__net_local_addr(int fd, char *host, size_t cap, int *port) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &len) < 0) return -errno;
  return sockaddr_str(&ss, host, cap, port);
}

int chorus__net_peer_addr(int fd, char *host, size_t cap, int *port) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  if (getpeername(fd, (struct sockaddr *)&ss, &len) < 0) return -errno;
  return sockaddr_str(&ss, host, cap, port);
}

int chorus__net_is_local(const char *host) {
  struct addrinfo *res = NULL;
  if (!host || !*host || resolve(host, 0, 0, &res) < 0) return 0;
  int local = 0;
  for (struct addrinfo *ai = res; ai && !local; ai = ai->ai_next) {
    /* Binding to an address succeeds exactly when it is one of this host's
     * (loopback included); port 0 touches no real port. */
    int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0) local = 1;
    close(fd);
  }
  freeaddrinfo(res);
  return local;
}

/* Whether getifaddrs entry i is up and has an address of the family pass
 * 0 (IPv4) or pass 1 (IPv6, not link-local) looks at: the two passes that
 * put IPv4 addresses first. */
static const struct in6_addr *if_in6(const struct ifaddrs *i) {
  return &((const struct sockaddr_in6 *)(const void *)i->ifa_addr)->sin6_addr;
}

static int if_in_pass(const struct ifaddrs *i, int pass) {
  if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) return 0;
  if (i->ifa_addr->sa_family != (pass == 0 ? AF_INET : AF_INET6)) return 0;
  return pass == 0 || !IN6_IS_ADDR_LINKLOCAL(if_in6(i));
}

int chorus__net_host_addrs(char *out, size_t cap) {
  struct ifaddrs *ifs = NULL;
  if (cap == 0) return -EINVAL;
  out[0] = '\0';
  if (getifaddrs(&ifs) < 0) return -errno;
  size_t len = 0;
  int count = 0;
  /* IPv4 first (what most clusters route), then global IPv6. */
  for (int pass = 0; pass < 2; pass++) {
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
      if (!if_in_pass(i, pass) || (i->ifa_flags & IFF_LOOPBACK)) continue;
      if (pass == 1 && IN6_IS_ADDR_LOOPBACK(if_in6(i))) continue;
      char host[INET6_ADDRSTRLEN];
      if (if_addr_str(i, host, sizeof host) < 0) continue;
      size_t hl = strlen(host);
      if (len + hl + 2 > cap) break; /* keep what fits */
      if (len) out[len++] = ',';
      memcpy(out + len, host, hl + 1);
      len += hl;
      count++;
    }
  }
  freeifaddrs(ifs);
  return count;
}

/* Whether interface name matches one entry of the list (prefix, or exact
 * after '='); entries are separated by commas. */
static int ifname_listed(const char *list, const char *name) {
  const char *p = list;
  while (*p) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    int exact = n > 0 && *p == '=';
    const char *w = exact ? p + 1 : p;
    size_t wn = exact ? n - 1 : n;
    if (wn > 0 && strncmp(name, w, wn) == 0 && (!exact || name[wn] == '\0')) return 1;
    if (!e) break;
    p = e + 1;
  }
  return 0;
}

int chorus__net_ifname_addr(const char *spec, char *out, size_t cap) {
  struct ifaddrs *ifs = NULL;
  if (!spec || cap == 0) return -EINVAL;
  out[0] = '\0';
  int avoid = *spec == '^';
  const char *list = avoid ? spec + 1 : spec;
  if (getifaddrs(&ifs) < 0) return -errno;
  int found = 0;
  for (int pass = 0; pass < 2 && !found; pass++) {
    for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
      if (!if_in_pass(i, pass)) continue;
      if (avoid ? (i->ifa_flags & IFF_LOOPBACK) || ifname_listed(list, i->ifa_name)
                : !ifname_listed(list, i->ifa_name))
        continue;
      found = if_addr_str(i, out, cap) == 0;
    }
  }
  if (!found) {
    /* What there is, so the message can say what to choose from. */
    size_t len = 0;
    out[0] = '\0';
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
      char host[INET6_ADDRSTRLEN];
      if (!(i->ifa_flags & IFF_UP) || if_addr_str(i, host, sizeof host) < 0) continue;
      int k = snprintf(out + len, cap - len, "%s%s %s", len ? ", " : "", i->ifa_name, host);
      if (k < 0 || (size_t)k >= cap - len) break;
      len += (size_t)k;
    }
  }
  freeifaddrs(ifs);
  return found;
}

int chorus__net_is_loopback(const char *host) {
  struct in_addr a4;
  struct in6_addr a6;
  if (inet_pton(AF_INET, host, &a4) == 1) return (ntohl(a4.s_addr) >> 24) == 127;
  if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  return 0;
}

int chorus__net_addr_ifname(const char *addr, char *out, size_t cap) {
  struct ifaddrs *ifs = NULL;
  int found = 0;
  snprintf(out, cap, "?");
  if (getifaddrs(&ifs) < 0) return 0;
  for (struct ifaddrs *i = ifs; i && !found; i = i->ifa_next) {
    char host[INET6_ADDRSTRLEN];
    if (if_addr_str(i, host, sizeof host) == 0 && strcmp(host, addr) == 0) {
      snprintf(out, cap, "%s", i->ifa_name);
      found = 1;
    }
  }
  freeifaddrs(ifs);
  return found;
}

/* Names that resolve to loopback on every host (RFC 6761's "localhost" and
 * its subdomains, and the spellings /etc/hosts files use), unlike a host's
 * own name that some distributions map to 127.0.1.1 locally only. */
static int loopback_name(const char *h) {
  size_t n = strlen(h);
  if (!strcasecmp(h, "localhost") || !strncasecmp(h, "localhost.", 10) ||
      !strcasecmp(h, "localhost6") || !strcasecmp(h, "ip6-localhost") ||
      !strcasecmp(h, "ip6-loopback"))
    return 1;
  return n > 10 && !strcasecmp(h + n - 10, ".localhost");
}

static int ai_loopback(const struct addrinfo *ai) {
  if (ai->ai_family == AF_INET)
    return (ntohl(((const struct sockaddr_in *)(const void *)ai->ai_addr)->sin_addr.s_addr) >>
            24) == 127;
  return ai->ai_family == AF_INET6 &&
         IN6_IS_ADDR_LOOPBACK(&((const struct sockaddr_in6 *)(const void *)ai->ai_addr)->sin6_addr);
}

static int ai_bindable(const struct addrinfo *ai) {
  int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  int ok = bind(fd, ai->ai_addr, ai->ai_addrlen) == 0;
  close(fd);
  return ok;
}

int chorus__net_bind_addr(const char *host, char *out, size_t cap) {
  if (cap == 0) return -EINVAL;
  out[0] = '\0';
  if (!host || !*host || !strcmp(host, "*")) return 0;
  struct addrinfo *res = NULL;
  if (resolve(host, 0, 0, &res) < 0) return 0;
  struct in_addr a4;
  struct in6_addr a6;
  int numeric = inet_pton(AF_INET, host, &a4) == 1 || inet_pton(AF_INET6, host, &a6) == 1;
  const struct addrinfo *pick = NULL, *lo = NULL;
  for (int pass = 0; pass < 2 && !pick; pass++) {
    for (const struct addrinfo *ai = res; ai && !pick; ai = ai->ai_next) {
      if ((pass == 0) != (ai->ai_family == AF_INET)) continue;
      if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
      if (ai_loopback(ai)) {
        if (!lo && (numeric || loopback_name(host))) lo = ai;
        continue;
      }
      /* The unspecified address binds too, and means every interface. */
      char tmp[INET6_ADDRSTRLEN];
      struct sockaddr_storage ss;
      memcpy(&ss, ai->ai_addr, ai->ai_addrlen < sizeof ss ? ai->ai_addrlen : sizeof ss);
      if (sockaddr_str(&ss, tmp, sizeof tmp, NULL) < 0 || !strcmp(tmp, "0.0.0.0") ||
          !strcmp(tmp, "::"))
        continue;
      if (ai_bindable(ai)) pick = ai;
    }
  }
  if (!pick) pick = lo;
  int rc = 0;
  if (pick) {
    struct sockaddr_storage ss;
    memcpy(&ss, pick->ai_addr, pick->ai_addrlen < sizeof ss ? pick->ai_addrlen : sizeof ss);
    rc = sockaddr_str(&ss, out, cap, NULL) == 0 ? 1 : 0;
    if (!rc) out[0] = '\0';
  }
  freeaddrinfo(res);
  return rc;
}

int chorus__net_names_loopback(const char *host) {
  return host && (chorus__net_is_loopback(host) || loopback_name(host));
}

/* One LISTEN socket of /proc/net/tcp{,6} on the port: its uid and inode. */
typedef struct {
  unsigned uid;
  unsigned long inode;
} listener_t;

static int find_listeners(int port, listener_t *out, int max) {
  static const char *const files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
  int n = 0;
  for (int f = 0; f < 2; f++) {
    FILE *fp = fopen(files[f], "re");
    if (!fp) continue;
    char line[512];
    if (!fgets(line, sizeof line, fp)) { /* the header */
      fclose(fp);
      continue;
    }
    while (n < max && fgets(line, sizeof line, fp)) {
      unsigned lport = 0, st = 0, uid = 0;
      unsigned long inode = 0;
      if (sscanf(line, " %*d: %*[0-9A-Fa-f]:%x %*[0-9A-Fa-f]:%*x %x %*s %*s %*s %u %*d %lu", &lport,
                 &st, &uid, &inode) != 4)
        continue;
      if (st != 0x0A || (int)lport != port) continue; /* 0A: LISTEN */
      out[n].uid = uid;
      out[n].inode = inode;
      n++;
    }
    fclose(fp);
  }
  return n;
}

/* The pid of a process that has socket inode open, or 0 when none we can
 * see does. */
static int inode_pid(unsigned long inode) {
  if (inode == 0) return 0;
  char want[64];
  snprintf(want, sizeof want, "socket:[%lu]", inode);
  DIR *proc = opendir("/proc");
  if (!proc) return 0;
  int found = 0;
  struct dirent *d;
  while (!found && (d = readdir(proc))) {
    char *end;
    long pid = strtol(d->d_name, &end, 10);
    if (*end || pid <= 0) continue;
    char path[300];
    snprintf(path, sizeof path, "/proc/%ld/fd", pid);
    DIR *fds = opendir(path);
    if (!fds) continue; /* another user's, or gone */
    struct dirent *e;
    while (!found && (e = readdir(fds))) {
      if (e->d_name[0] == '.') continue;
      char link[320], target[80];
      snprintf(link, sizeof link, "/proc/%ld/fd/%s", pid, e->d_name);
      ssize_t k = readlink(link, target, sizeof target - 1);
      if (k <= 0) continue;
      target[k] = '\0';
      if (!strcmp(target, want)) found = (int)pid;
    }
    closedir(fds);
  }
  closedir(proc);
  return found;
}

int chorus__net_port_owner(int port, char *out, size_t cap) {
  if (cap == 0) return -EINVAL;
  out[0] = '\0';
  listener_t l[8];
  int n = find_listeners(port, l, 8);
  if (n <= 0) return 0;
  char user[64] = "";
  struct passwd pw, *pwp = NULL;
  char pwbuf[1024];
  if (getpwuid_r(l[0].uid, &pw, pwbuf, sizeof pwbuf, &pwp) == 0 && pwp)
    snprintf(user, sizeof user, " (%.40s)", pwp->pw_name);
  int pid = inode_pid(l[0].inode);
  if (pid > 0) {
    char comm[64] = "?", path[64];
    snprintf(path, sizeof path, "/proc/%d/comm", pid);
    FILE *fp = fopen(path, "re");
    if (fp) {
      if (fgets(comm, sizeof comm, fp)) comm[strcspn(comm, "\n")] = '\0';
      fclose(fp);
    }
    snprintf(out, cap, "pid %d (%s) of uid %u%s", pid, comm, l[0].uid, user);
  } else {
    snprintf(out, cap, "a process of uid %u%s that we cannot see", l[0].uid, user);
  }
  return n;
}
