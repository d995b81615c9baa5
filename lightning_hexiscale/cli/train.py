"""`hexiscale train`: plan on the cluster, print the plan, train a LLaMA with the hexiscale strategy.

    hexiscale train                                  # discovers this machine (cached), plans, trains llama_demo
    hexiscale train cluster=cpu_demo                 # the demo: 4 CPU processes emulate cpu_demo, llama_demo
    hexiscale train trainer.max_steps=200 trainer.precision=bf16-mixed
    hexiscale train data.kind=text data.path=book.txt # a local text file, byte tokens
    hexiscale train cluster=hetero3 model=llama_30b   # plans; says what hardware it needs
    hexiscale train cluster=hetero3 model=llama_30b dry_run=true   # only plans, anywhere
    hexiscale train -m cluster=cpu2,cpu_hetero4 train.global_batch=8,16
    hexiscale train model=hf:/models/Llama-3.2-1B data.kind=bin data.path=data/train.bin  # fine-tune

A Hydra app: the config is the package's presets (``lightning_hexiscale/conf``: cluster, model, train,
planner groups) plus ``trainer.*`` and ``data.*`` (:mod:`lightning_hexiscale.config.recipe`),
``plan=<file>`` and ``dry_run``; ``-m`` sweeps, ``--cfg job`` prints the composed config. ``cluster``
defaults to ``auto``: the job discovers this machine's cluster first and caches it
(:mod:`lightning_hexiscale.cli.train_discover`); ``cluster=<preset or file>`` skips discovery.
``recipes/train.py`` runs the same app under its own name. The job itself is
:func:`lightning_hexiscale.cli.train_run.run`; this module maps its outcome to exit statuses.

Exit status: 0 trained (or planned, with dry_run); 2 bad configuration (one message naming the key,
value, rule and fix); 3 the plan needs hardware this machine does not have; 4 training stopped (a
non-finite step with ``trainer.nonfinite=stop``, or a rank failed); 5 an elastic worker stopped on
SIGTERM after saving, for torchrun to restart it (a machine joins or leaves; not a failure); 130
interrupted (Ctrl-C); 143 terminated (SIGTERM) during training; 1 any other error.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence

from lightning_hexiscale.cli.common import notice_printer, subcommand, version_line
from lightning_hexiscale.cli.train_hydra import check_hydra_overrides
from lightning_hexiscale.cli.train_job import (AUTO_ENV, FILES_ENV, HEXISCALE, AppName, is_multirun, is_popen_child,
                                               is_rank_zero, not_run_line, prepare_argv, print_file_config, sweep_point)
from lightning_hexiscale.errors import ElasticStop, HexiScaleError, TrainingFailure, TrainingInterrupted

EXIT_CONFIG, EXIT_HARDWARE, EXIT_FAILED, EXIT_RESTART, EXIT_INTERRUPTED, EXIT_TERMINATED = 2, 3, 4, 5, 130, 143

HELP_FLAGS = ("-h", "--help")

USAGE = """usage: {prog} [-m] [--cfg job] [--version] [KEY=VALUE ...]

Plan on the cluster, print the plan and its estimate, and train a LLaMA with Lightning's Trainer and
the hexiscale strategy. A Hydra app: every key of the config can be overridden.

cluster defaults to auto: discovered and cached (one rank per CUDA GPU, else 4 CPU processes; reused
while the hardware, model, precision and torch are the same); pass cluster=<preset or file> to skip
discovery.

examples:
  {prog}                                   discover this machine (cached), plan and train llama_demo
  {prog} cluster=cpu_demo                  the demo: 4 CPU processes emulate cpu_demo, llama_demo
  {prog} trainer.max_steps=200 trainer.precision=bf16-mixed
  {prog} data.kind=text data.path=book.txt  a local text file, byte tokens
  {prog} cluster=hetero3 model=llama_30b dry_run=true   plan only, on any machine
  {prog} cluster=my_cluster.yaml            a cluster file (e.g. from `hexiscale profile`)
  {prog} model=hf:/models/Llama-3.2-1B data.kind=bin data.path=train.bin   fine-tune
  {prog} -m cluster=cpu2,cpu_hetero4 train.global_batch=8,16   a sweep, one run per point

presets (`hexiscale list` describes them):
{presets}

keys (defaults; `{prog} --cfg job` prints the whole composed config):
{keys}
  cluster=auto  the default: discover this machine's cluster for the model and precision first (cached
                under $HEXISCALE_CACHE_DIR; one rank per CUDA GPU, else 4 CPU processes), then plan on
                it; not under torchrun/SLURM or in -m sweeps (there: hexiscale discover, cluster=FILE)
  plan=FILE     a plan file instead of the search's plan
  dry_run=true  plan, print and write the plan, do not train
  hydra.run.dir=DIR   where the run writes plan.yaml, config.yaml, checkpoints/, logs/

Hydra: -m/--multirun sweeps, --cfg job|hydra|all, --info, --hydra-help; --config-dir DIR adds presets of
your own (DIR/cluster/NAME.yaml is cluster=NAME; a name the package has keeps the package's).

exit status: 0 trained (or planned); 2 bad configuration; 3 the plan needs hardware this machine does
not have; 4 training stopped (non-finite step, failed rank); 5 elastic restart; 130 Ctrl-C;
143 SIGTERM during training; 1 other.
"""


def help_text(prog: str = HEXISCALE.prog) -> str:
    """The ``--help`` page: usage, examples, the presets of each group and the trainer/data keys."""
    import textwrap

    from lightning_hexiscale.config.schema import compose, preset_names

    presets = "\n".join(textwrap.fill(", ".join(preset_names(g)), width=100, initial_indent=f"  {g + '=':10s}",
                                      subsequent_indent=" " * 12) for g in ("cluster", "model", "train", "planner"))
    cfg = compose([])

    def value(v) -> str:  # as an override is written: null / true, not Python's None / True (Hydra reads "None" as text)
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    def leaves(node, prefix: str) -> list[str]:  # trainer.fast_path.* too: every key one can override
        return [x for k, v in node.items()
                for x in (leaves(v, f"{prefix}{k}.") if hasattr(v, "items") else [f"{prefix}{k}={value(v)}"])]

    keys = [textwrap.fill("  ".join(leaves(cfg[node], node + ".")), width=100, initial_indent="  ", subsequent_indent="  ")
            for node in ("train", "planner", "trainer", "data")]
    return USAGE.format(prog=prog, presets=presets, keys="\n".join(keys))


class _Job:
    """One invocation's state shared by the Hydra task and the Ctrl-C handling of :func:`main`."""

    def __init__(self, app: AppName, launch_argv: list[str]):
        from lightning_hexiscale.lightning.launch.job_watch import JobWatch

        self.app = app
        self.launch_argv = launch_argv
        # the job's phase, its output directory and its Ctrl-C handling (lightning/launch/job_watch.py)
        self.watch = JobWatch(app.prog, quiet=not is_rank_zero())
        self.statuses: list[int] = []
        self.sweep_argv: list[str] = []
        """The overrides Hydra parses (a ``-m`` sweep's swept values among them)."""

    def say(self, line: str) -> None:
        """The job's one closing line (once, whoever ends the job: this or the watch's thread)."""
        self.watch.say(line)

    def task(self, cfg) -> int:
        """Hydra's task function: one run (one point of a sweep) and its exit status."""
        from lightning_hexiscale.cli.train_plan import HardwareMissing
        from lightning_hexiscale.cli.train_run import run

        # Hydra has parsed its argv; the popen launcher re-runs this process's argv for each rank.
        sys.argv = self.launch_argv
        self.watch.begin_run()  # each point of a sweep starts again: no Ctrl-C, phase or line of the last one
        # Each point prints its own warnings: Python shows a warning once per text and line (its
        # registries), so a second point with the same datasheet or plan notice printed none. Entering
        # catch_warnings invalidates those registries; leaving it puts the same filters back (a filter a
        # module added while the last point imported it stays)
        with warnings.catch_warnings():
            pass
        prog = self.app.prog
        try:
            try:
                code = run(cfg, self.watch, self.app)
            except BaseException:
                self.watch.wait_if_ending()  # the watch's thread is ending the job: its line and status
                raise
        except TrainingInterrupted as e:  # every rank stopped at the end of the same step
            resume = self.watch.last_checkpoint()
            self.say(f"{prog}: {e}" + (f" (resume with trainer.resume={resume})" if resume is not None else ""))
            code = EXIT_TERMINATED if e.signal_name == "SIGTERM" else EXIT_INTERRUPTED
        except KeyboardInterrupt:  # while planning: one line, no traceback (later phases: the watch ends the job)
            self.say(self.watch.message())
            code = EXIT_INTERRUPTED
        except SystemExit:  # Lightning ends the job with exit(1) after a KeyboardInterrupt it caught
            if not self.watch.ctrl_c.is_set():
                raise
            self.say(self.watch.message())
            code = EXIT_INTERRUPTED
        except HardwareMissing as e:
            print(f"{prog}: {e}", file=sys.stderr)
            code = EXIT_HARDWARE
        except ElasticStop:  # planned (SIGTERM: a machine joins or leaves): rank 0 said so; torchrun restarts us
            code = EXIT_RESTART
        except TrainingFailure as e:  # the same on every rank (e.g. a non-finite step with nonfinite=stop)
            print(f"{prog}: training stopped: {e}", file=sys.stderr)
            code = EXIT_FAILED
        except HexiScaleError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            code = EXIT_CONFIG
        except Exception:  # a bug or a rank's own failure: its traceback is the information, Hydra's wrapper is not
            # A KeyboardInterrupt that an import turned into another error (Ctrl-C in the main thread's
            # phases). After a graceful Ctrl-C (the ranks finish their step) the job went on: an error
            # then is a failure of its own, with its traceback, not "interrupted (Ctrl-C twice)".
            if self.watch.ctrl_c.is_set() and not self.watch.asked_to_finish:
                self.say(self.watch.message())
                self.statuses.append(EXIT_INTERRUPTED)
                return EXIT_INTERRUPTED
            import traceback

            traceback.print_exc()
            rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
            print(f"{prog}: rank {rank} failed (traceback above)", file=sys.stderr)
            code = 1
        self.statuses.append(code)
        if is_multirun() and (code in (EXIT_INTERRUPTED, EXIT_TERMINATED) or self.watch.ctrl_c.is_set()
                              or self.watch.finishing):
            # As in any Hydra app, whose KeyboardInterrupt leaves the sweep's loop: a Ctrl-C or SIGTERM
            # ends the whole sweep, not this point alone (one press per point would be needed to stop it)
            code = code if code in (EXIT_INTERRUPTED, EXIT_TERMINATED) else EXIT_INTERRUPTED
            raise SweepStopped(code, sweep_point())
        if is_multirun():
            # Until the next job begins (Hydra's own code runs in this thread), a Ctrl-C leaves the
            # sweep's loop as a KeyboardInterrupt and a SIGTERM ends it from the watch; both name the
            # jobs that will not run (before, the line was "interrupted (Ctrl-C) while finishing")
            point, swept = sweep_point(), self.sweep_argv
            self.watch.sweep_line = lambda why: (f"{prog}: {why} stopped the sweep after job #{point} ended; "
                                                 f"{not_run_line(swept, point)}")
            self.watch.set_phase("between")
        return code


class SweepStopped(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM stopped point ``point`` of a ``-m`` sweep (its checkpoint kept): the points
    after it do not run. A KeyboardInterrupt, so that it leaves Hydra's sweep loop (which catches
    ``Exception`` only) as a Ctrl-C of a plain Hydra app does."""

    def __init__(self, code: int, point: int):
        super().__init__(code, point)
        self.code, self.point = code, point


def main(argv: Sequence[str] | None = None, app: AppName = HEXISCALE, launch_prefix: Sequence[str] = ("train",)) -> int:
    """Run the app on ``argv`` (Hydra overrides and flags; default ``sys.argv[1:]``) and return its
    exit status. ``launch_prefix`` is what stands between the program and the overrides in the
    command that runs this process (``train`` for ``hexiscale train``, nothing for a script): the
    popen launcher re-runs ``sys.argv[0]``, the prefix and the overrides for every other rank."""
    import hydra

    from lightning_hexiscale.config.schema import conf_dir, register_configs
    from lightning_hexiscale.lightning.launch.job_watch import record_in_child

    argv = list(sys.argv[1 + len(launch_prefix):] if argv is None else argv)
    if any(a in HELP_FLAGS for a in argv):
        print(help_text(app.prog), end="")
        return 0
    if "--version" in argv:  # Hydra's own flag printed "Hydra 1.3.8" alone
        print(version_line())
        return 0
    program = sys.argv[0]
    job = _Job(app, [])
    # The launching process (and each torchrun/SLURM rank) watches Ctrl-C by phase; the ranks its popen
    # launcher started only record it (every rank stops at the end of the step together; before
    # training the launching process ends them)
    if is_popen_child():
        record_in_child(job.watch.ctrl_c)
    else:
        job.watch.install()
    try:
        given = list(argv)
        try:
            argv = prepare_argv(argv)
            if "LOCAL_RANK" not in os.environ:  # the launching process (popen children re-run the checked argv)
                check_hydra_overrides(argv)  # hydra.* keys, and the run's directory before Hydra creates it
            if print_file_config(given):  # --cfg job with a cluster=/model= file: the file, not the preset it replaces
                return 0
        except HexiScaleError as e:
            print(f"{app.prog}: error: {e}", file=sys.stderr)
            return EXIT_CONFIG
        except OSError as e:  # a path of the command line the OS refuses (cli.main's net, for the Hydra app)
            if e.filename is None:
                raise
            from lightning_hexiscale.cli.common import os_error_line

            print(f"{app.prog}: error: {os_error_line(e)}", file=sys.stderr)
            return EXIT_CONFIG
        register_configs()
        job.launch_argv, job.sweep_argv = [program, *launch_prefix, *argv], argv
        saved, sys.argv = sys.argv, [program, *argv]  # what Hydra parses: its flags and the overrides
        default_show = warnings.showwarning
        warnings.showwarning = notice_printer(app.prog, default_show)
        try:
            hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(job.task)()
        finally:
            sys.argv = saved
            warnings.showwarning = default_show
    except SweepStopped as e:
        why = "SIGTERM" if e.code == EXIT_TERMINATED else "Ctrl-C"
        print(f"{app.prog}: {why} stopped the sweep at job #{e.point}; {not_run_line(argv, e.point)}", file=sys.stderr,
              flush=True)
        return e.code
    except KeyboardInterrupt:  # before Hydra started the run (reading the command line)
        job.say(job.watch.message())
        return EXIT_INTERRUPTED
    finally:
        job.watch.uninstall()
        # cluster=auto and cluster=/model= files (discovered or given) are this job's: a later job of this
        # process names its own (a stale file planned a later cluster=cpu_demo on the earlier file's cluster)
        os.environ.pop(AUTO_ENV, None)
        os.environ.pop(FILES_ENV, None)
    return max(job.statuses, default=0)  # no job ran: --cfg, --info or --hydra-help printed and ended


def _configure(p: argparse.ArgumentParser) -> None:
    p.usage = "hexiscale train [-m] [--cfg job] [KEY=VALUE ...]   (`hexiscale train --help`: keys and presets)"


@subcommand("train", "plan on the cluster and train a LLaMA with Lightning (a Hydra app: overrides, -m sweeps)",
            _configure)
def cmd_train(args: argparse.Namespace) -> int:
    """Reached only through :func:`lightning_hexiscale.cli.main.main`, which hands ``hexiscale train``'s
    arguments to :func:`main` untouched (Hydra parses them, not argparse)."""
    return main(args.overrides, HEXISCALE, ("train",))
