"""The benchmark suite, as ``kareus bench``: kareus against Perseus and the baseline on the
method's workloads, planned offline on simulated GPUs; writes benchmarks/results/suite.json
and a PNG per workload (see kareus/offline/suite.py).

    python benchmarks/suite.py            # the whole matrix
    python benchmarks/suite.py --quick    # one small workload
"""

import sys

from kareus.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
