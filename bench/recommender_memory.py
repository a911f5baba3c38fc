"""The memory estimate against the measured peak for the GPT-2 recommender (docs/recommender.md),
in its three modes (text vectors cached with GPT-2 frozen; per batch, frozen; per batch with GPT-2
training) at the debug and gpt2 sizes, on CPU under Loom's budget allocator: each run's
memory_summary line (predicted peak at the micro-batch, measured peak of the whole run,
evaluations included), as a Markdown table.

    python bench/recommender_memory.py [--loom build/bin/loom] [--steps 6]
"""
import argparse
import os
import re
import subprocess
import tempfile

MODES = [("cached, frozen", ["model.use_cache=true", "model.freeze_gpt2=true"]),
         ("per batch, frozen", ["model.use_cache=false", "model.freeze_gpt2=true"]),
         ("per batch, GPT-2 trains", ["model.use_cache=false", "model.freeze_gpt2=false"])]
SIZES = [("debug, 16", ["model.size=debug", "trainer.batch_size=16"]),
         ("gpt2 (50,257 tokens), 4", ["model.size=gpt2", "model.vocab_size=50257", "trainer.batch_size=4"])]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser()
    p.add_argument("--loom", default=os.path.join(here, "..", "build", "bin", "loom"))
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    config = os.path.join(here, "..", "configs", "gpt2_recommender_debug.ini")
    work = tempfile.mkdtemp(prefix="loom-recommender-memory-")
    print("| size, batch | " + " | ".join(name for name, _ in MODES) + " |")
    print("| --- |" + " --- |" * len(MODES))
    for size, size_sets in SIZES:
        cells = []
        for _, mode_sets in MODES:
            sets = ["trainer.device=cpu", f"trainer.work_dir={work}", f"trainer.max_steps={args.steps}",
                    f"trainer.eval_every={args.steps // 2}"] + size_sets + mode_sets
            command = [args.loom, "train", "-c", config]
            for s in sets:
                command += ["--set", s]
            out = subprocess.run(command, capture_output=True, text=True)
            m = re.search(r"predicted peak (\S+ \S+) at micro-batch \d+, measured (\S+ \S+) \(error ([-+0-9.]+ %)\)",
                          out.stdout + out.stderr)
            cells.append(f"{m.group(1)} / {m.group(2)} ({m.group(3)})" if m else "failed: " + (out.stderr or out.stdout)[-200:])
        print(f"| {size} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
