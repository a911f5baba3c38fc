"""The loom command line as a user meets it: help, suggestions for typos, `config show` with
origins, one clear error for a bad configuration (and the exit status), `eval` of a checkpoint,
plugins that crash while loading refused by name."""
import glob
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time

from common import SMALL, loom, workdir

exe, source = sys.argv[1], sys.argv[2]
configs = os.path.join(source, "configs")


def expect(cond, what, result=None):
    if not cond:
        detail = f"\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}" if result is not None else ""
        raise SystemExit(f"FAIL: {what}{detail}")


r = loom(exe, "--help")
for command in ("train", "eval", "plugins", "config"):
    expect(f"  {command} " in r.stdout, f"--help lists {command}", r)
r = loom(exe, "train", "--help")
expect("--batch-size" in r.stdout and "[trainer.batch_size]" in r.stdout, "train --help shows the seed flags", r)
# A scanner that cannot run does not turn the isolation of plugins off in silence.
r = loom(exe, "plugins", env=dict(os.environ, LOOM_PLUGIN_SCANNER="/nonexistent/scanner"))
expect("LOOM_PLUGIN_SCANNER=/nonexistent/scanner is not an executable file" in r.stderr, "a broken scanner is said", r)
r = loom(exe, "launch", "--help")  # its required --nproc-per-node is not asked for by --help
expect("--nproc-per-node" in r.stdout, "launch --help shows its options", r)
r = loom(exe, "launch", "--nproc-per-node", "2", "--", "train", "--help")  # the command's help, once (it was once per rank)
expect(r.stdout.count("Usage: loom train") == 1 and "launch    2 processes" not in r.stderr, "launch -- train --help", r)
# The run's configuration is checked once by the launcher, before any rank starts (each rank said it).
r = loom(exe, "launch", "--nproc-per-node", "2", "--", "train", "--set", "trainer.batch_szie=3", check=False)
expect(r.returncode == 1 and r.stderr.count("unknown key 'trainer.batch_szie'") == 1 and "launch    2 processes" not in r.stderr,
       "launch checks the configuration once", r)
r = loom(exe, "launch", "--nproc-per-node", "2", "--", "launch", "--nproc-per-node", "2", "--", "train", check=False)
expect(r.returncode == 1 and "a launch inside a launch" in r.stderr, "a nested launch is refused", r)
r = loom(exe, "launch", "--nproc-per-node", "2", "--grace", "nan", "--", "train", check=False)
expect(r.returncode == 1 and "loom launch: --grace nan is not a number of seconds in 0 ... 86400" in r.stderr,
       "a --grace of NaN is refused", r)
r = loom(exe, "launch", "--nproc-per-node", "2", "--", "eval", "runs/x", check=False)
expect(r.returncode == 1 and "loom launch -- eval: only train is a job of several processes" in r.stderr,
       "launch -- eval is refused (each process would evaluate by itself)", r)
cores = os.cpu_count() or 1
if 4 * cores < 1024:
    r = loom(exe, "launch", "--nproc-per-node", str(4 * cores + 1), "--", "train", check=False)
    expect(r.returncode == 1 and f"at most 4 processes per core ({4 * cores} here)" in r.stderr,
           "launch refuses far more ranks than cores before starting any", r)

# The seeds' Python spellings are the flags; a prefix is no flag (--batch-siz ran the full default
# job as --batch-size, --resume became --resume-from on `loom memory`), and an unknown flag says
# what to write instead.
r = loom(exe, "config", "show", "-c", "debug", "--batch_size", "24", "--no_amp")
expect("batch_size = 24" in r.stdout and re.search(r"\nname = auto +# fp32 here: auto \(CPU, precision.amp = false \(--no-amp\)\)", r.stdout),
       "--batch_size and --no_amp are --batch-size, --no-amp (precision auto, its choice beside it)", r)
for given, says in (("--batch-siz", "Did you mean --batch-size?"), ("--gpu-ids", "--set trainer.device=cuda:1"),
                    ("--options", "--set section.key=value"), ("--d_modle", "Did you mean --d-model?")):
    r = loom(exe, "train", "-c", "debug", given, "8", check=False)
    expect(r.returncode == 2 and f"unrecognised option '{given}'" in r.stderr and says in r.stderr, f"{given} is refused", r)
r = loom(exe, "memory", "estimate", "-c", "debug", "--resume", "auto", check=False)
expect(r.returncode == 2 and "unrecognised option '--resume'" in r.stderr, "loom memory has no --resume to guess", r)

r = loom(exe, "trian", check=False)
expect(r.returncode == 2 and "did you mean 'train'?" in r.stderr, "a mistyped command gets a suggestion", r)

r = loom(exe, "config", "show", "-c", os.path.join(configs, "debug.ini"), "--batch-size", "16",
         "--set", "trainer.lr=0.01")
expect("batch_size = 16" in r.stdout and "# --batch-size" in r.stdout, "config show: alias origin", r)
expect("lr = 0.01" in r.stdout and "# --set" in r.stdout, "config show: --set origin", r)
expect("debug.ini:" in r.stdout and "fashion_mnist.ini:" in r.stdout, "config show: file:line origins", r)
expect("flavour = debug" in r.stdout and "(model 'lightweight_transformer')" in r.stdout, "plugin keys", r)
# `loom config` alone shows (it printed a bare usage line); a stray word is named.
r = loom(exe, "config", "--batch-size", "16")
expect("batch_size = 16" in r.stdout and "# --batch-size" in r.stdout, "loom config alone shows", r)
r = loom(exe, "config", "shw", check=False)
expect(r.returncode == 1 and "loom config: 'shw' is no subcommand (show or keys)" in r.stderr, "config shw", r)
r = loom(exe, "config", "show", "extra", check=False)
expect(r.returncode == 1 and "loom config show takes no argument, and 'extra' is one" in r.stderr, "config show extra", r)
# `loom config keys`: every key of the run with its default, range and meaning (the core's keys were
# explained nowhere a user looks; the docs probe), the selected components' under their section.
r = loom(exe, "config", "keys", "-c", "debug")
expect(re.search(r"\[trainer\]\n(.*\n)*max_steps = 50 +# optimizer steps to train; 0: as many as `epochs` take \[0, \d+\]; "
                 r"default 0\n", r.stdout)
       and re.search(r"\neval_every = 25 +# evaluate every N steps; 0: at the end of each epoch", r.stdout)
       and re.search(r"\[model\.lightweight_transformer\]  # model 'lightweight_transformer'\n", r.stdout)
       and "[memory.auto_batch]" not in r.stdout, "config keys", r)
r = loom(exe, "config", "keys", "-c", "debug", "--set", "memory.policies=auto_batch")
expect("[memory.auto_batch]  # memory policy 'auto_batch'" in r.stdout, "config keys of a selected policy", r)
# A component that cannot be built as configured (the interactions dataset without data.root):
# its keys are listed, which say what to set, and then what is missing (it was the error alone).
r = loom(exe, "config", "keys", "-c", "debug", "--set", "data.name=interactions", check=False)
expect(r.returncode == 1 and "[data.interactions]  # dataset 'interactions'" in r.stdout
       and re.search(r"\nroot = +# ", r.stdout)
       and "this configuration does not run as it is (its keys are above): dataset 'interactions' could not be created: "
           "data.root is not set" in r.stderr, "config keys of a dataset whose folder is not set", r)
r = loom(exe, "config", "show", "-c", "debug", "--set", "data.name=interactions", check=False)
expect(r.returncode == 1 and "data.root is not set" in r.stderr, "config show checks the components as train does", r)

# A key given twice on the command line: the value not used is never checked, so it is named.
r = loom(exe, "config", "show", "--batch-size", "abc", "--set", "trainer.batch_size=64")
expect("batch_size = 64" in r.stdout and "trainer.batch_size is given twice on the command line (--batch-size abc, "
       "--set trainer.batch_size=64): 64 is used" in r.stderr, "a flag's value replaced by --set is named", r)
r = loom(exe, "config", "show", "--set", "trainer.lr=1", "--set", "trainer.lr=2", "--set", "trainer.lr=3")
expect("trainer.lr is given 3 times on the command line (--set trainer.lr=1, --set trainer.lr=2, --set trainer.lr=3): 3 "
       "is used (--set wins over a flag, a later --set over an earlier one), 1, 2 are not" in r.stderr,
       "a key given three times names the value used, the last", r)

# A key written twice in one file: the later line wins, and the earlier value is named.
tmp = workdir()
twice = os.path.join(tmp, "twice.ini")
with open(twice, "w") as f:
    f.write("[trainer]\nmax_steps = 7\n[model]\nname = lightweight_transformer\n[trainer]\nmax_steps = 8\n")
r = loom(exe, "config", "show", "-c", twice)
expect("max_steps = 8" in r.stdout and "twice.ini:6: trainer.max_steps is set again (line 2: 7); the later, 8, is used"
       in r.stderr, "a key set twice in one file", r)
# A loop of symbolic links is said as such, not "not found".
os.symlink(os.path.join(tmp, "loop2.ini"), os.path.join(tmp, "loop1.ini"))
os.symlink(os.path.join(tmp, "loop1.ini"), os.path.join(tmp, "loop2.ini"))
r = loom(exe, "config", "show", "-c", os.path.join(tmp, "loop1.ini"), check=False)
expect(r.returncode == 1 and "loop1.ini: cannot be read (Too many levels of symbolic links)" in r.stderr,
       "a config file that is a loop of links", r)
shutil.rmtree(tmp)
r = loom(exe, "config", "show", "--set", "memory.policies=auto_batch, auto_batch", check=False)
expect(r.returncode == 1 and "memory.policies lists 'auto_batch' twice" in r.stderr, "a policy listed twice", r)
# What `loom train` would refuse at set-up, `config show` refuses too: no component, no folder of runs.
for key, says in (("model.name", "model.name is empty; name the model to use"), ("trainer.optimizer", "trainer.optimizer is empty"),
                  ("trainer.work_dir", "trainer.work_dir is empty; name the folder")):
    r = loom(exe, "config", "show", "--set", f"{key}=", check=False)
    expect(r.returncode == 1 and says in r.stderr, f"config show refuses an empty {key}", r)
# A stray comma in a list would drop an item in silence; a seed-style switch given a value says it takes none.
r = loom(exe, "config", "show", "--set", "parallel.name=data_parallel", "--set", "parallel.devices=cpu,,cpu", check=False)
expect(r.returncode == 1 and "parallel.devices = 'cpu,,cpu' has an empty item (a stray comma)" in r.stderr,
       "a list with an empty item", r)
for command in (("config", "show"), ("train",)):
    r = loom(exe, *command, "--use-scheduler", "maybe", check=False)
    expect(r.returncode == 1 and "--use-scheduler is a switch: it sets trainer.use_scheduler = true and takes no value; "
           "to give one, --set trainer.use_scheduler=maybe" in r.stderr, f"{command[0]} --use-scheduler maybe", r)
r = loom(exe, "memory", "estimate", "-c", os.path.join(configs, "debug.ini"), "--devices", "2147483648", check=False)
expect(r.returncode == 1 and "--devices 2147483648 is outside [1, 16777216]" in r.stderr, "absurd --devices", r)
r = loom(exe, "plugins", "check", "lightweight_transformer", "--dataset", "nope", check=False)
expect(r.returncode == 1 and "'nope'" in r.stderr and "conforms" not in r.stdout, "plugins check --dataset of no plugin", r)
# At a terminal set to `stty tostop`, the check's child (a background process group) stopped at
# its first line on the terminal (SIGTTOU), and the check hung to its limit.
if shutil.which("script"):
    command = (f"stty tostop; {shlex.quote(exe)} plugins check fraction_cap --log-level debug --check-timeout 30; "
               "echo rc=$?")
    r = subprocess.run(["script", "-qec", command, "/dev/null"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    expect("the plugin conforms" in r.stdout and "rc=0" in r.stdout and "did not finish" not in r.stdout,
           "plugins check at a terminal with stty tostop", r)
# A dataset of the user's files is checked with its options (the skip said "check it with its
# options", and nothing took them); a --set not of a component's option is refused.
ml = os.path.join(workdir(), "ml")
os.makedirs(ml)
with open(os.path.join(ml, "movies.dat"), "w") as f:
    f.write("".join(f"{i}::Film {i} (1995)::Drama\n" for i in range(1, 13)))
with open(os.path.join(ml, "ratings.dat"), "w") as f:
    f.write("".join(f"{u}::{(u * 2 + k) % 12 + 1}::{1 + (u + k) % 5}::{978300000 + u * 10 + k}\n"
                    for u in range(1, 7) for k in range(4)))
r = loom(exe, "plugins", "check", "interactions", check=False)
expect("skip  create: cannot be created with its default options" in r.stdout
       and "check it with its options (loom plugins check FILE --set data.interactions.<option>=VALUE)" in r.stdout,
       "plugins check: a dataset of the user's files, without them, is skipped with how to give them", r)
r = loom(exe, "plugins", "check", "interactions", "--set", f"data.interactions.root={ml}", "--set",
         "data.interactions.min_interactions=3")
section = r.stdout.split("dataset 'interactions'")[1].split("\n\n")[0]
expect("skip" not in section and "FAIL" not in section and "pass  thread_safe" in section and "the plugin conforms" in r.stdout,
       "plugins check --set data.interactions.root=...: the dataset checked with its files", r)
r = loom(exe, "plugins", "check", "interactions", "--set", f"data.fashion_mnist.root={ml}", check=False)
expect(r.returncode == 1 and "has no component 'fashion_mnist' (it has " in r.stderr, "plugins check --set of another file's", r)
r = loom(exe, "plugins", "check", "interactions", "--set", f"model.interactions.root={ml}", check=False)
expect(r.returncode == 1 and "'interactions' is a dataset, whose options are data.interactions.OPTION" in r.stderr,
       "plugins check --set in another kind's section", r)
r = loom(exe, "plugins", "check", "interactions", "--set", f"data.interactions.rot={ml}", check=False)
expect(r.returncode == 1 and "'interactions' has no option 'rot'; did you mean 'root'?" in r.stderr,
       "plugins check --set of no option", r)
r = loom(exe, "plugins", "check", "interactions", "--set", f"interactions.root={ml}", check=False)
expect(r.returncode == 1 and "takes a component's option as SECTION.COMPONENT.OPTION=VALUE" in r.stderr,
       "plugins check --set without a component", r)
# README's `-c configs/debug.ini` run outside Loom's checkout: Loom's own is named, by its name.
r = loom(exe, "config", "show", "-c", "configs/debug.ini", check=False, cwd=workdir())
expect(r.returncode == 1 and "config file configs/debug.ini not found (from " in r.stderr
       and "; Loom's own debug.ini is " in r.stderr and "given by its name alone: debug\n" in r.stderr,
       "a relative path to a missing configuration of Loom's name", r)
r = loom(exe, "bench", "configs", "configs/debug.ini", "--steps", "2", check=False, cwd=workdir())
expect(r.returncode == 1 and "configuration configs/debug.ini: config file configs/debug.ini not found" in r.stderr
       and "given by its name alone: debug\n" in r.stderr, "bench configs: a relative path to Loom's configuration", r)
# A size that rounds to no budget, or to a few bytes, is refused (0.3 meant no cap at all).
for limit in ("0.3", "0.5", "2KiB"):
    r = loom(exe, "train", "-c", os.path.join(configs, "debug.ini"), "--device-memory-limit", limit, check=False)
    expect(r.returncode == 1 and f"memory.device_memory_limit = {limit} is " in r.stderr and "no device's size" in r.stderr,
           f"--device-memory-limit {limit}", r)
# trainer.init_from with a resume that would ignore it, or continue another run, is refused.
r = loom(exe, "train", "-c", os.path.join(configs, "debug.ini"), "--set", "trainer.init_from=/x",
         "--set", "trainer.resume_from=/y", check=False)
expect(r.returncode == 1 and "trainer.init_from and trainer.resume_from are both set; choose one" in r.stderr,
       "init_from with resume_from", r)
r = loom(exe, "train", "-c", os.path.join(configs, "debug.ini"), "--set", "trainer.init_from=/x", "--resume", "auto", check=False)
expect(r.returncode == 1 and "trainer.init_from with trainer.resume = auto needs a trainer.name" in r.stderr,
       "init_from with an unnamed resume = auto", r)
here = workdir()
with open(os.path.join(here, "mine.ini"), "w") as f:
    f.write("base = configs/debug.ini\n[trainer]\nmax_steps = 3\n")
r = loom(exe, "config", "show", "-c", "mine.ini", check=False, cwd=here)
expect(r.returncode == 1 and "mine.ini:1: base = configs/debug.ini: configs/debug.ini not found; Loom's own debug.ini is "
       in r.stderr and "a bare name gives: base = debug" in r.stderr, "a base by a relative path to Loom's name", r)
# Every configuration of a bench is read before the first one runs.
r = loom(exe, "bench", "configs", os.path.join(configs, "debug.ini"), "/nonexistent.ini", "--steps", "2", check=False)
expect(r.returncode == 1 and "/nonexistent.ini not found" in r.stderr and "run folder" not in r.stderr
       and "configuration" not in r.stdout, "bench checks every configuration first", r)
r = loom(exe, "bench", "configs", os.path.join(configs, "debug.ini"), "--steps", "1000000000000", check=False)
expect(r.returncode == 1 and "--steps must be in 2..100000" in r.stderr, "bench refuses a trillion steps", r)
# What a bench replaces of the user's settings is said (trainer.max_steps=abc was accepted in
# silence), and its steps run without callbacks (listed, their hooks never ran).
r = loom(exe, "bench", "configs", os.path.join(configs, "debug.ini"), "--steps", "2", "--set", "trainer.max_steps=abc")
expect("loom bench sets trainer.max_steps from --steps: the value given, 'abc' (--set), is not used" in r.stderr
       and "callbacks none;" in r.stderr, "bench says the values it replaces and runs no callbacks", r)
# A configuration that fails in its set-up is named (the error read as the first one's).
big = os.path.join(workdir(), "big.ini")
with open(big, "w") as f:
    f.write(f"base = {os.path.join(configs, 'debug.ini')}\n[trainer]\nbatch_size = 4000\n")
r = loom(exe, "bench", "configs", os.path.join(configs, "debug.ini"), big, "--steps", "2", check=False)
expect(r.returncode == 1 and f"configuration {big}: set-up: the global batch, 4000 (trainer.batch_size), is more than" in r.stderr,
       "bench names the failing configuration", r)
# ... and the figures of the others stand: the table has their rows, and the failed one's (they
# were lost with it).
expect(re.search(r"^debug\.ini\s+\d+\s+\d+\s+\d+", r.stdout, re.M) and re.search(r"^big\.ini\s+FAILED: set-up: ", r.stdout, re.M)
       and all(not line.strip() or line.startswith(("(", "configuration")) or line.split()[0].endswith(".ini")
               for line in r.stdout.splitlines()),
       "bench prints the table with the configurations that ran and the one that failed", r)

# configs/fashion_mnist.ini is the default job spelled out: `loom train` without -c runs exactly it.
def settings(*args):
    out = loom(exe, "config", "show", *args).stdout
    return [line.split("#")[0].rstrip() for line in out.splitlines()]
expect(settings() == settings("-c", os.path.join(configs, "fashion_mnist.ini")),
       "configs/fashion_mnist.ini resolves to the defaults `loom train` runs without -c")

r = loom(exe, "plugins", "inspect", "/no/such/libloom_plugin.so", check=False)
expect(r.returncode == 1 and "no such file" in r.stdout and "iostream" not in r.stdout + r.stderr,
       "inspect of a missing file says so", r)
r = loom(exe, "plugins", "inspect", "oom_recovery")
expect("memory 'oom_recovery'" in r.stdout and "libloom_memory_oom_recovery.so" in r.stdout,
       "inspect by component name finds its file", r)
r = loom(exe, "plugins", "inspect", "no_such_component", check=False)
expect(r.returncode == 1 and "neither a file nor the name of a loaded component" in r.stderr,
       "inspect of an unknown name", r)

work = workdir()
try:
    bad = os.path.join(work, "bad.ini")
    with open(bad, "w") as f:
        f.write(f"base = {os.path.join(configs, 'debug.ini')}\n[trainer]\nbatch_szie = 64\n[model]\nnum_layers = two\n")
    r = loom(exe, "train", "-c", bad, check=False)
    expect(r.returncode == 1, "a bad configuration exits with 1", r)
    expect("bad.ini:3: unknown key 'trainer.batch_szie'; did you mean 'trainer.batch_size'?" in r.stderr,
           "unknown key with file:line and suggestion", r)
    expect("bad.ini:5: model.num_layers = 'two' is not valid: expected an integer" in r.stderr, "bad value", r)
    expect(not os.path.exists(os.path.join(work, "runs")), "nothing is built or written before validation", r)
    # A value the model's factory refuses: one line naming the model once, the reason and the fix.
    r = loom(exe, "train", "-c", os.path.join(configs, "fashion_mnist.ini"), "--set", f"trainer.work_dir={work}",
             "--set", "model.d_model=97", "--set", "model.num_heads=4", check=False)
    expect(r.returncode == 1 and r.stderr.count("lightweight_transformer") == 2  # the message and the plugin's file
           and "model 'lightweight_transformer' could not be created: num_heads 4 does not divide d_model 97: "
               "set model.d_model to a multiple of it (96 or 100)" in r.stderr,
           "a value the model refuses is named once, with its fix", r)

    loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev",
         "--set", "trainer.max_steps=10", "--set", "trainer.eval_every=5")
    best = os.path.join(work, "ev", "checkpoints", "best_accuracy.safetensors")
    # Flags of training given to eval are named as doing nothing there (they were taken in silence).
    r = loom(exe, "eval", best, "--use-scheduler", "--work-dir", os.path.join(work, "nowhere"), "--set", "trainer.lr=0.5")
    expect("trainer.use_scheduler = true (--use-scheduler) has no effect here: this command trains nothing" in r.stderr
           and "trainer.lr = 0.5 (--set) has no effect here" in r.stderr
           and "trainer.work_dir = " + os.path.join(work, "nowhere") + " (--work-dir) has no effect here" in r.stderr
           and "accuracy" in r.stderr, "training flags given to eval", r)
    # A checkpoint that cannot be written (a full disk; here a file size limit, as the kernel says
    # it): one error, no partial folder, the older checkpoints stand, and the command that continues
    # from them, which then runs.
    full = [*SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=full", "--set", "trainer.eval_every=100",
            "--set", "trainer.checkpoint_every=2"]
    loom(exe, "train", *full, "--set", "trainer.max_steps=4")
    checkpoints = os.path.join(work, "full", "checkpoints")
    limit = os.path.getsize(os.path.join(checkpoints, "step_00000004", "model.safetensors")) // 2

    def small_files():
        # (SIGXFSZ as a shell leaves it, the default that ends the process: loom ignores it itself,
        # and the write fails instead)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    r = loom(exe, "train", *full, "--set", "trainer.max_steps=8", "--resume", "auto", check=False, preexec_fn=small_files)
    expect("the run is now 8 steps long, not 4: the warmup_cosine schedule is computed over the new length, so step 5's "
           "learning rate is " in r.stderr and "(the decay resumes from higher up: a warm restart)" in r.stderr,
           "a longer resume says its rate restarts", r)
    expect(r.returncode == 1 and "the checkpoint of step 6 could not be written" in r.stderr
           and "its partial folder is removed" in r.stderr and "step_00000004 are intact" in r.stderr
           and "the file-size limit of this process (`ulimit -f`)" in r.stderr
           and "(raise the file-size limit, or lift it: `ulimit -f unlimited`)" in r.stderr,
           "a checkpoint that cannot be written is one error naming what stands", r)
    steps = sorted(f for f in os.listdir(checkpoints) if f.startswith((".", "step_")))
    expect(steps == ["step_00000002", "step_00000004"], f"no partial checkpoint folder: {steps}", r)
    again = shlex.split(r.stderr.split("continue with: ")[1].splitlines()[0])
    expect(again[:2] == ["loom", "train"] and again[-2:] == ["--set", "trainer.name=full"], "the continue command", r)
    r = loom(exe, *again[1:])
    expect(f"resumed from {os.path.join(checkpoints, 'step_00000004')} at step 4" in r.stderr and "step_00000008" in os.listdir(checkpoints), "the suggested command continues the run", r)
    # A run folder whose newest step lost a file: eval takes the step before it, as a resume does.
    copy = os.path.join(work, "full_copy")
    shutil.copytree(os.path.join(work, "full"), copy)
    os.remove(os.path.join(copy, "checkpoints", "step_00000008", "model.safetensors"))
    with open(os.path.join(copy, "checkpoints", "step_00000006", "model.safetensors"), "r+b") as f:
        f.truncate(2000)  # (damaged: it was an error, with advice for --resume auto)
    r = loom(exe, "eval", copy)
    expect(re.search(r"step_00000008 cannot be evaluated \(.*has no model\.safetensors.*\): taking the step before it", r.stderr)
           and re.search(r"step_00000006 cannot be evaluated \(.*\): taking the step before it", r.stderr)
           and "step_00000004" in r.stderr and "accuracy" in r.stderr,
           "eval of a run folder passes over step folders that are not whole or damaged", r)
    # A step kept without its optimizer.safetensors (to save space) is evaluated, as `loom eval STEP`
    # evaluates it (the run folder's form took the step before it, or refused a run of one step).
    os.remove(os.path.join(copy, "checkpoints", "step_00000004", "optimizer.safetensors"))
    r = loom(exe, "eval", copy)
    expect("step_00000004 cannot be evaluated" not in r.stderr and "step_00000004 has no optimizer.safetensors" in r.stderr
           and "accuracy" in r.stderr, "eval of a run folder whose newest whole step has no optimizer state", r)
    # A run folder without step checkpoints: what it holds is named ("pass one of its best_*.safetensors
    # files" was said of a run with none, whose steps a resume had set aside).
    bare = os.path.join(work, "bare_run")
    os.makedirs(os.path.join(bare, "checkpoints", "abandoned-1", "step_00000010"))
    r = loom(exe, "eval", bare, check=False)
    expect(r.returncode == 1 and "is a run folder without step checkpoints; it has no best file either; "
           + os.path.join(bare, "checkpoints", "abandoned-1") + " hold steps a resume set aside" in r.stderr,
           "eval of a run folder with set-aside steps only says where they are", r)
    shutil.copy(best, os.path.join(bare, "checkpoints", "best_accuracy.safetensors"))
    r = loom(exe, "eval", bare, check=False)
    expect(r.returncode == 1 and "pass one of its best files (" + os.path.join(bare, "checkpoints", "best_accuracy.safetensors")
           in r.stderr, "eval of a run folder with a best file only names it", r)
    r = loom(exe, "eval", "--checkpoint", best, "--set", "data.test_size=256")
    expect("accuracy" in r.stderr and "on 256 test samples" in r.stderr, "eval of the best checkpoint", r)
    # A path's ~ after '=' is not the shell's to expand: it is the home folder to Loom too.
    home = os.path.join(work, "home")
    os.makedirs(home)
    shutil.copy(best, os.path.join(home, "best.safetensors"))
    r = loom(exe, "eval", "--checkpoint=~/best.safetensors", "--set", "data.test_size=256",
             env={**os.environ, "HOME": home})
    expect("accuracy" in r.stderr, "eval of a checkpoint given as --checkpoint=~/...", r)
    r = loom(exe, "eval", best, "--set", "data.test_size=128")
    expect("this command's model and data differ from the checkpoint's: data.test_size = 128 (--set; the "
           "checkpoint's: 256)" in r.stderr, "eval says where its data differs from the checkpoint's", r)
    r = loom(exe, "eval", best, "--set", "data.synthetic.test_size=128")  # the full key, as `loom config show` gives it
    expect("differ from the checkpoint's: data.test_size = 128 (--set; the checkpoint's: 256)" in r.stderr
           and "written two ways" not in r.stderr, "eval says the change written with the full key too", r)
    r = loom(exe, "eval", best, "--set", "model.dropout=0.3", "--set", "model.lightweight_transformer.dropout=0.2")
    expect("model.dropout is set twice, written two ways (0.3 from --set, 0.2 from --set); the later, 0.2, is used"
           in r.stderr and "differ from the checkpoint's: model.dropout = 0.2 (--set; the checkpoint's: 0.1)" in r.stderr,
           "eval says a model option written two ways, and the one in force", r)
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "data.validation_fraction=0.999",
             check=False)
    expect(r.returncode == 1 and "hold out less of it for validation (data.validation_fraction = 0.999" in r.stderr,
           "a validation fraction that leaves too little to train names the fraction", r)
    r = loom(exe, "plugins", "--plugin-dir", "/dev/zero")
    expect("--plugin-dir /dev/zero is a character device, not a folder or a plugin file" in r.stderr,
           "a --plugin-dir that is a device is said", r)
    r = loom(exe, "plugins", "--plugin-dir", work)
    expect(f"Searched: {work} (--plugin-dir), " in r.stdout,
           "loom plugins names the --plugin-dir folders it searched, first (the order it searches)", r)
    # A plugin file's name with an escape and a line break: shown as text, the terminal's screen not
    # cleared, the table's row not split (they were printed raw), and the scan cache not split either.
    odd = os.path.join(work, "odd_names")
    os.makedirs(odd)
    built = os.path.join(os.path.dirname(exe), "..", "lib", "loom", "plugins", "libloom_schedule_constant.so")
    shutil.copy(built, os.path.join(odd, "lib\x1b[2Jodd\n.so"))
    r = loom(exe, "plugins", "--plugin-dir", odd, env=dict(os.environ, LOOM_CACHE=os.path.join(work, "odd_cache")))
    expect("\x1b" not in r.stdout and "lib [2Jodd .so" in r.stdout and "\n.so" not in r.stdout,
           "a plugin file's name is printed without its control characters", r)
    scan_cache = os.path.join(work, "odd_cache", "plugin-scan.tsv")
    expect(not os.path.exists(scan_cache) or all(line.startswith("/") for line in open(scan_cache, encoding="utf-8", errors="replace")),
           "the scan cache keeps one line per file")
    r = loom(exe, "plugins", env=dict(os.environ, LOOM_PLUGIN_PATH=f"/dev/zero:{work}/no_such_folder"))
    expect("LOOM_PLUGIN_PATH's /dev/zero is a character device, not a folder or a plugin file" in r.stderr
           and f"LOOM_PLUGIN_PATH's {work}/no_such_folder: no such folder or file" in r.stderr,
           "LOOM_PLUGIN_PATH's entries are checked as --plugin-dir is", r)
    r = loom(exe, "eval", "--checkpoint", os.path.join(work, "ev", "checkpoints", "step_00000010"))
    expect("accuracy" in r.stderr, "eval of a step folder", r)
    # A state.json of 200,000 nested brackets (400 KB): copying its value crashed eval with SIGSEGV.
    deep = os.path.join(work, "deep_step")
    shutil.copytree(os.path.join(work, "ev", "checkpoints", "step_00000010"), deep)
    with open(os.path.join(deep, "state.json"), "w") as f:
        f.write('{"format": 1, "model": ' + "[" * 200000 + "]" * 200000 + "}")
    for command in ("eval", "recommend"):
        r = loom(exe, command, deep, *(["--user", "1"] if command == "recommend" else []), check=False)
        expect(r.returncode == 1 and "nested more than 64 levels deep" in r.stderr,
               f"{command} of a step folder whose state.json nests 200,000 levels: named, no crash", r)
    # A tensor's name from the file reaches the terminal escaped (its escape sequences were printed).
    import struct
    header = json.dumps({"\x1b[31mRED\x07": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}).encode()
    with open(os.path.join(work, "esc.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    r = loom(exe, "eval", os.path.join(work, "esc.safetensors"), check=False)
    expect(r.returncode == 1 and "tensor '\\x1b[31mRED\\x07' has a negative dimension" in r.stderr and "\x1b" not in r.stderr,
           "a safetensors file's tensor name is shown escaped", r)
    r = loom(exe, "eval", best, "--set", "data.test_size=256")
    expect("on 256 test samples" in r.stderr, "eval of a checkpoint named as the only argument", r)
    # The result is the command's output: on stdout, at every log level (a script got nothing).
    r = loom(exe, "eval", best, "--set", "data.test_size=256", "--log-level", "off")
    expect(re.fullmatch(re.escape(best) + r": accuracy [0-9.]+ %, loss [0-9.]+ on 256 test samples \(\d+s\)\n", r.stdout)
           and r.stderr == "", "eval's result on stdout alone, with --log-level off", r)
    # Once where stdout and stderr are one pipe (`2>&1 | tee`): it was printed and logged there.
    r = subprocess.run([exe, "eval", best, "--set", "data.test_size=256"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    expect(r.returncode == 0 and r.stdout.count("on 256 test samples") == 1, "eval 2>&1: its result once", r)
    # Evaluation builds no training loader: a batch larger than the training split (a checkpoint of a
    # small dataset, evaluated at the default batch) is no reason to refuse.
    r = loom(exe, "eval", best, "--batch-size", "4096")
    expect("accuracy" in r.stderr and "too few" not in r.stderr, "eval at a batch larger than the training split", r)
    # `loom eval` evaluates in the precision the run trained in (it took fp32, and its figures were
    # not the run's own), and fails where the loss is not finite (it said so and exited 0).
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=evp",
             "--set", "precision.name=bf16_amp", "--set", "trainer.max_steps=4", "--set", "trainer.eval_every=4")
    final = re.search(r"test step 4: loss ([0-9.]+), accuracy ([0-9.]+) %", r.stderr)
    expect(final is not None, "the run's final test line", r)
    r = loom(exe, "eval", os.path.join(work, "evp"))
    expect(f"accuracy {final.group(2)} %, loss {final.group(1)} on 256 test samples" in r.stderr,
           "eval gives the run's own final figures, in its precision", r)
    r = loom(exe, "eval", os.path.join(work, "evp"), "--no-amp")
    expect("evaluating in precision fp32 (auto (CPU, precision.amp = false (--no-amp)))" in r.stderr
           and "the checkpoint was trained in bf16_amp" in r.stderr,
           "eval in another precision says so", r)
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=evnan", "--set", "trainer.max_steps=40",
             "--set", "trainer.lr=10", "--set", "trainer.clip_grad_norm=0", "--set", "trainer.use_scheduler=false",
             "--set", "trainer.optimizer=sgd", "--set", "precision.name=fp16_amp", check=False)
    r = loom(exe, "eval", os.path.join(work, "evnan"), check=False)
    expect(r.returncode == 1 and re.search(r"the evaluation's loss is (nan|inf|-inf): ", r.stderr)
           and "it was evaluated in fp16_amp" in r.stderr,
           "eval of a model whose loss is not finite fails", r)
    # A data path the run was given relative to its folder, evaluated from another: named as the
    # checkpoint's, with the fix (the dataset said only that it found no data there).
    fashion = "/usr/share/datasets/fashion-mnist"
    if os.path.isdir(fashion):
        os.symlink(fashion, os.path.join(work, "fm"))
        loom(exe, "train", "-c", os.path.join(configs, "fashion_mnist.ini"), "--set", f"trainer.work_dir={work}",
             "--set", "trainer.name=relative", "--set", "data.path=fm", "--set", "data.limit_train=256",
             "--set", "data.limit_test=64", "--set", "trainer.max_steps=2", "--set", "model.flavour=debug", cwd=work)
        r = loom(exe, "eval", os.path.join(work, "relative"), check=False, cwd="/")
        expect(r.returncode == 1 and "data.path = fm comes from the checkpoint's configuration, a path relative to the "
               "folder its run trained in, and there is no fm in this one (/): run this command from that folder, or give "
               "--set data.path=<its absolute path>" in r.stderr, "eval names a relative data path of the checkpoint", r)
        r = loom(exe, "eval", os.path.join(work, "relative"), cwd=work)
        expect("accuracy" in r.stderr, "eval from the run's folder finds it", r)
    # A static loss scale that overflows every step never comes down: the run learned nothing, and
    # the advice is the scale's (it was "train longer, or lower precision.init_scale", and exit 0).
    # (At batch 1: the scale multiplies the mean, as PyTorch's, and 60000 overflows this model's
    # gradients of one sample; at 32 it trains, as it would in PyTorch.)
    one = ["--set", "trainer.batch_size=1"]
    r = loom(exe, "train", *SMALL, *one, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=static_scale",
             "--set", "trainer.max_steps=4", "--set", "precision.name=fp16_amp", "--set", "precision.loss_scale=60000",
             check=False)
    expect(r.returncode == 1 and "the run learned nothing: every one of the run's 4 steps had non-finite gradients under "
           "fp16_amp's static loss scale of 60000" in r.stderr and "lower precision.loss_scale" in r.stderr,
           "a static loss scale that overflows every step is an error naming it", r)
    # So is a resumed session whose every step overflowed (it exited 0, its summary "not diverged").
    loom(exe, "train", *SMALL, *one, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=static_resumed",
         "--set", "trainer.max_steps=4")
    r = loom(exe, "train", *SMALL, *one, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=static_resumed",
             "--set", "trainer.max_steps=6", "--set", "precision.name=fp16_amp", "--set", "precision.loss_scale=60000",
             "--set", "precision.allow_precision_change=true", "--resume", "auto", check=False)
    expect(r.returncode == 1 and "the run learned nothing: every one of the 2 steps since resuming had non-finite "
           "gradients under fp16_amp's static loss scale of 60000" in r.stderr,
           "a resumed session that updated nothing is an error too", r)
    r = loom(exe, "eval", best, best, check=False)
    expect(r.returncode == 1 and "one argument too many" in r.stderr and "is a switch" not in r.stderr,
           "eval refuses a second checkpoint", r)
    r = loom(exe, "eval", "--no-amp", "false", best, check=False)
    expect(r.returncode == 1 and "--no-amp is a switch: it sets precision.amp = false and takes no value; to give one, "
           "--set precision.amp=false" in r.stderr, "eval --no-amp false: the switch's would-be value is named", r)
    r = loom(exe, "eval", os.path.join(work, "ev", "config.json"), check=False)
    expect(r.returncode == 1 and "config.json is not a checkpoint" in r.stderr and "pass its run folder" in r.stderr
           and "damaged" not in r.stderr, "eval of a run's config.json: not a checkpoint, not damaged", r)
    r = loom(exe, "doctor", "gpu", check=False)
    expect(r.returncode == 1 and "takes no arguments" in r.stderr, "doctor refuses an argument it would ignore", r)
    r = loom(exe, "recommend", "x", "--user", "1", "--top", "9223372036854775808", check=False)
    expect(r.returncode == 2 and "9223372036854775808 is past the 64-bit integers (-9223372036854775808 to "
           "9223372036854775807)" in r.stderr, "a whole number past int64 given to an option says so", r)
    r = loom(exe, "doctor", cwd=work, env=dict(os.environ, LOOM_CACHE="relative_cache"))
    expect("relative: taken from the folder a command runs in (here " + os.path.join(work, "relative_cache") in r.stdout,
           "doctor says a relative LOOM_CACHE is a cache per folder", r)
    r = loom(exe, "doctor", env=dict(os.environ, LOOM_FUSED_KERNELS="layernorm,linear\x1b[2J"))
    expect("LOOM_FUSED_KERNELS=layernorm,linear [2J: no fused operation 'layernorm' (there are cross_entropy, " in r.stdout
           and "\x1b" not in r.stdout, "doctor names a fused operation LOOM_FUSED_KERNELS does not know, printed safely", r)
    r = loom(exe, "eval", "--checkpoint", best, "--set", "model.flavour=standard", check=False)
    expect(r.returncode == 1 and "its weights do not fit this model (tensor '" in r.stderr
           and "This command changes the configuration the checkpoint was trained with: model.flavour = standard "
               "(--set; the checkpoint's: debug)" in r.stderr, "eval refuses weights of another model, naming why", r)
    # a work_dir under a file: what failed, on which path, and why, without libstdc++'s "filesystem error: [...]"
    afile = os.path.join(work, "afile")
    open(afile, "w").close()
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={afile}", "--set", "trainer.name=w", check=False)
    expect(r.returncode == 1 and f"cannot create directories {afile}/w: Not a directory ({afile} is a file, not a folder"
           in r.stderr and "filesystem error" not in r.stderr, "a work_dir under a file", r)
    r = loom(exe, "train", *SMALL, "--set", "trainer.work_dir=/dev/null", "--set", "trainer.name=w", check=False)
    expect(r.returncode == 1 and "Not a directory (/dev/null is a character device, not a folder: choose another path" in r.stderr,
           "a work_dir that is a device is named as one", r)
    # The run's config.json replaced by a folder: named, with the fix, on a resume.
    shutil.copytree(os.path.join(work, "ev"), os.path.join(work, "cj"))
    os.remove(os.path.join(work, "cj", "config.json"))
    os.mkdir(os.path.join(work, "cj", "config.json"))
    os.remove(os.path.join(work, "cj", ".lock"))  # (a copy without it: the refusal leaves none either)
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=cj", "--resume", "auto",
             "--set", "trainer.max_steps=12", check=False)
    expect(r.returncode == 1 and "config.json is a folder, not the run's configuration, which Loom writes there; move it "
           "out of the run folder" in r.stderr and not os.path.lexists(os.path.join(work, "cj", ".lock")),
           "a folder in place of config.json", r)
    # eval of a run's checkpoints folder: its newest step; of a folder that holds no checkpoint: said so.
    r = loom(exe, "eval", os.path.join(work, "ev", "checkpoints"), "--set", "data.test_size=256")
    expect("step_00000010: accuracy" in r.stderr, "eval of a run's checkpoints folder takes its newest step", r)
    r = loom(exe, "eval", "checkpoints/", "--set", "data.test_size=256", cwd=os.path.join(work, "ev"))
    expect("step_00000010: accuracy" in r.stderr, "eval of checkpoints/ inside the run folder", r)
    r = loom(exe, "eval", configs, check=False)
    expect(r.returncode == 1 and "is a folder, but no checkpoint: it has no state.json" in r.stderr,
           "eval of a folder that is no checkpoint", r)
    r = loom(exe, "eval", work, check=False)  # (the work folder: its runs named)
    expect(r.returncode == 1 and f"{work} is a work folder of " in r.stderr
           and f"pass one of its runs (the newest: {work}/" in r.stderr, "eval of a work folder names its runs", r)
    # A resume with other data keys says so; an epochs the max_steps overrides is named.
    loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=rs", "--set", "trainer.max_steps=2")
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=rs", "--resume", "auto",
             "--set", "data.seed=9", "--set", "trainer.max_steps=4", "--set", "trainer.epochs=1", "--set", "trainer.seed=12")
    expect("this run's data differs from the checkpoint's: data.seed = 9 (the checkpoint's: " in r.stderr,
           "a resume on other data says so", r)
    expect("trainer.seed = 12 (the checkpoint's: 11; it orders the samples and picks those held out for validation" in r.stderr,
           "a resume with another seed says it changes the validation samples", r)
    expect(r.stderr.count("trainer.epochs = 1 (--set) is not used: trainer.max_steps = 4 (--set) sets the run's length") == 1,
           "an epochs that max_steps overrides is named, once", r)
    # --log-level warn, error or off quiet the progress line too; a third-party callback's line is said.
    record = os.path.join(os.path.dirname(exe), "..", "tests", "models", "libloom_callback_record_callback.so")
    r = loom(exe, "train", *SMALL, "--plugin-dir", record, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=quiet",
             "--set", "trainer.max_steps=3", "--set", "trainer.callbacks=progress, record", "--log-level", "off")
    expect(r.stderr == "" and r.stdout == "", "--log-level off says nothing", r)
    r = loom(exe, "train", *SMALL, "--plugin-dir", record, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=said",
             "--set", "trainer.max_steps=3", "--set", "trainer.callbacks=progress, record")
    expect(re.search(r"step 3/3 \| loss", r.stderr) and "callback record: " in r.stderr and "callback progress:" not in r.stderr,
           "the progress line at info, and a third-party callback's description", r)
    # A callback that refuses the run before its first step: one error, and no folder that blocks the name.
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=es",
             "--set", "trainer.callbacks=progress, jsonl, checkpoint, early_stopping",
             "--set", "callback.early_stopping.metric=f1", check=False)
    expect(r.returncode == 1 and "'f1' is not a metric of this run's model" in r.stderr
           and not os.path.exists(os.path.join(work, "es")), "a run refused by a callback leaves no folder", r)
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "precision.name=fp16_amp",
             "--set", "precision.loss_scale=1e30", "--set", "trainer.max_steps=1", check=False)
    expect(r.returncode == 1 and "precision.loss_scale = 1e30 (fp16_amp) is more than float16's largest value (65504)" in r.stderr,
           "a static loss scale float16 cannot hold", r)
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "precision.name=fp16_amp",
             "--set", "precision.loss_scale=1e-10", "--set", "trainer.max_steps=1", check=False)
    expect(r.returncode == 1 and "precision.loss_scale = 1e-10 (fp16_amp) is below 1" in r.stderr,
           "a static loss scale whose gradients underflow to zero", r)
    # A run that diverges (a rate far too high, no clipping): its steps are skipped, its final
    # loss is NaN, and it ends with a failure and what to change, its files kept.
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=diverged",
             "--set", "trainer.max_steps=20", "--set", "trainer.lr=10", "--set", "trainer.clip_grad_norm=0",
             "--set", "trainer.optimizer=sgd", "--set", "optimizer.sgd.momentum=0.99", check=False)
    expect(r.returncode == 1 and "the run diverged: its final evaluation's loss is nan (" in r.stderr
           and "fp16_amp" not in r.stderr
           and os.path.isdir(os.path.join(work, "diverged", "checkpoints")), "a diverged run fails", r)
    rows = [json.loads(line) for line in open(os.path.join(work, "diverged", "metrics.jsonl"))]
    expect(any(m.get("train/grad_norm", 0) is None for m in rows if "train/loss" in m),
           f"a skipped step's gradient norm is null, not 0: {rows[-3:]}", r)
    summary = json.load(open(os.path.join(work, "diverged", "summary.json")))
    expect(summary["step"] == 20 and summary["diverged"] is True and summary["final_evaluation"]["test/loss"] == "nan",
           f"a diverged run's summary.json: {summary}", r)
    # Asked again (a requeued job's --resume auto), it fails again: not "complete".
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=diverged",
             "--set", "trainer.max_steps=20", "--set", "trainer.lr=10", "--set", "trainer.clip_grad_norm=0",
             "--set", "trainer.optimizer=sgd", "--set", "optimizer.sgd.momentum=0.99", "--resume", "auto", check=False)
    expect(r.returncode == 1 and "is trained to its step 20 and its summary.json says the run diverged" in r.stderr
           and "is complete" not in r.stderr, "a diverged run resumed at its end fails again", r)
    # A run none of whose steps updated the weights (a training loss that is never finite) ends
    # with exit 1, whatever its final evaluation says.
    models = os.path.join(os.path.dirname(exe), "..", "tests", "models", "libloom_model_metric_model.so")
    r = loom(exe, "train", *SMALL, "--plugin-dir", models, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=no_update",
             "--set", "model.name=metric_model", "--set", "model.nan_training_loss=true", "--set", "trainer.max_steps=3",
             check=False)
    expect(r.returncode == 1 and "the run learned nothing: every one of the run's 3 steps had non-finite gradients" in r.stderr,
           "a run without one update", r)
    # A metric that is NaN at the end (the model's, every evaluation batch): said, with what it costs.
    r = loom(exe, "train", *SMALL, "--plugin-dir", models, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=nan_metric",
             "--set", "model.name=metric_model", "--set", "model.nan_eval_batches=100000", "--set", "trainer.max_steps=3",
             "--set", "trainer.best_metric=correct", "--set", "memory.estimate=false", check=False)
    expect(r.returncode == 0 and "the final evaluation's correct is NaN: model 'metric_model' reported a NaN sum or counted 0 "
           "terms over its " in r.stderr and "(trainer.best_metric: no best weights come of it)" in r.stderr,
           "a NaN metric at the end is said", r)
    # In fp16_amp a short run's every step may overflow while the loss scale comes down: a warning.
    r = loom(exe, "train", *SMALL, "--plugin-dir", models, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=no_update16",
             "--set", "model.name=metric_model", "--set", "model.nan_training_loss=true", "--set", "trainer.max_steps=3",
             "--set", "precision.name=fp16_amp", check=False)
    expect("no step updated the weights: every one of the run's 3 steps had non-finite gradients, as fp16_amp's loss "
           "scale comes down" in r.stderr and "the run learned nothing" not in r.stderr, "an fp16_amp run without one update", r)
    # Weights made NaN (as an optimizer that writes NaN would): the divergence says which parameter.
    r = loom(exe, "train", *SMALL, "--plugin-dir", models, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=nan_weights",
             "--set", "model.name=metric_model", "--set", "model.nan_weights_at=3", "--set", "trainer.max_steps=6",
             "--set", "memory.estimate=false",
             "--set", "trainer.callbacks=progress", check=False)
    expect(r.returncode == 1 and "the run diverged" in r.stderr
           and "Its parameter 'linear.weight' holds NaN or infinite values, written by an update" in r.stderr,
           "a run whose weights became NaN", r)
    # Labels outside the classes the dataset declares fail in the model's loss: the dataset is named.
    labels = os.path.join(os.path.dirname(exe), "..", "tests", "nonconforming", "libloom_dataset_one_based_labels.so")
    r = loom(exe, "train", "--plugin-dir", models, "--plugin-dir", labels, "--set", f"trainer.work_dir={work}",
             "--set", "trainer.name=labels", "--set", "model.name=metric_model", "--set", "data.name=one_based_labels",
             "--set", "trainer.max_steps=2", "--set", "trainer.batch_size=4", "--set", "trainer.device=cpu",
             "--set", "precision.name=fp32", "--set", "memory.estimate=false", check=False)
    expect(r.returncode == 1 and "dataset 'one_based_labels' (targets run from 1 to 3, outside the classes 0..2 that "
           "spec().num_classes = 3 gives), in model 'metric_model'" in r.stderr, "labels outside the dataset's classes", r)
    # A dataset without training samples (an empty data folder) is refused before the memory probes
    # (which took sample i % 0: SIGFPE), in train and in loom memory.
    for command in (("train", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=empty"), ("memory", "estimate")):
        r = loom(exe, *command, "--plugin-dir", models, "--plugin-dir", labels, "--set", "model.name=metric_model",
                 "--set", "data.name=one_based_labels", "--set", "data.train_size=0", "--set", "trainer.device=cpu", check=False)
        expect(r.returncode == 1 and "dataset 'one_based_labels' says its train split has 0 samples: there is nothing to "
               "train on" in r.stderr, f"{command[0]}: a dataset without training samples", r)
    expect(not os.path.exists(os.path.join(work, "empty")), "a refused run leaves no run folder", work)
    # A batch without the field its spec declares, met by the set-up's memory probe: the dataset is
    # named (it was "model 'metric_model': map::at").
    r = loom(exe, "train", "--plugin-dir", models, "--plugin-dir", labels, "--set", f"trainer.work_dir={work}",
             "--set", "trainer.name=no_target", "--set", "model.name=metric_model", "--set", "data.name=one_based_labels",
             "--set", "data.no_target=true", "--set", "trainer.device=cpu", check=False)
    expect(r.returncode == 1 and re.search(r"dataset 'one_based_labels': get_batch of \d+ samples gave field 'y' not at all; its "
                                           r"spec\(\) says Long", r.stderr), "a probe's batch is checked against the spec", r)
    # A model built for fewer classes than the data has is refused as it is built, by its option.
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=fewer_classes",
             "--set", "data.classes=4", "--set", "model.num_classes=3", check=False)
    expect(r.returncode == 1 and "model.num_classes 3 is fewer than the 4 classes of the data" in r.stderr
           and "set it to 0 (the data's) or at least 4" in r.stderr, "a model of fewer classes than the data", r)
    # One training sample: none is held out (holding it out left nothing to train on, and the
    # loader trained on the validation sample).
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=one_sample",
             "--set", "data.train_size=1", "--set", "trainer.batch_size=1", "--set", "trainer.max_steps=2",
             "--set", "trainer.eval_every=1")
    expect("the training split has 1 sample: none is held out for validation" in r.stderr
           and "validation step" not in r.stderr and "1 train (no validation" in r.stderr, "one training sample", r)
    # The same where early stopping ended it: the resume stops again at once, evaluating nothing,
    # and the verdict recorded at the stop stands. The run above's schedule (20 steps), so the same
    # updates: its weights blow up to large finite values whose gradients are non-finite from step
    # 8 on (skipped: the weights stay), and whose loss is NaN on the evaluation above. (At 40 steps
    # the updates differ and the weights they stop at gave a finite validation loss of 4.8e11 with
    # ATen and oneDNN held to SSE4 kernels, NaN with AVX-512 ones: whether the layer norm's
    # variance overflows is the kernel's.)
    diverging = ("--set", f"trainer.work_dir={work}", "--set", "trainer.name=diverged_es", "--set", "trainer.max_steps=20",
                 "--set", "trainer.lr=10", "--set", "trainer.clip_grad_norm=0", "--set", "trainer.optimizer=sgd",
                 "--set", "optimizer.sgd.momentum=0.99", "--set", "trainer.eval_every=5",
                 "--set", "trainer.callbacks=progress, jsonl, checkpoint, early_stopping, memory_summary",
                 "--set", "callback.early_stopping.metric=loss", "--set", "callback.early_stopping.patience=1")
    r = loom(exe, "train", *SMALL, *diverging, check=False)
    summary = json.load(open(os.path.join(work, "diverged_es", "summary.json")))
    expect(r.returncode == 1 and "the run diverged" in r.stderr and summary["step"] < 20 and summary["diverged"] is True
           and summary["stopped_early"].startswith("early_stopping: validation loss has not improved"),
           f"a diverged run early stopping ended: {summary}", r)
    expect("memory estimate: predicted peak" in r.stderr, "the estimate checked against the run's peak", r)
    r = loom(exe, "train", *SMALL, *diverging, "--resume", "auto", check=False)
    expect(r.returncode == 1 and "the run diverged: its final evaluation's loss is nan" in r.stderr,
           "a diverged run that early stopping ended, resumed", r)
    # (no step trained: no peak of a step to check the estimate against; it said "error +341.0 %")
    expect("memory estimate: predicted peak" not in r.stderr, "a resume that trained no step checks no estimate", r)
    # Started as one of several processes (torchrun's or `loom launch`'s variables) with a strategy
    # that trains alone: refused, as each process would train the whole model by itself. Under
    # Slurm's variables (an sbatch script around one process) a warning only.
    ranked = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=2", env=ranked,
             check=False)
    expect(r.returncode == 1 and "this process is rank 1 of 2 (torchrun's variables), but parallel strategy 'single' "
           "trains alone" in r.stderr and "Set parallel.name=ddp" in r.stderr, "a lone strategy under torchrun", r)
    r = loom(exe, "eval", best, env=ranked, check=False)  # a process of such a job may evaluate
    expect(r.returncode == 0 and "accuracy" in r.stderr, "eval under torchrun's variables", r)
    slurm = dict(os.environ, SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0", MASTER_ADDR="127.0.0.1")
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=2", env=slurm)
    expect("rank 0 of 4 (slurm's variables)" in r.stderr and "done" in r.stderr, "a lone strategy under Slurm", r)
    # More threads than cores: a warning, and the run trains. (Past `ulimit -u`: TrainerThreads;
    # the kernel holds root, who runs CI here, to no such limit.)
    many = (os.cpu_count() or 1) + 1
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.max_steps=2",
             "--set", f"trainer.threads={many}")
    expect(f"trainer.threads = {many} on a machine with" in r.stderr and "done" in r.stderr, "more threads than cores", r)
    # a run folder is its newest checkpoint; a step folder with the slash a shell adds, or a file in
    # it, is that step folder
    for given in (os.path.join(work, "ev"), os.path.join(work, "ev", "checkpoints", "step_00000010") + "/",
                  os.path.join(work, "ev", "checkpoints", "step_00000010", "state.json")):
        r = loom(exe, "eval", given, check=False)
        expect(r.returncode == 0 and "step_00000010: accuracy" in r.stderr, f"eval {given}", r)
    # A finished run resumed again (a requeued job): it says it is complete and trains nothing, exit 0.
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev",
             "--set", "trainer.max_steps=10", "--resume", "auto")
    expect("run ev is complete: its checkpoint is at step 10 of 10; nothing to train" in r.stderr, "a complete run", r)
    # `--resume auto` alone continues the run as it was given (it took this command's defaults: the
    # default model, refused, or a 30-step run resumed as 2947 steps of other data).
    r = loom(exe, "train", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev", "--resume", "auto")
    expect(f"resume = auto: as {os.path.join(work, 'ev')} was given (its config.json), where this command leaves them out: "
           in r.stderr and "trainer.max_steps = 10" in r.stderr and "data.synthetic.train_size = 2048" in r.stderr
           and "run ev is complete: its checkpoint is at step 10 of 10; nothing to train" in r.stderr,
           "--resume auto with the run's own settings", r)
    r = loom(exe, "config", "show", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev", "--resume", "auto",
             "--set", "trainer.max_steps=12")
    expect(re.search(r"max_steps = 12 +# --set\n", r.stdout) and re.search(r"flavour = debug +# the run's config.json \(model 'lightweight_transformer'\)\n", r.stdout)
           and re.search(r"name = ev +# --set\n", r.stdout), "config show --resume auto: the run's settings, and the command's", r)
    # ... and --resume commented out: a file saved from it, "for a new run like it", continued the old run in place.
    expect(re.search(r"\n# resume = auto +# --resume: which run this command continues, left out of a file", r.stdout)
           and not re.search(r"\nresume = ", r.stdout), "config show --resume auto: the resume line is commented out", r)
    # A rate a resume gave after the checkpoint (its steps killed before the next one: its config.json
    # says 0.05, the record of the steps up to the checkpoint 0.002): a bare --resume auto takes 0.05
    # from config.json, and "leave these out of the command" would be false: the command gave none.
    shutil.copytree(os.path.join(work, "ev"), os.path.join(work, "ev_rate"))  # (ev stays as it is for what follows)
    record = os.path.join(work, "ev_rate", "config.json")
    shutil.copy(record, os.path.join(work, "ev_rate", "config.until_step_10.json"))
    text = json.load(open(record))
    text["trainer.lr"] = {"value": "0.05", "origin": "--set"}  # (as the resume that gave it recorded it)
    json.dump(text, open(record, "w"))
    r = loom(exe, "train", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev_rate", "--set",
             "trainer.max_steps=11", "--resume", "auto")
    expect(re.search(r"trainer.lr 0.002 -> 0.05 \(the run's config.json\)\. To go on as it was, give the -c files and --set "
                     r"of the run's first command", r.stderr), "a resume's own rate, taken from config.json, is not the command's", r)
    # --allow-precision-change is a permission for the resume that gives it: the next resume of the
    # run does not take it from config.json (each later one changed the precision with a warning).
    text = json.load(open(record))
    text["precision.allow_precision_change"] = {"value": "true", "origin": "--allow-precision-change"}
    json.dump(text, open(record, "w"))
    r = loom(exe, "config", "show", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev_rate", "--resume", "auto")
    expect(re.search(r"allow_precision_change = false +# default\n", r.stdout) and "lr = 0.05" in r.stdout,
           "a resume takes the run's settings but not its permission to change the precision", r)
    # A batch from a -c file, in a `-c F --resume auto`: the warning names where it came from.
    shutil.copytree(os.path.join(work, "ev"), os.path.join(work, "ev_batch"))
    batch_file = os.path.join(work, "batch16.ini")
    with open(batch_file, "w") as f:
        f.write("[trainer]\nbatch_size = 16\n")
    r = loom(exe, "train", "-c", batch_file, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev_batch",
             "--set", "trainer.max_steps=11", "--resume", "auto")
    expect(f"the checkpoint was trained with global batch 32, this run uses 16 (trainer.batch_size from {batch_file}:2)"
           in r.stderr, "a resume at another batch names where the batch came from", r)
    # Settings taken from the newest run whose checkpoints cannot be loaded are not an older run's:
    # refused, before anything is written (the older run trained with the newer one's rate and data).
    two = os.path.join(work, "two")
    for run, more in (("older", ["--memory-fraction", "0.9", "--set", "memory.policies=vram_tiers"]),
                      ("newer", ["--set", "trainer.lr=0.01", "--set", "model.dropout=0.2"])):
        loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={two}", "--set", f"trainer.name={run}",
             "--set", "trainer.max_steps=2", *more)
        time.sleep(1.1)  # (the newest by its files' times)
    # A memory fraction and the policies given with it are the run's (the record's full key did not
    # add fraction_cap, and the list, recorded as automatic, was left out: the cap was lost).
    r = loom(exe, "config", "show", "--set", f"trainer.work_dir={two}", "--set", "trainer.name=older", "--resume", "auto")
    expect(re.search(r"policies = fraction_cap, vram_tiers +# the run's config.json\n", r.stdout)
           and re.search(r"fraction = 0.9 +# the run's config.json", r.stdout)
           and re.search(r"\ndevice = auto +# default\n", r.stdout), "config show --resume auto: the memory fraction kept, the device this machine's", r)
    for f in glob.glob(os.path.join(two, "newer", "checkpoints", "step_*", "model.safetensors")):
        with open(f, "r+b") as damaged:
            damaged.truncate(100)
    before = sorted(os.listdir(os.path.join(two, "older")))
    r = loom(exe, "train", "--set", f"trainer.work_dir={two}", "--resume", "auto", "--set", "trainer.max_steps=3", check=False)
    expect(r.returncode == 1 and f"no checkpoint of {os.path.join(two, 'newer')} can be loaded" in r.stderr
           and "To continue it with its own settings, name it: --set trainer.name=older" in r.stderr
           and sorted(os.listdir(os.path.join(two, "older"))) == before, "resume = auto past a damaged newest run", r)
    # The command's own error stays its own (it was put down to the run's settings).
    r = loom(exe, "config", "show", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev", "--resume", "auto",
             "--set", "model.name=nope", check=False)
    expect(r.returncode == 1 and "no model 'nope'" in r.stderr and "resume = auto takes" not in r.stderr,
           "config show --resume auto: the command's own error", r)
    # The same epochs from the same -c file is the run's own: the run's max_steps stays (it trained 42 steps).
    ini = os.path.join(work, "three.ini")
    with open(ini, "w") as f:
        f.write("[trainer]\nepochs = 3\n")
    loom(exe, "train", "-c", ini, *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=three",
         "--set", "trainer.max_steps=2")
    r = loom(exe, "config", "show", "-c", ini, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=three",
             "--resume", "auto")
    expect(re.search(r"max_steps = 2 +# the run's config.json\n", r.stdout), "config show -c FILE --resume auto", r)
    # An option given short is the command's (the run's full key won over it); the command's epochs
    # sets the length alone (the run's max_steps would override it).
    r = loom(exe, "config", "show", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev", "--resume", "auto",
             "--set", "data.train_size=1024", "--set", "trainer.epochs=2")
    expect(re.search(r"train_size = 1024 +# --set", r.stdout) and "written two ways" not in r.stderr
           and re.search(r"max_steps = 0 +# default\n", r.stdout) and re.search(r"epochs = 2 +# --set\n", r.stdout),
           "config show --resume auto: a short key and the length are the command's", r)
    summary_file = os.path.join(work, "ev", "summary.json")
    summary = json.load(open(summary_file))
    expect(summary["step"] == 10 and summary["diverged"] is False and summary["final_evaluation"]["test/loss"] > 0
           and "test/accuracy" in summary["final_evaluation"] and "test_evaluation" not in summary,
           f"a run's summary.json: {summary}", r)
    kept = open(summary_file).read()
    with open(summary_file, "w") as f:
        f.write("{\"step\": 10, \"final_evaluation\": ")  # (cut short)
    r = loom(exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.name=ev",
             "--set", "trainer.max_steps=10", "--resume", "auto")
    expect("summary.json is not a run summary Loom can read" in r.stderr and "run ev is complete" in r.stderr,
           "a damaged summary.json", r)
    with open(summary_file, "w") as f:
        f.write(kept)
    # eval reads the weights and state.json: a step folder copied without optimizer.safetensors, or
    # with it damaged, evaluates (state.json unchecked, said); a changed state.json beside a good
    # optimizer.safetensors is still refused.
    step = os.path.join(work, "ev", "checkpoints", "step_00000010")
    bare = os.path.join(work, "bare", "step_00000010")
    shutil.copytree(step, bare, ignore=shutil.ignore_patterns("optimizer.safetensors"))
    r = loom(exe, "eval", bare, check=False)
    expect(r.returncode == 0 and "step_00000010: accuracy" in r.stderr and "has no optimizer.safetensors" in r.stderr,
           "eval without optimizer.safetensors", r)
    with open(os.path.join(bare, "optimizer.safetensors"), "wb") as f:
        f.write(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # a header that ends early: damaged
    r = loom(exe, "eval", bare, check=False)
    expect(r.returncode == 0 and "cannot be checked" in r.stderr, "eval with a damaged optimizer.safetensors", r)
    shutil.copy(os.path.join(step, "optimizer.safetensors"), bare)
    with open(os.path.join(bare, "state.json"), "a") as f:
        f.write(" ")
    r = loom(exe, "eval", bare, check=False)
    expect(r.returncode == 1 and "it changed after Loom wrote it" in r.stderr, "eval with a changed state.json", r)
    os.remove(os.path.join(bare, "optimizer.safetensors"))  # unchecked now: its fields still are
    with open(os.path.join(bare, "state.json")) as f:
        state = json.load(f)
    state["format"] = 999
    with open(os.path.join(bare, "state.json"), "w") as f:
        json.dump(state, f)
    r = loom(exe, "eval", bare, check=False)
    expect(r.returncode == 1 and "has state format 999; this Loom reads format 1" in r.stderr,
           "eval of a state.json of another format", r)
    # Plugins that crash, exit or hang while loading take no command down: each is refused by
    # name (the scanner's child process), and a run that does not use them trains.
    crashing = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(exe))), "tests", "crashing")
    if os.path.isdir(crashing):
        env = dict(os.environ, LOOM_CACHE=os.path.join(work, "cache"), LOOM_PLUGIN_SCAN_TIMEOUT="3")
        r = loom(exe, "plugins", "--plugin-dir", crashing, env=env)
        # (Under AddressSanitizer the segfault is reported by its handler, which exits with 1.)
        expect("crashed with SIGSEGV" in r.stdout or "exit status 1 while loading" in r.stdout,
               "loom plugins names the plugin that segfaults", r)
        for what in ("crashed with SIGABRT", "exit status 3", "did not finish loading within 3 s"):
            expect(what in r.stdout, f"loom plugins names the plugin that {what}", r)
        # A component name another plugin has: every run refuses one of the two, so inspect and
        # check say so, whichever of the two the search path's scan took.
        test_plugins = os.path.join(os.path.dirname(crashing), "plugins")
        good, twin = (os.path.join(test_plugins, f) for f in ("libloom_dataset_basic_counting.so",
                                                                  "libloom_dataset_broken_duplicate.so"))
        if os.path.exists(good) and os.path.exists(twin):
            r = loom(exe, "plugins", "inspect", good, "--plugin-dir", twin, env=env, check=False)
            expect(r.returncode == 1 and f"clash:   dataset 'counting' is also provided by {twin}" in r.stdout
                   and "status:    accepted alone; clashes with another plugin on the search path (below)" in r.stdout,
                   "inspect names the other plugin of a component's name", r)
            r = loom(exe, "plugins", "check", twin, "--plugin-dir", good, env=env, check=False)
            expect(r.returncode == 1 and f"FAIL  unique name: dataset 'counting' is also provided by {good}" in r.stdout,
                   "check fails a component's name another plugin has", r)
        # inspect and check load one file, through the scanner too: refused by name, no crash.
        for verb in ("inspect", "check"):
            r = loom(exe, "plugins", verb, os.path.join(crashing, "libloom_dataset_crashing_init_abort.so"), env=env,
                     check=False)
            expect(r.returncode == 1 and "crashed with SIGABRT while loading in the scanner" in r.stdout,
                   f"plugins {verb} of a plugin that aborts names it", r)
        r = loom(exe, "train", "-c", os.path.join(configs, "debug.ini"), "--plugin-dir", crashing,
                 "--set", "trainer.max_steps=2", "--set", f"trainer.work_dir={work}", "--set", "trainer.name=beside",
                 "--set", "trainer.device=cpu", env=env)
        expect("done" in r.stderr, "a run beside crashing plugins trains", r)
    # A malformed PyTorch allocator setting fails an assert in libc10_cuda's start-up, before main:
    # every command, --help included, ended in "terminate called after throwing" and a backtrace.
    # (where this wheel's PyTorch reads it later, python's import survives and loom may run: no error is due)
    garbage = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="garbage")
    python_aborts = subprocess.run([sys.executable, "-c", "import torch"], env=garbage, capture_output=True).returncode != 0
    r = loom(exe, "doctor", env=garbage, check=False)
    expect("terminate called" not in r.stderr and r.returncode in (0, 1)
           and (not python_aborts or r.returncode == 1 and "loom: could not start: " in r.stderr
                and "PYTORCH_CUDA_ALLOC_CONF = 'garbage': PyTorch's allocator reads it as it loads" in r.stderr),
           "a malformed PYTORCH_CUDA_ALLOC_CONF is one clear error", r)
    # A report that cannot be written (a closed stdout; a full disk) is a failure, said: it ended
    # with status 0 and nothing on stderr.
    r = subprocess.run([exe, "doctor"], capture_output=False, stdout=None, stderr=subprocess.PIPE, text=True,
                       preexec_fn=lambda: os.close(1))
    expect(r.returncode == 1 and "loom: could not write to the standard output" in r.stderr
           and "what the command printed there is incomplete" in r.stderr, "a closed stdout fails the command, said", r)
    # Plugins whose code ends the process once created (the scanner creates nothing): a factory's
    # exit(0) made `loom train` succeed having done nothing; an abort() in one component of
    # `loom plugins check` lost the report of every component, without a word.
    ending = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(exe))), "tests", "ending",
                          "libloom_callback_ending.so")
    expect(os.path.exists(ending), f"the test plugin {ending} is built")
    env = dict(os.environ, LOOM_CACHE=os.path.join(work, "cache"))
    r = loom(exe, "train", "-c", os.path.join(configs, "debug.ini"), "--plugin-dir", ending,
             "--set", "trainer.callbacks=progress,exits_on_create", "--set", "trainer.max_steps=2",
             "--set", f"trainer.work_dir={work}", "--set", "trainer.name=exits", env=env, check=False)
    expect(r.returncode == 1 and "loom: a plugin (or a library) ended the process with exit() before the command finished, while "
           f"creating callback 'exits_on_create' of {ending}" in r.stderr
           and "the exit status is 1, whatever the plugin gave" in r.stderr,
           "a plugin's exit(0) fails the command, naming the component", r)
    # The same in a callback's hook named it by the pc line's file only.
    r = loom(exe, "train", "-c", os.path.join(configs, "debug.ini"), "--plugin-dir", ending,
             "--set", "trainer.callbacks=progress,aborts_at_run_begin", "--set", "trainer.max_steps=2",
             "--set", f"trainer.work_dir={work}", "--set", "trainer.name=aborts", env=env, check=False)
    expect(r.returncode != 0 and "while running callback 'aborts_at_run_begin' (on_run_begin)" in r.stderr,
           "a crash in a callback's hook names the callback and the hook", r)
    # Each check in a child process: the abort(), the exit(0) and the hang each fail their check,
    # named, and the components after them are still checked.
    check_tmp = os.path.join(work, "check_tmp")
    os.makedirs(check_tmp)
    r = loom(exe, "plugins", "check", ending, "--check-timeout", "5", env=dict(env, TMPDIR=check_tmp), check=False)
    expect(os.listdir(check_tmp) == [], f"plugins check leaves nothing in TMPDIR after a check crashed: {os.listdir(check_tmp)}")
    expect(r.returncode == 1 and "callback 'fine'\n  pass  create" in r.stdout
           and "callback 'aborts_at_run_begin'\n  pass  create\n" in r.stdout
           and "crashed the process running it with SIGABRT (Aborted; its crash report is above, on stderr); its other "
               "checks did not run" in r.stdout
           and "loom: crashed with SIGABRT (abort()" in r.stderr and "of callback 'aborts_at_run_begin'" in r.stderr
           and "callback 'exits_on_create'\n  FAIL  create: ended the process running it with exit status 1 (exit() in "
               "the plugin's code?)" in r.stdout
           and "callback 'hangs_on_create'\n  FAIL  create: did not finish within 5 s (does it hang? --check-timeout "
               "SECONDS gives each check longer)" in r.stdout
           and "callback 'kills_its_group'\n  FAIL  create: ended the process running it by SIGTERM (Terminated)" in r.stdout
           and re.search(r"\n\d+ checks: \d+ passed, 4 failed, \d+ skipped\n$", r.stdout),
           "plugins check fails a check that aborts, exits, hangs or signals its group, names it, and checks the "
           "components after it", r)
    # The parent stopped alone (a CI job's cancel, Python's timeout: a signal to the one pid, or
    # SIGKILL): the process running the hanging check went on for ever, spinning or waiting.
    def check_children(parent):
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if re.search(rb"LOOM_INTERNAL_CHECK_CHILD=\d+:%d:" % parent, f.read()):
                        found.append(pid)
            except OSError:
                pass
        return found
    for sig in (signal.SIGINT, signal.SIGKILL):
        p = subprocess.Popen([exe, "plugins", "check", ending, "--check-timeout", "600"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while time.time() < deadline and not any(check_children(p.pid)):
            time.sleep(0.2)
        time.sleep(8)  # (into the hanging constructor: the components before it take a few seconds)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        time.sleep(1)
        expect(not check_children(p.pid) and p.returncode == (130 if sig == signal.SIGINT else -signal.SIGKILL)
               and (sig == signal.SIGKILL or "loom plugins check: stopped by SIGINT during the checks of callback" in err),
               f"plugins check stopped by {signal.Signals(sig).name} leaves no process running its checks",
               subprocess.CompletedProcess(p.args, p.returncode, out, err))
    r = loom(exe, "plugins", "check", ending, "--check-timeout", "0.5", env=env, check=False)
    expect(r.returncode == 1 and "--check-timeout 0.5: give the seconds one check may take, from 1 to 86400" in r.stderr,
           "a check timeout under a second is refused", r)
finally:
    shutil.rmtree(work, ignore_errors=True)
print("cli test passed")
