/*
 * net.h - TCP socket helpers with deadlines, shared by the store and the TCP
 * transport.  Every function returns >= 0 on success or a negative errno
 * (-ETIMEDOUT when the deadline passed, -ECONNRESET when the peer closed the
 * connection before all bytes arrived).  Sockets are created close-on-exec;
 * writes use MSG_NOSIGNAL so a closed peer never raises SIGPIPE.
 */
#ifndef CHORUS_UTIL_NET_H
#define CHORUS_UTIL_NET_H

#include <stddef.h>
#include <stdint.h>

/* Listens on host:port (host NULL or "" -> all interfaces; port 0 -> any free
 * port).  Returns the fd; *bound_port receives the actual port. */
int chorus__net_listen(const char *host, int port, int backlog, int *bound_port);

/* Connects to host:port, retrying refused/unreachable attempts every retry_ms
 * until deadline.  Returns a blocking fd with TCP_NODELAY set. */
int chorus__net_connect(const char *host, int port, int64_t deadline, int retry_ms);
/* The same, leaving from the numeric address src (NULL: the kernel's choice). */
int chorus__net_connect_from(const char *host, int port, const char *src, int64_t deadline,
                             int retry_ms);

/* Starts connecting to the numeric address host:port without waiting:
 * returns a non-blocking fd whose connection may still be in progress
 * (wait for it to become writable, then read SO_ERROR), or a negative
 * errno when it failed at once.  No name lookup: it never blocks. */
int chorus__net_connect_start(const char *host, int port);

/* Accepts one connection, waiting until deadline.  Returns the fd. */
int chorus__net_accept(int listen_fd, int64_t deadline);

int chorus__net_set_nonblock(int fd, int on);
int chorus__net_set_nodelay(int fd);

/* Writes/reads exactly len bytes (handles partial transfers, EINTR and
 * EAGAIN through poll) unless the deadline passes or the peer goes away. */
int chorus__net_write_full(int fd, const void *buf, size_t len, int64_t deadline);
int chorus__net_read_full(int fd, void *buf, size_t len, int64_t deadline);

/* Numeric address of the local / remote end ("127.0.0.1"), port separately. */
int chorus__net_local_addr(int fd, char *host, size_t cap, int *port);
int chorus__net_peer_addr(int fd, char *host, size_t cap, int *port);

/* 1 when host resolves to an address of this machine (loopback included),
 * so every process that reaches it through that name runs here. */
int chorus__net_is_local(const char *host);

/* This host's addresses a peer on another host might reach it by: every
 * non-loopback IPv4 address of an interface that is up, then global IPv6
 * ones, numeric, comma-separated into out (what fits).  Returns how many,
 * or -errno. */
int chorus__net_host_addrs(char *out, size_t cap);

/* The address to listen on for peers chosen by an interface list in the
 * style of CHORUS_SOCKET_IFNAME: comma-separated interface names, each a
 * prefix ("eth" matches eth0, eth1) or, after '=', an exact name; a list
 * that starts with '^' names interfaces to avoid instead (loopback is then
 * avoided too).  Among the interfaces that are up and match, the first
 * IPv4 address wins, else the first non-link-local IPv6 one.  Returns 1
 * with it in out, 0 when no interface matches (out then lists the
 * interfaces that are up, "name addr" comma-separated, for the message),
 * or -errno. */
int chorus__net_ifname_addr(const char *spec, char *out, size_t cap);

/* The name of the interface that has numeric address addr, into out ("?"
 * when none does).  Returns 1 when found, else 0. */
int chorus__net_addr_ifname(const char *addr, char *out, size_t cap);

/* Splits "host<sep>port" at the last sep ("host port" as ranks publish it,
 * "host:port" as peers are named; the host may be an IPv6 address).
 * Returns 0, or -1 when s is NULL, the host does not fit cap or the port
 * is not in 1..65535. */
int chorus__net_split_addr(const char *s, char sep, char *host, size_t cap, int *port);

/* 1 when host is a numeric loopback address (127.0.0.0/8, ::1). */
int chorus__net_is_loopback(const char *host);

/* The address to listen on for a service that peers reach at host (the
 * store behind MASTER_ADDR or a rendezvous endpoint), so that it listens
 * no wider than they need: host's first address that is one of this
 * machine's and not loopback (IPv4 first); else its loopback address when
 * host is a numeric loopback address or a localhost name (then every peer
 * runs here).  Returns 1 with the numeric address in out, or 0 (out "")
 * for every interface: host empty, unspecified (0.0.0.0, ::), not
 * resolvable, not this machine's, or a name that resolves to loopback only
 * here (the host's own name mapped to 127.0.1.1 by /etc/hosts: other
 * hosts may resolve it to an address of this one). */
int chorus__net_bind_addr(const char *host, char *out, size_t cap);

/* 1 when host names loopback wherever it is resolved: a numeric loopback
 * address or a localhost name. */
int chorus__net_names_loopback(const char *host);

/* Who listens on TCP port (any local address, this network namespace),
 * from /proc/net/tcp{,6} and /proc/<pid>/fd: "pid P (comm) of uid U
 * (name)", or "a process of uid U (name) that we cannot see" when no
 * process we may look into holds the socket (the uid is always visible).
 * Returns how many listening sockets the port has (0: none, out ""). */
int chorus__net_port_owner(int port, char *out, size_t cap);

#endif
