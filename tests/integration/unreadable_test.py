"""A run's folders this user cannot read: `--resume auto` refuses them, naming the folder, where it
took an unreadable newest run for none and resumed an older one past it, and an unreadable step
folder for no checkpoint, writing a new timeline over it (probe; its weights were lost).

Root reads any file: under root the commands run without the capabilities that allow it (setpriv),
as any other user's would; without setpriv there, the test is skipped."""
import hashlib
import os
import shutil
import subprocess
import sys
import time

from common import SKIP, SMALL, loom, workdir

exe = sys.argv[1]
prefix = []
if os.geteuid() == 0:
    if shutil.which("setpriv") is None:
        print("SKIP: root reads any folder, and setpriv (util-linux), which drops that, is not here")
        sys.exit(SKIP)
    caps = "-dac_override,-dac_read_search,-fowner"
    prefix = ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:  # (no CAP_SETPCAP: a container's root)
        print("SKIP: root reads any folder, and setpriv cannot drop that here")
        sys.exit(SKIP)

work = workdir()
RUN = (*SMALL, "--set", f"trainer.work_dir={work}", "--set", "trainer.eval_every=100", "--set", "trainer.checkpoint_every=2")


def as_user(*args):
    return subprocess.run([*prefix, exe, *args], capture_output=True, text=True, timeout=600)


def digest(folder):
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest() for name in sorted(os.listdir(folder))}


def expect(ok, what, r):
    if not ok:
        print(r.stdout, r.stderr, sep="\n")
        raise SystemExit(f"FAILED: {what}")
    print(f"ok: {what}")


old, new = os.path.join(work, "old"), os.path.join(work, "new")
try:
    loom(exe, "train", *RUN, "--set", "trainer.name=old", "--set", "trainer.max_steps=2")
    time.sleep(1.1)  # (file times a second apart on every file system)
    loom(exe, "train", *RUN, "--set", "trainer.name=new", "--set", "trainer.max_steps=2")
    old_step = os.path.join(old, "checkpoints", "step_00000002")
    new_step = os.path.join(new, "checkpoints", "step_00000002")
    before_old, before_new = digest(old_step), digest(new_step)

    # The newest run unreadable: refused, the older one untouched (it was resumed in its place).
    os.chmod(new, 0)
    r = as_user("train", *RUN, "--resume", "auto", "--set", "trainer.max_steps=4")
    os.chmod(new, 0o755)
    expect(r.returncode == 1 and f"resume = auto: {new} (Permission denied) cannot be read" in r.stderr
           and "it may be the newest run" in r.stderr and "--set trainer.name=NAME" in r.stderr,
           "an unreadable newest run is refused, named", r)
    expect(sorted(os.listdir(os.path.join(old, "checkpoints"))) == ["best_accuracy.safetensors", "step_00000002"]
           and digest(old_step) == before_old, "the older run is not resumed past it", r)

    # Another user's folder this user cannot read (a shared work folder) is none of its runs: passed over.
    if os.geteuid() == 0:
        theirs = os.path.join(work, "theirs")
        os.makedirs(theirs)
        os.chown(theirs, 65534, 65534)
        os.chmod(theirs, 0o700)
        r = as_user("train", *RUN, "--resume", "auto", "--set", "trainer.max_steps=2")
        expect(r.returncode == 0 and "cannot be read" not in r.stderr, "another user's unreadable folder is passed over", r)
        os.rmdir(theirs)

    # A step folder unreadable: refused, by name and by --resume auto alone; nothing written over it.
    os.chmod(new_step, 0)
    for named in (("--set", "trainer.name=new"), ()):
        r = as_user("train", *RUN, "--resume", "auto", "--set", "trainer.max_steps=4", *named)
        # (by name: a checkpoint there would be taken for none; without: it is the newest run's, which would be passed over)
        said = ": a checkpoint there would be taken for none" if named else ", and it changed after the newest run"
        expect(r.returncode == 1 and f"{new_step} (Permission denied) cannot be read{said}" in r.stderr
               and "(nothing was written)" in r.stderr, f"an unreadable step folder is refused {named}", r)
    os.chmod(new_step, 0o755)
    expect(digest(new_step) == before_new and not any(e.startswith("abandoned-") for e in os.listdir(os.path.join(new, "checkpoints"))),
           "the step folder is as it was, nothing set aside", r)

    # Readable again: the run resumes from it.
    r = as_user("train", *RUN, "--resume", "auto", "--set", "trainer.max_steps=4")
    expect(r.returncode == 0 and f"resumed from {new_step} at step 2" in r.stderr, "readable again, it resumes", r)
finally:
    for folder, mode in ((new, 0o755), (os.path.join(new, "checkpoints", "step_00000002"), 0o755)):
        if os.path.exists(folder):
            os.chmod(folder, mode)
