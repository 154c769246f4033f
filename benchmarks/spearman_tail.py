"""CPU seconds of the exact Spearman tail count against its cost estimate, and how far it reaches.

``tail_count`` counts the permutations of 1..n with S = sum (i - pi(i))^2 <= s; its budget
(``EXACT_TAIL_BUDGET``) is in cell updates, which it counts as it goes. This prints, per (n, s),
the cell updates, the CPU seconds (``time.process_time``, which a loaded machine moves less than
the wall clock) and their ratio, then, per n, the largest S counted within the budget (and the
table size, EXACT_TAIL_TABLE), its rho and its exact two-sided p (what docs/metrics.md quotes).

    python benchmarks/spearman_tail.py [--repeats 1] [--reach]
"""

from __future__ import annotations

import argparse
import math
import time

CASES = (
    (18, 76),
    (33, 60),
    (40, 53),
    (24, 100),
    (40, 150),
    (80, 120),
    (30, 200),
    (80, 200),
    (20, 300),
    (30, 300),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--reach", action="store_true", help="also find each n's largest S in budget")
    args = parser.parse_args()

    from isotui.core.correlation import EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE, tail_count

    print(f"{'n':>4} {'s':>5} {'cell updates':>14} {'CPU s':>8} {'ns/update':>10}")
    for n, s in CASES:
        best = math.inf
        spent: list[int] = []
        for _ in range(args.repeats):
            spent.clear()
            start = time.process_time()
            tail_count(n, s, spent=spent)  # no budget: every case runs to the end
            best = min(best, time.process_time() - start)
        print(f"{n:>4} {s:>5} {spent[0]:>14,} {best:>8.3f} {1e9 * best / spent[0]:>10.1f}")
    if not args.reach:
        return
    print(f"\nbudget {EXACT_TAIL_BUDGET:,} cell updates, tables of {EXACT_TAIL_TABLE:,} cells")
    print(f"{'n':>4} {'largest s':>9} {'rho':>7} {'exact p':>9} {'CPU s':>6}")
    for n in (15, 16, 18, 20, 24, 30, 40, 50, 60, 80, 100):
        lo, hi = 0, n * (n * n - 1) // 6  # the largest s counted within budget, by bisection
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if tail_count(n, mid, EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE) is None:
                hi = mid
            else:
                lo = mid
        start = time.process_time()
        count = tail_count(n, lo, EXACT_TAIL_BUDGET, EXACT_TAIL_TABLE)
        took = time.process_time() - start
        assert count is not None
        p = min(1.0, math.exp(math.log(2 * count) - math.lgamma(n + 1)))
        rho = 1 - 6 * lo / (n**3 - n)
        print(f"{n:>4} {lo:>9} {rho:>7.4f} {p:>9.2g} {took:>6.2f}")


if __name__ == "__main__":
    main()
