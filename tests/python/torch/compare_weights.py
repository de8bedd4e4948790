"""compare_weights.py A B [rtol atol] [bf16_atol]: every tensor of every
configuration in the two torch.save'd dicts (ddp_equivalence.py's or
fsdp.py's) agree within tolerance.  Prints the largest difference per
configuration; exit 1 on a difference beyond the tolerance."""
import sys

import torch

a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
rtol = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-5
atol = float(sys.argv[4]) if len(sys.argv) > 4 else 1e-5
bf16_atol = float(sys.argv[5]) if len(sys.argv) > 5 else 2e-3
bad = 0
if sorted(a) != sorted(b):
    print("FAIL: configurations differ: %s vs %s" % (sorted(a), sorted(b)))
    sys.exit(1)
# BatchNorm divides by the batch's standard deviation, which magnifies the
# rounding of a different summation order (Gloo and chorus add the ranks'
# gradients in different orders): 1.4e-5 apart after 20 steps at 4 ranks on
# one host's CPU, under 1e-5 on another's.  Still far below what a wrong
# reduction (a missing rank, AVG counted twice) moves a weight.
BN_ATOL = max(atol, 1e-4)
for config in sorted(a):
    worst = 0.0
    tol = bf16_atol if "bf16" in config else BN_ATOL if config == "bn" else atol
    for k, va in a[config].items():
        vb = b[config][k]
        if va.shape != vb.shape:
            print("FAIL %s %s: shapes %s vs %s" % (config, k, tuple(va.shape), tuple(vb.shape)))
            bad += 1
            continue
        d = (va.double() - vb.double()).abs().max().item() if va.numel() else 0.0
        worst = max(worst, d)
        if not torch.allclose(va.double(), vb.double(), rtol=rtol, atol=tol):
            print("FAIL %s %s: max difference %.3g (rtol %g atol %g)" % (config, k, d, rtol, tol))
            bad += 1
    print("%-10s max |difference| %.3g" % (config, worst))
sys.exit(1 if bad else 0)
