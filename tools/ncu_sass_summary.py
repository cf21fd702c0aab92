"""Summarizes a kernel's SASS profile from Nsight Compute: instructions
executed and warp stall samples by opcode, the stall reasons, and the
instructions with the most stall samples.

On the GPU machine:
    ncu --clock-control none --kernel-name regex:AdamWBlock8 \\
        --launch-skip 4 --launch-count 1 --set full -o rep \\
        .gpu/cuda_step_bench --params=2e8 --modes=assume_finite \\
        --only=bf16_rem_block8m --steps=8
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/ncu_sass_summary.py sass.csv [--per N]

--per N divides instruction counts by N (e.g. the number of 256-element
blocks, 2e8 / 256) to give counts per unit of work.
"""
import argparse
import collections
import csv


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--per", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head = rows[at]
    data = [r for r in rows[at + 1:] if len(r) == len(head)]
    source = head.index("Source")
    executed = head.index("Instructions Executed")
    stalls = head.index("Warp Stall Sampling (All Samples)")
    total = sum(number(r[executed]) for r in data)
    samples = sum(number(r[stalls]) for r in data)
    print("instructions executed: %.0f (%.1f per unit), stall samples %.0f"
          % (total, total / args.per, samples))
    by_op = collections.Counter()
    stall_by_op = collections.Counter()
    for r in data:
        words = r[source].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        op = op.split(".")[0]
        by_op[op] += number(r[executed])
        stall_by_op[op] += number(r[stalls])
    print("%-10s %12s %7s %7s" % ("opcode", "per unit", "share", "stalls"))
    for op, n in by_op.most_common(40):
        print("%-10s %12.1f %6.1f%% %6.1f%%" % (
            op, n / args.per, 100 * n / max(total, 1),
            100 * stall_by_op[op] / max(samples, 1)))
    print("stall reasons (share of samples):")
    for i, name in enumerate(head):
        if name.startswith("stall_") and "Not Issued" not in name:
            n = sum(number(r[i]) for r in data)
            if n:
                print("  %-24s %6.1f%%" % (name, 100 * n / max(samples, 1)))
    print("instructions with the most stall samples:")
    for r in sorted(data, key=lambda r: -number(r[stalls]))[:args.top]:
        print("  %7.0f %10.2f  %s" % (number(r[stalls]),
                                      number(r[executed]) / args.per,
                                      r[source].strip()[:80]))


if __name__ == "__main__":
    main()
