/*
 * secret.h - where a process finds its job secret, and the per-user
 * runtime directory that keeps secret files.
 *
 * Order (docs/security.md): a secret passed in the API (chorus_config_t's
 * job_secret, the store functions' secret argument), CHORUS_JOB_SECRET,
 * the file named by CHORUS_JOB_SECRET_FILE.  With none of them a world on
 * one host agrees on a fresh secret through a file in the runtime directory
 * (core/comm.c); anything else needs CHORUS_INSECURE=1.
 */
#ifndef CHORUS_UTIL_SECRET_H
#define CHORUS_UTIL_SECRET_H

#include <stddef.h>

#include "crypto.h"

#define CHORUS__SECRET_MAX 1024

/* The secret configured for this process (CHORUS_JOB_SECRET, else the
 * file CHORUS_JOB_SECRET_FILE names, read now).  Returns 1 and fills buf,
 * 0 when neither is set, -1 with the reason in why when the file is
 * unusable. */
int chorus__secret_configured(char *buf, size_t cap, char *why, size_t why_cap);

/* Where chorus__secret_configured found its secret, for a log line (the
 * variable's name and, for a file, its path; never the secret). */
void chorus__secret_source(char *buf, size_t cap);

/* Reads the first line of path into buf.  The file must be a regular file
 * owned by this user with no permission for group or others, and not
 * empty.  Returns 0 or a negative errno with the reason in why. */
int chorus__secret_read_file(const char *path, char *buf, size_t cap, char *why, size_t why_cap);

/* Writes secret to path atomically (a temporary file, mode 0600, renamed
 * over path).  Returns 0 or a negative errno. */
int chorus__secret_write_file(const char *path, const char *secret);

/* The job key for the public store functions: secret when not NULL, else
 * the configured one, else the insecure key when CHORUS_INSECURE=1 (with a
 * warning).  Returns 0, or -1 with the reason in why. */
int chorus__key_for_api(const char *secret, chorus__key_t *key, char *why, size_t why_cap);

/* The per-user directory for secret files: $XDG_RUNTIME_DIR/chorus when
 * that is set and ours, else $TMPDIR/chorus-<uid> (/tmp when TMPDIR is
 * unset), else -- when another user made or linked that one first --
 * $HOME/.cache/chorus-run (with a warning naming both); created 0700 and
 * checked (owner, no group/other access, not a symlink).  Returns 0 or a
 * negative errno with the reason in why. */
int chorus__runtime_dir(char *buf, size_t cap, char *why, size_t why_cap);

/* 64 random hex digits (256 bits) into buf (cap >= 65).  0 or -errno. */
int chorus__secret_generate(char *buf, size_t cap);

#endif
