/*
 * cmp_weights - compares two raw float32 parameter dumps of chorus-train.
 *   cmp_weights A B TOL   exit 0 when max |a - b| <= TOL * (1 + max |a|)
 * Prints the largest difference either way, so a log shows how close the
 * runs were.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static float *load(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  float *p = malloc(len > 0 ? (size_t)len : 1);
  *n = (size_t)len / sizeof(float);
  if (!p || fread(p, sizeof(float), *n, f) != *n) {
    fclose(f);
    free(p);
    return NULL;
  }
  fclose(f);
  return p;
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: cmp_weights A B TOL\n");
    return 2;
  }
  size_t na, nb;
  float *a = load(argv[1], &na), *b = load(argv[2], &nb);
  if (!a || !b || na != nb || na == 0) {
    fprintf(stderr, "cmp_weights: cannot read both dumps, or their sizes differ (%zu, %zu)\n",
            a ? na : 0, b ? nb : 0);
    free(a);
    free(b);
    return 1;
  }
  double tol = atof(argv[3]), maxd = 0, maxa = 0;
  size_t at = 0, same = 0;
  for (size_t i = 0; i < na; i++) {
    double d = fabs((double)a[i] - b[i]);
    if (!(d <= maxd)) maxd = d, at = i; /* NaN counts as the largest */
    if (fabs(a[i]) > maxa) maxa = fabs(a[i]);
    same += a[i] == b[i];
  }
  int ok = maxd <= tol * (1.0 + maxa);
  printf("%s: %zu parameters, max |diff| %.3g at %zu (max |w| %.3g), %zu bit-identical; "
         "tolerance %.3g\n", ok ? "close" : "DIFFERENT", na, maxd, at, maxa, same,
         tol * (1.0 + maxa));
  free(a);
  free(b);
  return ok ? 0 : 1;
}
