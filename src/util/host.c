/*
 * host.c - this process's host identity (host.h).
 */
#include "util/host.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

void chorus__host_identity(char *buf, size_t cap) {
  char host[256] = "?", boot[64] = "", net[64] = "";
  if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "?");
  host[sizeof host - 1] = '\0';
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    if (!fgets(boot, sizeof boot, f)) boot[0] = '\0';
    fclose(f);
  }
  boot[strcspn(boot, "\n")] = '\0';
  ssize_t n = readlink("/proc/self/ns/net", net, sizeof net - 1);
  net[n > 0 ? n : 0] = '\0';
  snprintf(buf, cap, "%s %s %s", host, boot, net);
}

void chorus__host_tag(char tag[9]) {
  char ident[400];
  chorus__host_identity(ident, sizeof ident);
  uint32_t h = 2166136261u; /* FNV-1a */
  for (const char *p = ident; *p; p++) {
    h ^= (uint8_t)*p;
    h *= 16777619u;
  }
  snprintf(tag, 9, "%08x", (unsigned)h);
}
