"""Two Chrome traces of training steps side by side (`loom profile --trace A.json` and
`pytorch_vit.py --profile B.json`): the self time per step of each operator on both sides, largest
differences first, and the total. Self time is computed the same way for both traces: on each
thread, events nest by time and an event's self time is its duration less its children's
(ranges such as loom::* or Python's user annotations are not operators and are not counted).

    python bench/compare_profiles.py A.json STEPS_A B.json STEPS_B [--top 20]
"""
import argparse
import collections
import json


def self_times(path):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    totals = collections.Counter()
    for spans in by_thread.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, own = [], {}
        for i, e in enumerate(spans):
            while stack and spans[stack[-1]]["ts"] + spans[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            own[i] = e["dur"]
            if stack:
                own[stack[-1]] -= e["dur"]
            stack.append(i)
        for i, e in enumerate(spans):
            totals[e["name"]] += own[i]
    return totals


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("steps_a", type=int)
    p.add_argument("b")
    p.add_argument("steps_b", type=int)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--names", default="A,B", help="column names, e.g. Loom,PyTorch")
    args = p.parse_args()
    name_a, name_b = args.names.split(",")
    a = {k: v / args.steps_a / 1e3 for k, v in self_times(args.a).items()}
    b = {k: v / args.steps_b / 1e3 for k, v in self_times(args.b).items()}
    names = sorted(set(a) | set(b), key=lambda k: -abs(a.get(k, 0) - b.get(k, 0)))
    print(f"{'operator (self ms per step)':<60} {name_a:>10} {name_b:>10} {'difference':>11}")
    for k in names[:args.top]:
        print(f"{k[:60]:<60} {a.get(k, 0):10.3f} {b.get(k, 0):10.3f} {a.get(k, 0) - b.get(k, 0):+11.3f}")
    print(f"{'all operators':<60} {sum(a.values()):10.3f} {sum(b.values()):10.3f} "
          f"{sum(a.values()) - sum(b.values()):+11.3f}")


if __name__ == "__main__":
    main()
