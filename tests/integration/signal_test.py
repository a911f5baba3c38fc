"""SIGTERM, SIGINT and SIGHUP stop a run gracefully: it finishes the step it is in, writes a
checkpoint of that step, says how to continue and exits with 128 + the signal (143, 130, 129);
`--resume auto` then continues from exactly that step. A reader of its output that goes away
(SIGPIPE: `loom train | head`) stops it the same way, with its checkpoint, though nothing it
prints is read any more. A second signal ends the process at once. A crash signal gets a
report on stderr before the process dies of it."""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from common import SMALL, loom, metrics, workdir

exe = sys.argv[1]
STEPS = 100000  # far more than the test waits for
work = workdir()


def wait_for_row(proc, run, step, key, before):
    """Until the run's metrics.jsonl has `key` at `step` (polled every 10 ms; the run must still be on)."""
    deadline = time.time() + 300
    while time.time() < deadline and not any(m.get("step") == step and key in m for m in
                                              (metrics(run, partial=True) if os.path.exists(os.path.join(run, "metrics.jsonl")) else [])):
        assert proc.poll() is None, f"the run ended before {before}: " + proc.stderr.read()
        time.sleep(0.01)


def interrupt_after_line(args, marker, delay):
    """`loom ARGS`, sent SIGINT `delay` s after it logs a line holding `marker`: (its exit status, its stderr)."""
    proc = subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = []
    for line in proc.stderr:
        said.append(line)
        if marker in line:
            break
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(said) + err


args = [*SMALL, "--set", f"trainer.work_dir={work}", "--set", f"trainer.max_steps={STEPS}",
        "--set", "trainer.checkpoint_every=100000", "--set", "trainer.eval_every=100000"]


def start(name, preexec_fn=None):
    proc = subprocess.Popen([exe, "train", *args, "--set", f"trainer.name={name}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    run = os.path.join(work, name)
    deadline = time.time() + 300
    while time.time() < deadline:  # until it has logged a few steps
        if os.path.exists(os.path.join(run, "metrics.jsonl")) and len(metrics(run, partial=True)) >= 5:
            return proc, run
        if proc.poll() is not None:
            raise SystemExit("the run ended before the signal: " + proc.stderr.read())
        time.sleep(0.05)
    raise SystemExit("the run logged nothing in 300 s")


try:
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)):
        name = f"graceful_{sig.name}"
        proc, run = start(name)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == code, f"{sig.name}: exit {proc.returncode}, expected {code}\n{err}"
        assert f"stopped by {sig.name} after step" in err, err
        # the command that continues it: the same arguments (its configuration), less the name, with --resume auto
        assert f"continue with: loom train {' '.join(args)} --resume auto --set trainer.name={name}" in err, err
        step = max(m["step"] for m in metrics(run))
        saved = sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))
        assert saved == [f"step_{step:08d}"], f"{sig.name}: checkpoints {saved}, last logged step {step}"
        assert not any("val/loss" in m for m in metrics(run)), "no evaluation after a stop signal"
        print(f"{sig.name}: exit {code}, checkpoint of step {step}, the step it stopped at")

        # the suggested command itself continues it (its last three steps here)
        suggested = shlex.split(err.split("continue with: ", 1)[1].splitlines()[0])
        out = loom(exe, *suggested[1:], "--set", f"trainer.max_steps={step + 3}")
        assert f"resumed from" in out.stderr and f"at step {step}" in out.stderr, out.stderr
        steps = [m["step"] for m in metrics(run) if "train/loss" in m]
        assert steps == list(range(1, step + 4)), "every step once across the stop and the resume"

    # Started by a parent that blocks the stop signals (a job runner's mask, inherited across exec):
    # the signals stay pending for ever unless loom unblocks them. It does, once its handlers are in.
    def block_stop_signals():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    proc, run = start("blocked_mask", block_stop_signals)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit("started with SIGTERM blocked: still running 120 s after the SIGTERM")
    assert proc.returncode == 143, f"started with the stop signals blocked: exit {proc.returncode}\n{err}"
    step = max(m["step"] for m in metrics(run))
    saved = sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))
    assert saved == [f"step_{step:08d}"] and "stopped by SIGTERM after step" in err, f"{saved}\n{err}"
    print(f"started with the stop signals blocked: SIGTERM still stops it (exit 143, checkpoint of step {step})")

    # Stopped between log steps (log_every far past the steps it takes: none is read from the
    # device before the stop): the stop's line still has the rate of its step, not null.
    name = "between_log_steps"
    proc = subprocess.Popen([exe, "train", *args, "--set", f"trainer.name={name}", "--set", "trainer.log_every=99999"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = os.path.join(work, name)
    deadline = time.time() + 300
    while time.time() < deadline and not os.path.exists(os.path.join(run, "config.json")):  # the run folder opened
        assert proc.poll() is None, "the run ended before the signal: " + proc.stderr.read()
        time.sleep(0.05)
    time.sleep(1)  # some steps
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, f"SIGTERM between log steps: exit {proc.returncode}\n{err}"
    last = metrics(run)[-1]
    assert len(metrics(run)) == 1 and last["step"] < 99999, metrics(run)
    assert isinstance(last.get("train/lr"), float) and last["train/lr"] > 0, f"the stop's line: {last}"
    # (and its gradient norm: it was null, a NaN in TensorBoard, at every stop between log steps)
    assert isinstance(last.get("train/grad_norm"), float) and last["train/grad_norm"] > 0, f"the stop's line: {last}"
    assert "lr nan" not in err, err
    print(f"SIGTERM at step {last['step']} (no log step before it): its line's train/lr {last['train/lr']}, "
          f"train/grad_norm {last['train/grad_norm']}")

    # A run whose callbacks write no checkpoint: neither the stop nor its end promises one (they
    # said "with a checkpoint" and "continue with: ... --resume auto", which started over).
    name = "no_checkpoint"
    proc = subprocess.Popen([exe, "train", *args, "--set", f"trainer.name={name}", "--set", "trainer.callbacks=progress, jsonl"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = os.path.join(work, name)
    wait_for_row(proc, run, 5, "train/loss", "its step 5")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, f"SIGTERM without checkpoints: exit {proc.returncode}\n{err}"
    assert "trainer.checkpoint_every = 100000 is set, but the run writes no checkpoint" in err, err
    assert "this run writes no checkpoint (trainer.callbacks has no 'checkpoint'), so it cannot be continued" in err, err
    assert "with a checkpoint" not in err and "continue with" not in err and not os.listdir(os.path.join(run, "checkpoints")), err
    print("SIGTERM without a checkpoint callback: said so, no command to continue")

    # The reader of its output goes away: the next write raises SIGPIPE (the progress line, every
    # 5 s without a terminal), and the run stops after its step with a checkpoint, as on SIGTERM.
    proc, run = start("reader_gone")
    proc.stdout.close()
    proc.stderr.close()
    proc.wait(timeout=120)
    assert proc.returncode == 128 + signal.SIGPIPE, f"SIGPIPE: exit {proc.returncode}, expected 141"
    step = max(m["step"] for m in metrics(run))
    saved = sorted(d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith("step_"))
    assert saved == [f"step_{step:08d}"], f"SIGPIPE: checkpoints {saved}, last logged step {step}"
    print(f"SIGPIPE: exit 141, checkpoint of step {step}")

    # A closing ssh session sends SIGHUP twice (bash to its jobs, the kernel to the terminal's
    # group): still the graceful stop, not the second signal's kill.
    proc, run = start("hup_twice")
    proc.send_signal(signal.SIGHUP)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 129, f"two SIGHUPs: exit {proc.returncode}\n{err}"
    step = max(m["step"] for m in metrics(run))
    assert os.path.isdir(os.path.join(run, "checkpoints", f"step_{step:08d}")), "two SIGHUPs: a checkpoint"
    print(f"two SIGHUPs: exit 129, checkpoint of step {step}")

    # Under nohup (SIGHUP ignored on entry) a hang-up changes nothing: the run goes on.
    proc = subprocess.Popen([exe, "train", *args, "--set", "trainer.name=nohup"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    run = os.path.join(work, "nohup")
    deadline = time.time() + 300
    while time.time() < deadline and not (os.path.exists(os.path.join(run, "metrics.jsonl")) and len(metrics(run, partial=True)) >= 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert proc.poll() is None, "a run under nohup stopped on SIGHUP"
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 143, f"nohup, then SIGTERM: exit {proc.returncode}"
    print("SIGHUP under nohup: ignored; SIGTERM then stops it")

    # A signal during the final evaluation of the test split, after the last step: the evaluation
    # stops at its next batch (it ran to its end, 24 s on a large split), and the run says it is
    # complete, and that a resume runs the test evaluation alone (below: train no step again).
    name = "final_eval"
    # (the standard model, not the debug one: some 20 s for the split, not 2, so the signal lands in it)
    proc = subprocess.Popen([exe, "train", *SMALL, "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}",
                             "--set", "trainer.max_steps=3", "--set", "data.test_size=400000",
                             "--set", "model.flavour=standard"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = os.path.join(work, name)
    wait_for_row(proc, run, 3, "val/loss", "its test evaluation")
    # Past the last step's best weights and checkpoint (durable writes: milliseconds, or seconds
    # when the other test's writes hold the disk), into the test split's evaluation (about 15 s).
    deadline = time.time() + 120
    while time.time() < deadline and not os.path.isdir(os.path.join(run, "checkpoints", "step_00000003")):
        assert proc.poll() is None, "the run ended before its test evaluation: " + proc.stderr.read()
        time.sleep(0.01)
    assert os.path.isdir(os.path.join(run, "checkpoints", "step_00000003")), "no checkpoint of step 3 in 120 s"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"SIGINT in the final evaluation: exit {proc.returncode}\n{err}"
    assert "test evaluation stopped by SIGINT after" in err, err
    assert "after the last step (3 of 3): the training is complete" in err and "a resume runs it alone" in err, err
    assert not any("test/loss" in m for m in metrics(run)), "no figures from a cut evaluation"
    print(f"SIGINT in the final test evaluation: exit 130 after {time.time() - t0:.1f} s, the run complete")

    # A signal during a scheduled validation evaluation: no figures from it, the step's checkpoint
    # says it is pending, and the resume runs it first: metrics.jsonl has the step's val row, as an
    # uninterrupted run's does (best and early stopping see every evaluation).
    name = "cut_eval"
    cut = [*SMALL, "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}", "--set", "trainer.max_steps=4",
           "--set", "trainer.eval_every=3", "--set", "data.train_size=400000", "--set", "data.validation_fraction=0.5",
           "--set", "model.flavour=standard"]  # (some 10 s for the 200000 validation samples)
    proc = subprocess.Popen([exe, "train", *cut], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = os.path.join(work, name)
    wait_for_row(proc, run, 3, "train/loss", "its evaluation at step 3")
    time.sleep(0.5)  # into the validation evaluation (the step's row is written after its last check for a signal)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, f"SIGINT in a validation evaluation: exit {proc.returncode}\n{err}"
    assert "validation evaluation stopped by SIGINT after" in err and "(a resume runs it first)" in err, err
    assert not any("val/loss" in m for m in metrics(run)), "no figures from a cut evaluation"
    r = loom(exe, "train", *cut, "--resume", "auto")
    assert "the evaluation of step 3 that a stop or a failure cut short runs first" in r.stderr, r.stderr
    rows = [(m["step"], "val" if "val/loss" in m else "train" if "train/loss" in m else "test") for m in metrics(run)]
    assert rows == [(1, "train"), (2, "train"), (3, "train"), (3, "val"), (4, "train"), (4, "val"), (4, "test")], rows
    print("SIGINT in a validation evaluation: exit 130, the resume evaluates step 3 first")

    # The same at the last step: the run is trained, its validation and test split are not; the
    # stop says so, and the resume (no step left to train) runs both.
    name = "cut_last_eval"
    last = [*SMALL, "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}", "--set", "trainer.max_steps=3",
            "--set", "trainer.eval_every=3", "--set", "data.train_size=400000", "--set", "data.validation_fraction=0.5",
            "--set", "data.test_size=300000", "--set", "model.flavour=standard"]
    proc = subprocess.Popen([exe, "train", *last], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = os.path.join(work, name)
    wait_for_row(proc, run, 3, "train/loss", "its evaluation at step 3")
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "its final evaluation was cut short, and a resume runs it: " in err, err
    # (the run's end reached, its verdict not: summary.json says so; a script saw no summary at all)
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["step"] == 3 and summary["diverged"] is None and summary["final_evaluation"].startswith(
        "not run: the run was stopped (SIGINT received) before it finished; the checkpoint of step 3 holds it pending"), summary
    # The resume runs the validation first; a stop in the test's evaluation after it: the next
    # resume runs the test's alone (it ran the validation again, a second row of it).
    code, err = interrupt_after_line(["train", *last, "--resume", "auto"], "validation step 3:", 0.3)
    assert code == 130 and "the evaluation of step 3 that a stop or a failure cut short runs first" in err \
        and "its test evaluation did not run, and a resume runs it alone" in err, err[-3000:]
    r = loom(exe, "train", *last, "--resume", "auto")
    assert "is complete" not in r.stderr and "cut short runs first" not in r.stderr \
        and "the test evaluation of step 3 that a stop or a failure cut short runs now" in r.stderr, r.stderr[-3000:]
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["diverged"] is False and "test/loss" in summary["final_evaluation"], summary
    rows = [(m["step"], "val" if "val/loss" in m else "train" if "train/loss" in m else "test") for m in metrics(run)]
    assert rows == [(1, "train"), (2, "train"), (3, "train"), (3, "val"), (3, "test")], rows
    r = loom(exe, "train", *last, "--resume", "auto")  # (its checkpoint was written again without the mark)
    assert "is complete" in r.stderr and "cut short runs first" not in r.stderr, r.stderr
    assert len(metrics(run)) == 5, metrics(run)
    print("SIGINT in the last step's validation: the resume runs it, then the test split (cut: the next runs it alone); "
          "the next is complete")

    # A stop in the last step's validation after an earlier one: the final line's figures are the
    # earlier evaluation's, and it says which step's (they read as the last step's).
    name = "cut_later_eval"
    later = [*SMALL, "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}", "--set", "trainer.max_steps=4",
             "--set", "trainer.eval_every=2", "--set", "data.train_size=400000", "--set", "data.validation_fraction=0.5",
             "--set", "model.flavour=standard"]
    proc = subprocess.Popen([exe, "train", *later], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_row(proc, os.path.join(work, name), 4, "train/loss", "its evaluation at step 4")
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    done = [line for line in err.splitlines() if "done      4 steps" in line]
    assert proc.returncode == 130 and done and done[0].endswith("validation samples (at step 2)"), err[-3000:]
    print("SIGINT in the last step's validation: the final line names the step of the figures it shows")

    # A stop during the test evaluation, after the validation's: summary.json holds the validation's
    # figures and says that the test's never came (they read as the run's final evaluation).
    name = "cut_test_eval"
    cut_test = [*SMALL, "--set", f"trainer.work_dir={work}", "--set", f"trainer.name={name}", "--set", "trainer.max_steps=3",
                "--set", "trainer.eval_every=3", "--set", "data.test_size=300000", "--set", "model.flavour=standard"]
    proc = subprocess.Popen([exe, "train", *cut_test], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = os.path.join(work, name)
    wait_for_row(proc, run, 3, "val/loss", "its validation at step 3")
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert proc.returncode == 130 and "val/loss" in summary["final_evaluation"] \
        and summary.get("test_evaluation", "").startswith("not run: the run ended before it finished"), (summary, err[-2000:])
    assert "its test evaluation did not run, and a resume runs it alone: " in err and "--resume auto" in err, err[-2000:]
    print("SIGINT in the test evaluation: summary.json says the test's figures never came")
    # The resume runs the test evaluation alone (no step) and records it; the next resume finds the run complete.
    rows = len(metrics(run))
    # (a stop in that resume's test evaluation: the same again)
    code, err = interrupt_after_line(["train", *cut_test, "--resume", "auto"], "that a stop or a failure cut short runs now", 0.5)
    assert code == 130 and "its test evaluation did not run, and a resume runs it alone" in err \
        and len(metrics(run)) == rows, err[-3000:]
    r = loom(exe, "train", *cut_test, "--resume", "auto")
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert r.returncode == 0 and "the test evaluation of step 3 that a stop or a failure cut short runs now" in r.stderr, r.stderr[-3000:]
    assert "test/loss" in summary["final_evaluation"] and "test_evaluation" not in summary \
        and summary["diverged"] is False, summary
    assert [(m["step"], "test/loss" in m) for m in metrics(run)[rows:]] == [(3, True)], metrics(run)[rows:]
    r = loom(exe, "train", *cut_test, "--resume", "auto")
    assert r.returncode == 0 and "is complete" in r.stderr and len(metrics(run)) == rows + 1, r.stderr[-2000:]
    print("the resume runs the cut test evaluation alone and records it in summary.json; the next is complete")

    # A signal during set-up (the memory probes before the first step, a second or more on a large
    # micro-batch; an automatic batch search longer): set-up ends at its next probe, not after
    # them all and a first step; nothing trained, nothing left behind.
    def term_after_first_probe(name, *extra):
        """SIGTERM once the first memory probe has logged; its exit status and all it printed."""
        proc = subprocess.Popen([exe, "train", "--log-level", "debug", *SMALL, "--set", f"trainer.work_dir={work}",
                                 "--set", f"trainer.name={name}", "--set", "data.train_size=16384",
                                 "--set", "trainer.batch_size=8192", *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "probe at micro-batch" in line:
                break
        proc.send_signal(signal.SIGTERM)
        err = "".join(lines) + proc.stderr.read()
        proc.wait(timeout=120)
        assert not os.path.exists(os.path.join(work, name)), os.listdir(os.path.join(work, name))
        return proc.returncode, err

    code, err = term_after_first_probe("in_setup", "--set", "memory.estimate=true")
    assert code == 143, f"SIGTERM in set-up: exit {code}\n{err}"
    # (at the next probe, or on a loaded machine where the probes ended first, before the run folder)
    assert "stopped by SIGTERM during set-up (" in err and "no step was trained; nothing was written" in err, err
    print("SIGTERM in set-up: exit 143 before the first step, no run folder left")

    # The same through a C-tier memory policy that probes (tests/plugins/c_tier_plugin.c): the
    # host fails its probe, and ends set-up when the policy's plan returns, whatever it made of it.
    c_plugin = os.path.join(os.path.dirname(exe), "..", "tests", "models", "libloom_c_tier_test.so")
    assert os.path.exists(c_plugin), f"{c_plugin} is built with the tests (tests/plugins)"
    code, err = term_after_first_probe("in_c_setup", "--plugin-dir", c_plugin, "--set", "memory.estimate=false",
                                       "--set", "memory.policies=c_halve", "--set", "memory.c_halve.probe=true",
                                       "--set", "memory.c_halve.max=1")
    assert code == 143, f"SIGTERM in a C policy's probes: exit {code}\n{err}"
    # (its probes go from 8192 down to 2: twelve, the first the slowest)
    assert "stopped by SIGTERM during set-up (memory probes)" in err and "nothing was written" in err, err
    assert err.count("probe at micro-batch") < 12, f"the C policy probed on after the stop:\n{err}"
    print("SIGTERM in a C-tier policy's probes: exit 143, set-up ended, no run folder left")

    # A second signal: the process ends at once, by the signal's default action.
    proc, run = start("twice")
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode in (-signal.SIGINT, 130), f"second SIGINT: exit {proc.returncode}"
    print(f"two SIGINTs: exit {proc.returncode}")

    # ... but a second SIGTERM a moment after the first is the same stop (a scheduler signals every
    # process of a job, and loom launch passes its copy on): the graceful stop, with its checkpoint.
    proc, run = start("term_twice")
    first = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    apart = time.monotonic() - first  # (this process may be descheduled for seconds on a busy machine)
    proc.communicate(timeout=60)
    if apart < 1.5:
        assert proc.returncode == 143, f"SIGTERM twice {apart:.2f} s apart: exit {proc.returncode}"
        assert any(d.startswith("step_") for d in os.listdir(os.path.join(run, "checkpoints"))), "no checkpoint"
        print(f"two SIGTERMs {apart:.2f} s apart: exit 143 with a checkpoint")
    else:
        print(f"two SIGTERMs: not checked, this test sent them {apart:.2f} s apart (a busy machine)")

    # A crash signal sent from outside (kill -SEGV) is no crash: said as sent by that process, no
    # report asked for ("crashed ... at address <the sender's pid>"), and the process still dies of
    # it. (A real crash's report: cli_test's callback that aborts, checkpoint_integrity's SIGBUS.)
    proc, run = start("crash")
    proc.send_signal(signal.SIGSEGV)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGSEGV, f"SIGSEGV: exit {proc.returncode}\n{err}"
    assert f"loom: killed by SIGSEGV, which process {os.getpid()} sent (kill): no fault of its own" in err \
        and "please report it" not in err, err
    print("SIGSEGV sent from outside: said as sent by this process, then death by the signal")
finally:
    shutil.rmtree(work, ignore_errors=True)
print("signal test passed")
