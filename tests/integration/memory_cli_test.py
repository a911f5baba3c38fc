"""The memory tools from the command line, on CPU under --device-memory-limit: `memory
estimate` and `memory suggest`, a run that re-plans after running out of memory (and says so),
`doctor`, and `bench`."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from common import loom, workdir

exe, source = sys.argv[1], sys.argv[2]
RUN = ["--set", "model.flavour=standard", "--set", "model.num_layers=2", "--set", "model.d_model=32",
       "--set", "model.num_heads=2", "--set", "model.patch_size=4", "--set", "model.stem_channels=8",
       "--set", "data.name=synthetic", "--set", "data.image_size=28", "--set", "data.train_size=1024",
       "--set", "data.test_size=64", "--set", "trainer.device=cpu", "--set", "precision.name=fp32"]


def expect(cond, what, result=None):
    if not cond:
        detail = f"\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}" if result is not None else ""
        raise SystemExit(f"FAIL: {what}{detail}")


def total_bytes(out):
    m = re.search(r"total\s+([\d.]+) (MiB|KiB|GiB)", out)
    scale = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(2)]
    return float(m.group(1)) * scale


r = loom(exe, "memory", "estimate", *RUN, "--batch", "64")
for part in ("parameters", "gradients", "optimizer states", "activations", "workspace", "total"):
    expect(part in r.stdout, f"estimate shows {part}", r)
at64 = total_bytes(r.stdout)
expect("note:" not in r.stdout, "a plan the data can train has no note", r)
# A micro-batch larger than the data's training split: the figures, and a note that loom train
# refuses that plan with this data (1024 samples less the validation share).
r = loom(exe, "memory", "estimate", *RUN, "--batch", "2048")
expect("samples, too few for a micro-batch of 2048 on each of 1 device(s): loom train refuses this plan with it"
       in r.stdout and "total" in r.stdout, "estimate notes a batch the data cannot fill", r)
r4 = loom(exe, "memory", "estimate", *RUN, "--batch", "64", "--devices", "4")
expect("4 devices, each" in r4.stdout and "micro-batch 16" in r4.stdout, "estimate per device for 4 devices", r4)
# a plan `loom train` would refuse is refused here too, with one that splits evenly
r3 = loom(exe, "memory", "estimate", *RUN, "--batch", "64", "--devices", "3", check=False)
expect(r3.returncode == 1 and "is not divisible by gradient_accumulation_steps 1 x --devices 3" in r3.stderr
       and "--batch 63" in r3.stderr and "micro-batch" not in r3.stdout, "64 on 3 devices is refused", r3)
# The devices the configuration spreads the batch over (data_parallel on cpu, cpu): the estimate
# was "on 1 device(s)" of a run that plans 32 x 1 x 2; a --devices against them is said.
dp = ["--set", "parallel.name=data_parallel", "--set", "parallel.devices=cpu,cpu"]
r = loom(exe, "memory", "estimate", *RUN, *dp, "--batch", "64")
expect("batch 64 on 2 device(s): micro-batch 32 x accumulation 1 per device" in r.stdout, "estimate for data_parallel's devices", r)
r = loom(exe, "memory", "estimate", *RUN, *dp, "--batch", "64", "--devices", "4")
expect("--devices 4, where the configuration spreads the batch over 2 devices (parallel.name = data_parallel): the "
       "figures are for 4" in r.stderr, "estimate says --devices against the configuration", r)
# Replicas on cpu:0 and cpu:1 share the host's memory as on cpu, cpu (they were planned as two
# memories: 453 KiB against 703 KiB, and measured at 719 KiB).
both = total_bytes(loom(exe, "memory", "estimate", *RUN, *dp, "--batch", "64").stdout)
spelled = total_bytes(loom(exe, "memory", "estimate", *RUN, "--set", "parallel.name=data_parallel", "--set",
                           "parallel.devices=cpu:0,cpu:1", "--batch", "64").stdout)
expect(abs(spelled - both) < 0.1 * both, f"cpu:0,cpu:1 is estimated as cpu,cpu ({spelled:.0f} against {both:.0f} bytes)")
# A ddp configuration is estimated per process, over --devices of them (it was refused: "ddp runs
# one process per device, started by a launcher").
r = loom(exe, "memory", "estimate", *RUN, "--set", "parallel.name=ddp", "--batch", "64", "--devices", "4")
expect("batch 64 on 4 device(s): micro-batch 16" in r.stdout and "parallel = ddp: each process's device" in r.stderr,
       "estimate of a ddp configuration", r)
r = loom(exe, "memory", "estimate", *RUN, "--target", "8GiB", check=False)
expect(r.returncode == 1 and "--target is for loom memory suggest" in r.stderr, "estimate refuses --target", r)
# A target of a few bytes is refused before the probes, as --device-memory-limit's is ("nothing fits" came after them).
for given, hint in (("8", "e.g. --target 8GiB"), ("1B", "give at least 4KiB")):
    r = loom(exe, "memory", "suggest", *RUN, "--target", given, check=False)
    expect(r.returncode == 1 and f"--target {given} is " in r.stderr and "no device's size" in r.stderr and hint in r.stderr
           and "probe" not in r.stdout, f"suggest refuses --target {given}", r)
at32 = total_bytes(loom(exe, "memory", "estimate", *RUN, "--batch", "32").stdout)
budget = int((at64 + at32) / 2)
# Under a cap the figures pass, and with a policy that chooses the micro-batch: both said.
r = loom(exe, "memory", "estimate", *RUN, "--batch", "64", "--device-memory-limit", str(budget),
         "--set", "memory.policies=auto_batch")
expect("note: that is above the " in r.stdout and f"loom memory suggest --target {budget} (bytes) says which fits" in r.stdout
       and "note: memory.policies = auto_batch chooses the micro-batch when loom train starts" in r.stdout,
       "estimate over the cap, with auto_batch", r)

r = loom(exe, "memory", "suggest", *RUN, "--target", str(budget))
m = re.search(r"per device: (\d+)", r.stdout)
expect(m and 32 <= int(m.group(1)) < 64, f"suggest for {budget} bytes lies between 32 and 64", r)
# The answer keeps 2.5 % below the batch where the estimate meets the target (that exact fit ran
# out of memory by 512 bytes under a 2 MiB cap).
h = re.search(r"\((\d+) is [0-9.]+ % below (\d+), where the estimate meets the target exactly", r.stdout)
expect(m and h and int(h.group(1)) == int(m.group(1)) and -1e-6 <= int(h.group(2)) * 0.975 - int(h.group(1)) < 1 + 1e-6,
       "suggest answers 2.5 % below the exact fit, and says so", r)

# A global batch kept (--batch): the plan of it within the micro-batch that fits (it was ignored).
r = loom(exe, "memory", "suggest", *RUN, "--target", str(budget), "--batch", "256")
p = re.search(r"--batch 256: micro-batch (\d+) x accumulation (\d+) = 256 \(the largest micro-batch up to (\d+) that "
              r"divides 256\); train with --batch-size 256 --gradient-accumulation-steps (\d+)", r.stdout)
expect(m and p and int(p.group(1)) == 32 and int(p.group(2)) == 8 == int(p.group(4)) and int(p.group(3)) == int(m.group(1)),
       "suggest --batch 256 plans micro-batch 32 x accumulation 8 within the micro-batch that fits", r)
# Its first line named a global batch of that micro-batch alone, as if a second answer.
expect(re.search(r"per device: \d+ \(the largest that fits; --batch 256 is split within it below\)\n", r.stdout)
       and "global batch" not in r.stdout, "suggest --batch 256 names one global batch, the one given", r)
r = loom(exe, "memory", "suggest", *RUN, "--target", "64GiB", "--batch", "64")
expect("--batch 64: micro-batch 64 x accumulation 1 = 64 (the whole batch fits: no accumulation needed)" in r.stdout,
       "suggest --batch 64 with room to spare", r)
r = loom(exe, "memory", "suggest", *RUN, "--target", str(budget), "--batch", "101")  # (a prime: micro-batch 1, said)
expect(m and f"note: within micro-batch {m.group(1)}, 101 splits evenly only into micro-batches of 1; a batch that is a "
       f"multiple of {m.group(1)}" in r.stdout, "suggest --batch 101 says the split into ones", r)

# Capped by what the run trains on: the split less what data.validation_fraction (0.1) holds out.
r = loom(exe, "memory", "suggest", *RUN, "--target", "64GiB")
expect("per device: 922 " in r.stdout and "the run trains on 922 samples" in r.stdout,
       "suggest caps the micro-batch at the 922 of 1024 samples a run trains on", r)
# With accumulation the global batch is micro-batch x accumulation, capped by the samples too
# (it said "without accumulation", and capped the micro-batch alone).
r = loom(exe, "memory", "suggest", *RUN, "--target", "64GiB", "--set", "trainer.gradient_accumulation_steps=2")
expect("per device: 461 (global batch 922 on 1 device(s) x accumulation 2" in r.stdout,
       "suggest with accumulation 2 caps the global batch at the 922 samples", r)
# Under a cap the probes may run small; a target above the cap cannot be measured: both said
# (an answer of 9 under a 200 KiB cap for a 300 KiB target then ran out of memory).
debug = os.path.join(source, "configs", "debug.ini")
r = loom(exe, "memory", "suggest", "-c", debug, "--target", "300KiB", "--set", "memory.device_memory_limit=200KiB")
expect("--target 300.0 KiB is above the cap this command runs under, 200.0 KiB" in r.stderr
       and "the probes ran at micro-batch 1 and 2, not 16: larger ones ran out of memory under the cap" in r.stderr,
       "suggest says a target above the cap and probes the cap held small", r)
# A run's own keys are not an estimate's: a --resume-from that names nothing stopped it.
r = loom(exe, "memory", "estimate", *RUN, "--resume-from", "/nonexistent", "--work-dir", "/dev/full")
expect("loom memory does not use trainer.resume_from = '/nonexistent' (--resume-from): an estimate writes no run"
       in r.stderr and "loom memory does not use trainer.work_dir = '/dev/full'" in r.stderr and "total" in r.stdout,
       "estimate says the run's keys it does not use", r)
# A stage-2 file's init_from, not trained yet, is no part of an estimate either (cleared in silence).
stage2 = os.path.join(workdir(), "stage2.ini")
with open(stage2, "w") as f:
    f.write("[trainer]\ninit_from = runs/stage1/checkpoints/best_accuracy.safetensors\n")
r = loom(exe, "memory", "estimate", "-c", stage2, *RUN)
expect("total" in r.stdout and "init_from" not in r.stderr, "estimate of a file with an init_from not there yet", r)
r = loom(exe, "memory", "estimate", *RUN, "--batch", "64", "--batch-size", "32")
expect("the global batch is given twice: --batch 64 and trainer.batch_size = 32 (--batch-size); --batch is used" in r.stderr,
       "estimate says a batch given twice", r)

work = workdir()
try:
    # The suggestion trains under the cap it was made for, past the steps that fill the data
    # loader's ring of batch buffers, and through an evaluation (it used to run out of memory at
    # step 2: the probes had not measured the loader's batches).
    suggested = int(m.group(1))
    r = loom(exe, "train", *RUN, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=suggested",
             "--batch-size", str(suggested), "--set", "trainer.max_steps=12", "--set", "trainer.eval_every=6",
             "--device-memory-limit", str(budget), check=False)
    expect(r.returncode == 0, f"the suggested micro-batch {suggested} trains under {budget} bytes", r)

    r = loom(exe, "train", *RUN, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=oom",
             "--batch-size", "64", "--set", "trainer.max_steps=4", "--device-memory-limit", str(budget),
             "--set", "memory.policies=oom_recovery")
    expect("plan: 64 = 64 x 1 x 1 -> 32 x 2 x 1 after running out of memory at step 1" in r.stderr,
           "the log shows the re-plan", r)
    expect("1 out-of-memory recoveries" in r.stderr, "the summary counts the recovery", r)

    r = loom(exe, "train", *RUN, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=fails",
             "--batch-size", "64", "--set", "trainer.max_steps=4", "--device-memory-limit", str(budget), check=False)
    expect(r.returncode == 1 and "What would help, in order:" in r.stderr, "without oom_recovery: one clear error", r)
    # A global batch of few divisors (97, a prime) under a tier: the warning names what the tier allows.
    r = loom(exe, "train", *RUN, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=tier97",
             "--batch-size", "97", "--set", "trainer.max_steps=1", "--device-memory-limit", "12GiB",
             "--set", "memory.policies=vram_tiers")
    expect("trainer.batch_size 97 splits evenly only into micro-batches of 1 (1 x 97 per step) where its memory tier "
           "allows 64: each step runs as 97 small ones. A batch that is a multiple of 64 (64 or 128) keeps micro-batch 64"
           in r.stderr, "vram_tiers says an uneven split in words", r)

    # The recommender's evaluation scores the catalogue in chunks of a fixed size: its memory grows,
    # then levels off, no line through two probes. suggest measured nothing for it and refused
    # 30 MiB ("an evaluation of one sample peaks at 34.8 MiB") or, from other probes, answered 369,
    # whose evaluation ran out of memory under that cap; estimate put batch 64's at +80 %.
    recommender = os.path.join(source, "configs", "gpt2_recommender_debug.ini")
    answers = set()
    for batch in ([], ["--batch", "2048"]):
        r = loom(exe, "memory", "suggest", "-c", recommender, "--target", "30MiB", *batch)
        m = re.search(r"micro-batch for 30.0 MiB per device: (\d+)", r.stdout)
        expect(m is not None, f"suggest 30 MiB for the recommender {batch}", r)
        answers.add(int(m.group(1)))
    expect(len(answers) == 1, f"where suggest probes does not change its answer: {answers}")
    fits = answers.pop()
    r = loom(exe, "train", "-c", recommender, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=rec_fits",
             "--batch-size", str(fits), "--set", "trainer.max_steps=2", "--set", "trainer.eval_every=2",
             "--device-memory-limit", "30MiB", check=False)
    expect(r.returncode == 0 and "validation step 2:" in r.stderr, f"the recommender's suggested batch {fits} trains and evaluates under 30 MiB", r)
    r = loom(exe, "train", "-c", recommender, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=rec64",
             "--batch-size", "64", "--set", "trainer.max_steps=2", "--set", "trainer.eval_every=2")
    m = re.search(r"memory estimate: predicted peak .* measured .* \(error ([-+][\d.]+) %\)", r.stderr)
    expect(m is not None and abs(float(m.group(1))) < 5, "the recommender's estimate at batch 64 within 5 %", r)

    r = loom(exe, "doctor")
    expect("CPU" in r.stdout and "Plugins" in r.stdout and "LibTorch" in r.stdout, "doctor reports", r)
    # where the plugin scans and auto_batch's answers are kept, and a cache that cannot be one
    expect(re.search(r"\n  cache +\S", r.stdout), "doctor names the cache folder", r)
    r = loom(exe, "doctor", env=dict(os.environ, LOOM_CACHE="/dev/full"))
    expect("cache                 /dev/full: a character device, not a folder; point LOOM_CACHE at a folder" in r.stdout,
           "doctor says a cache that is no folder", r)
    # a CUDA LibTorch: doctor says what compiles Loom's own kernels (the wheel's NVRTC), or why nothing does
    if "CUDA none)" not in r.stdout:
        expect(re.search(r"Loom's kernels +(compiled at first use by NVRTC, \S*libnvrtc\.so\S*|unavailable: .+)\n",
                         r.stdout) is not None, "doctor names the kernels' compiler", r)

    a, b = os.path.join(work, "a.ini"), os.path.join(work, "b.ini")
    with open(a, "w") as f:
        f.write("[trainer]\nbatch_size = 32\n")
    with open(b, "w") as f:
        f.write("[trainer]\nbatch_size = 64\ngradient_accumulation_steps = 2\n")
    r = loom(exe, "bench", "configs", a, b, "--steps", "4", *RUN)
    rows = [l for l in r.stdout.splitlines() if l.startswith(("a.ini", "b.ini"))]
    expect(len(rows) == 2, "bench prints a row per configuration", r)
    expect(rows[1].split()[1:4] == ["32", "2", "64"], "bench shows micro-batch, accumulation, global batch", r)
    expect(rows[0].split()[-1] == "1.00x" and re.fullmatch(r"\d+\.\d\dx", rows[1].split()[-1]) is not None,
           "bench gives each configuration's ratio to the first", r)
    expect("what they differ in" not in r.stderr, "bench: --set of what the configurations share is no warning", r)
    # A batch given over both: they ran the same, each under its own name (said, in one line).
    r = loom(exe, "bench", "configs", a, b, "--steps", "2", *RUN, "--set", "trainer.batch_size=16")
    expect("the command's settings (-c, --set, flags) set over every configuration what they differ in: "
           "trainer.batch_size = 16 (theirs: 32, 64)."
           in r.stderr, "bench says a key set over configurations that differ in it", r)
    # A base that overrides an earlier file's value is said once, not once per round.
    p, q, over = (os.path.join(work, n) for n in ("p.ini", "q.ini", "over.ini"))
    with open(p, "w") as f:
        f.write("[trainer]\nclip_grad_norm = 1.0\n")
    with open(q, "w") as f:
        f.write("base = over.ini\n")
    with open(over, "w") as f:
        f.write("[trainer]\nclip_grad_norm = 0.5\n")
    with open(b) as f:
        b_text = f.read()
    with open(b, "w") as f:
        f.write("base = p.ini, q.ini\n" + b_text)
    r = loom(exe, "bench", "configs", a, b, "--steps", "3", "--repeats", "2", *RUN)
    expect(r.stderr.count("trainer.clip_grad_norm = 0.5 replaces 1.0") == 1,
           "bench says a base's override once, not in every round", r)
    rows = [l.split() for l in r.stdout.splitlines() if l.startswith(("a.ini", "b.ini"))]
    expect(len(rows) == 2 and all(re.fullmatch(r"(\d+)-(\d+)", row[-2]) for row in rows)
           and all(int(row[-2].split("-")[0]) <= float(row[-3]) <= int(row[-2].split("-")[1]) for row in rows),
           "bench --repeats 2: a median inside its range per configuration", r)
    expect("2 interleaved rounds" in r.stdout, "bench --repeats says how it measured", r)
    # (each round set up the configurations again, and said their report and warnings again)
    expect(r.stderr.count("plan      batch") == 2 and "round 2 of 2" in r.stderr,
           "bench --repeats reports each configuration's set-up once, in the first round", r)
    expect(re.search(r"bench     1 round of 2 in \d+s; about \d+s more for the rest", r.stderr),
           "bench --repeats says how long the rounds left take", r)
    r = loom(exe, "bench", "configs", a, "--repeats", "0", *RUN, check=False)
    expect(r.returncode != 0 and "--repeats must be between 1 and 100" in r.stderr, "bench refuses --repeats 0", r)
    # A configuration whose plugin crashes (SIGSEGV in its third step) is a FAILED row that says so;
    # the rows of the others stand, measured before and after it, and no scratch run is left (the
    # crash ended the whole bench, its table lost, its scratch folder left).
    models = os.path.join(os.path.dirname(exe), "..", "tests", "models", "libloom_model_metric_model.so")
    fine, crash = os.path.join(work, "fine.ini"), os.path.join(work, "crash.ini")
    with open(fine, "w") as f:
        f.write("[model]\nname = metric_model\n")
    with open(crash, "w") as f:
        f.write("[model]\nname = metric_model\ncrash_at = 3\n")
    crash_tmp = os.path.join(work, "crash_tmp")
    os.makedirs(crash_tmp)
    r = loom(exe, "bench", "configs", fine, crash, a, "--steps", "4", "--repeats", "2", "--plugin-dir", models, *RUN,
             check=False, env=dict(os.environ, TMPDIR=crash_tmp))
    rows = {l.split()[0]: l for l in r.stdout.splitlines() if l.startswith(("fine.ini", "crash.ini", "a.ini"))}
    expect(r.returncode == 1 and len(rows) == 3 and re.match(r"fine\.ini\s+\d+\s+1\s+\d+ .* 1\.00x$", rows["fine.ini"])
           and re.match(r"a\.ini\s+\d+\s+1\s+\d+ .*\d\.\d\dx$", rows["a.ini"])
           and "crash.ini                    FAILED: crashed the process running it with SIGSEGV" in rows["crash.ini"]
           and "2 interleaved rounds" in r.stdout and "configuration " + crash + ": crashed the process running it with "
           "SIGSEGV (Segmentation fault; its crash report is above, on stderr) (its row says FAILED; the others run on)"
           in r.stderr and os.listdir(crash_tmp) == [], f"bench: a configuration that crashes is a FAILED row "
           f"(left {os.listdir(crash_tmp)})", r)
    # (a configuration's warnings, said as the command reads it, are not said again by its run)
    expect(r.stderr.count("model.d_model is an option of model 'lightweight_transformer', which this run does not select")
           == 2, "bench says a configuration's warnings once", r)

    # Stopped by SIGTERM, bench and profile exit 143 and leave none of their scratch runs behind.
    tmp = os.path.join(work, "tmp")
    os.makedirs(tmp)
    trace = os.path.join(work, "stopped.json")
    for name, args in (("bench", ["bench", "configs", a, "--steps", "100000"]),
                       ("profile", ["profile", "--steps", "1000", "--warmup", "100000", "--trace", trace])):
        p = subprocess.Popen([exe, *args, *RUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, TMPDIR=tmp))
        deadline = time.time() + 120
        while time.time() < deadline and not any(n.startswith("loom-" + name) for n in os.listdir(tmp)):
            time.sleep(0.05)
        time.sleep(2)  # into its timed steps
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
        result = subprocess.CompletedProcess(args, p.returncode, out, err)
        expect(p.returncode == 143 and "stopped by SIGTERM" in err, f"{name} stops on SIGTERM", result)
        expect(os.listdir(tmp) == [], f"{name} leaves no scratch folder (found {os.listdir(tmp)})", result)
    # Stopped at once (a second SIGINT), bench removes its scratch runs too, as its first message
    # promised (they were left in the temporary folder), and its run's process (a group of its own,
    # which Ctrl-C does not reach) is killed first. Steps of a larger model, about a second each.
    # The first signal alone now ends the command within milliseconds (it kills the run's process
    # and reports), so the second may come after it: then the graceful stop is checked the same way.
    def processes_with(marker):
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found += [pid] if marker.encode() in f.read() else []
            except OSError:
                pass
        return found
    for attempt in range(3):
        marker = f"trainer.seed={90817 + attempt}"  # (the run's process has the command's arguments)
        p = subprocess.Popen([exe, "bench", "configs", a, "--steps", "100000", *RUN, "--set", "trainer.batch_size=900",
                              "--set", "model.d_model=256", "--set", "model.num_layers=6", "--set", "model.num_heads=4",
                              "--set", marker],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=tmp))
        deadline = time.time() + 120
        while time.time() < deadline and len(processes_with(marker)) < 2:  # (the bench and its run's process)
            time.sleep(0.05)
        time.sleep(2)
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        deadline = time.time() + 20  # (removed by a child rm that outlives the process)
        while time.time() < deadline and (os.listdir(tmp) or processes_with(marker)):
            time.sleep(0.1)
        result = subprocess.CompletedProcess(["bench"], p.returncode, out, err)
        expect(p.returncode in (-signal.SIGINT, 130) and os.listdir(tmp) == [] and processes_with(marker) == [],
               f"bench stopped (rc {p.returncode}) leaves no scratch folder (found {os.listdir(tmp)}) and no process "
               f"(found {processes_with(marker)})", result)
        if p.returncode == -signal.SIGINT:
            break
    # Ctrl-Z (SIGTSTP) stopped the bench alone: its run's process, in a group of its own, measured
    # on, its time limit running; SIGCONT (`fg`) continues both.
    def state(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "gone"
    marker = "trainer.seed=90871"
    p = subprocess.Popen([exe, "bench", "configs", a, "--steps", "100000", *RUN, "--set", marker],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=tmp))
    deadline = time.time() + 120
    while time.time() < deadline and len(processes_with(marker)) < 2:
        time.sleep(0.05)
    time.sleep(2)
    p.send_signal(signal.SIGTSTP)
    deadline = time.time() + 20
    while time.time() < deadline and not all(state(pid) == "T" for pid in processes_with(marker)):
        time.sleep(0.05)
    stopped = {pid: state(pid) for pid in processes_with(marker)}
    p.send_signal(signal.SIGCONT)
    deadline = time.time() + 20
    while time.time() < deadline and any(state(pid) == "T" for pid in processes_with(marker)):
        time.sleep(0.05)
    continued = {pid: state(pid) for pid in processes_with(marker)}
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    result = subprocess.CompletedProcess(["bench"], p.returncode, out, err)
    expect(len(stopped) == 2 and set(stopped.values()) == {"T"} and "T" not in continued.values()
           and p.returncode == 143, f"Ctrl-Z stops the bench and its run's process, SIGCONT continues both "
           f"(stopped {stopped}, continued {continued}, rc {p.returncode})", result)
    # vram_tiers listed after auto_batch replaces what it measured: the warning blamed auto_batch's cache.
    r = loom(exe, "train", "-c", debug, "--set", "memory.policies=auto_batch,vram_tiers", "--device-memory-limit", "600KiB",
             "--set", "memory.tiers=0:64", "--batch-size", "128", "--set", "trainer.max_steps=1", "--set",
             "memory.cache=off", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=tiers_after", check=False)
    expect("vram_tiers, listed after auto_batch, planned after it: list auto_batch last, which measures what fits" in r.stderr
           and "may be stale" not in r.stderr, "vram_tiers after auto_batch is named", r)
    # auto_batch without a cap under `ulimit -v`: a probe the host refused (a 2.5 GiB tensor) was
    # the run's error; it is "does not fit" for the search, whose probes run under what is free.
    def small_address_space():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (8 * 10**9, 8 * 10**9))  # (LibTorch's CUDA libraries map 2.7 GB)
    r = loom(exe, "train", *RUN, "--set", "data.train_size=100000", "--set", "memory.policies=auto_batch",
             "--set", "memory.max_batch=100000", "--set", "memory.cache=off", "--set", "trainer.max_steps=1",
             "--set", f"trainer.work_dir={work}", "--set", "trainer.name=address_space", check=False,
             preexec_fn=small_address_space)
    expect(r.returncode == 0 and "[auto_batch] micro-batch " in r.stderr and "not enough host memory" not in r.stderr,
           "auto_batch under ulimit -v finds a batch that fits", r)
    # An evaluation larger than the step (the recommender ranks its catalogue) that does not fit under
    # a cap: its probes halved the training step's too, and the step's figure, extrapolated from
    # micro-batches 8 and 16, came out 14 % under the run's. The step's is the one measured without a cap.
    def step_total(*extra):
        r = loom(exe, "memory", "estimate", "-c", "gpt2_recommender_debug", *extra)
        return float(re.search(r"\n  total +([0-9.]+) MiB", r.stdout).group(1)), r
    free, _ = step_total()
    capped, r = step_total("--device-memory-limit", "25MiB")
    expect(abs(capped - free) <= 0.02 * free and "memory estimate: an evaluation ran out of memory at micro-batch "
           in r.stderr and "the probes ran at micro-batch 8 and 16" not in r.stderr,
           f"an evaluation that does not fit under a cap leaves the step's estimate as measured ({capped} MiB, {free} without a cap)", r)
finally:
    shutil.rmtree(work, ignore_errors=True)
print("memory cli test passed")
