"""Optional meta_schedule tuning (CPU) of the operators around the kernels, kept in a database folder.

Each task's default schedule (cpu_rules.py) is measured first on the same runner, and a task
takes its best tuned schedule only where that beat the default. The default schedules are not
fed to the search (meta_schedule's layout-rewrite postprocessor cannot re-apply to their
pre-packed weights). Already-scheduled kernels and tasks the database holds are never tuned;
untunable tasks are listed in untunable.json. Shapes must be static (docs/tvm.md, *Tuning (CPU)*).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import logging
import platform
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.target import Target

from ...core.errors import ConfigError
from .cpu_rules import default_schedule

# Each build batch starts fresh worker processes (importing tvm: a few seconds, far more on a
# loaded machine): beyond meta_schedule's 30 s default once the machine is busy.
BUILD_TIMEOUT_S = 300.0
UNTUNABLE = "untunable.json"  # structural hashes of tasks whose every trial failed
DEFAULTS = "defaults.json"  # per task hash: its name and the measured time of its default schedule
DEFAULT_TRIALS = 8
UNBOUNDED_TRIALS = 10_000  # trials per task when only a time budget is given
BATCH = 16  # trials per batch under a time budget, which is checked after each batch


@dataclass
class TuningSummary:
    """What a tuning run did: tasks found, reused from the database, tuned now, trials measured,
    tasks left at the default schedule because no trial of theirs ever ran, and the summed
    best time of the tuned tasks against their default schedules (from the database)."""

    tasks: int
    reused: int
    tuned: int
    measured: int
    untunable: int
    database: str
    cost_model: str
    default_us: float | None = None
    best_us: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def tune(mod: tvm.IRModule, target: Target, database_dir: str | Path, *, trials: int | None = None,
         minutes: float | None = None, progress: TextIO | None = None) -> TuningSummary:
    """Tune each unscheduled task of a prepared module (pipeline.prepare) into `database_dir`, for
    `trials` trials per task and/or `minutes` minutes in all, starting from its default schedule."""
    if target.kind.name != "llvm":
        raise ConfigError(f"tuning measures on this machine: only llvm (CPU) targets, not {target.kind.name}")
    if trials is not None and trials < 1:
        raise ConfigError(f"--trials must be a positive integer, got {trials}")
    if minutes is not None and not minutes > 0:
        raise ConfigError(f"--tune-minutes must be positive, got {minutes:g}")
    trials = trials or (UNBOUNDED_TRIALS if minutes else DEFAULT_TRIALS)
    _check_static(mod)
    stream = progress or sys.stderr
    database_dir = Path(database_dir)
    database_dir.mkdir(parents=True, exist_ok=True)
    database = ms.database.JSONDatabase(work_dir=str(database_dir))
    tasks = [t for t in ms.relax_integration.extract_tasks(mod, target)
             if not t.dispatched[0]["main"].attrs.get("tirx.is_scheduled", False)]
    untunable, defaults = _read(database_dir / UNTUNABLE), _read(database_dir / DEFAULTS)
    todo = [t for t in tasks if not _tuned(database, t) and _key(t) not in untunable]
    skipped = sum(_key(t) in untunable for t in tasks)
    reused = len(tasks) - len(todo) - skipped
    cost_model = _cost_model()
    budget = " or ".join(([f"{trials} trials"] if trials < UNBOUNDED_TRIALS else [])
                         + ([f"{minutes:g} min in all"] if minutes else []))
    print(f"tune: {len(tasks)} tasks, {reused} already in {database_dir}, {skipped} untunable, "
          f"{len(todo)} to tune x {budget} (cost model {cost_model}; logs in {database_dir / 'logs'})",
          file=stream, flush=True)
    callback = _Progress([t.task_name for t in todo], trials, stream, minutes)
    if todo:
        logger = logging.getLogger("tvm.s_tir.meta_schedule")
        # the console handler meta_schedule adds takes this logger's level: its tables go to the logs only
        logger.setLevel(logging.WARNING)
        cores = _cores(target)
        builder = _builder(cores)
        runner = ms.runner.LocalRunner()
        with _only_named_handlers(logger):
            defaults.update(_measure_defaults([t for t in todo if _key(t) not in defaults], target, builder, runner))
            (database_dir / DEFAULTS).write_text(json.dumps(defaults, indent=1, sort_keys=True) + "\n")
            with _host_intrinsics_only():
                contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
                    todo, str(database_dir), num_threads=cores)
            try:
                ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(database_dir),
                              max_trials_global=trials * len(todo), max_trials_per_task=trials,
                              num_trials_per_iter=min(trials, BATCH if minutes else 64), database=database,
                              cost_model=cost_model, builder=builder, runner=runner,
                              measure_callbacks=[*ms.MeasureCallback.create("default"), callback])
            except Exception:  # the callback's stop arrives wrapped by the FFI: tell it by the flag it set
                if not callback.stopped:
                    raise
    failed = [t for t in todo if not _tuned(database, t)]
    if failed:
        untunable.update({_key(t): t.task_name for t in failed})
        (database_dir / UNTUNABLE).write_text(json.dumps(untunable, indent=1, sort_keys=True) + "\n")
        print(f"tune: no trial ran for {', '.join(t.task_name for t in failed)}: default schedule, "
              f"not retried (listed in {database_dir / UNTUNABLE})", file=stream, flush=True)
    default_us, best_us = _gain(database, [t for t in tasks if _key(t) not in untunable], defaults)
    if best_us is not None:
        print(f"tune: tuned operators {best_us:.0f} us per forward, {default_us:.0f} us with the default "
              "schedules", file=stream, flush=True)
    return TuningSummary(len(tasks), reused, len(todo) - len(failed), callback.total, skipped + len(failed),
                         str(database_dir), cost_model, default_us, best_us)


def _builder(cores: int) -> ms.builder.LocalBuilder:
    """meta_schedule's local builder without its slow import of every tensor intrinsic in each worker
    (the CPU schedules tensorize nothing). The build function is a closure, so the worker receives
    it by value and need not import this package."""

    def build_without_intrinsics(mod, target, _params):
        from tvm.driver import build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        return build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)

    return ms.builder.LocalBuilder(max_workers=cores, timeout_sec=BUILD_TIMEOUT_S, f_build=build_without_intrinsics)


_HOST_INTRINSICS = {"x86_64": "x86", "amd64": "x86", "aarch64": "arm_cpu", "arm64": "arm_cpu", "riscv64": "riscv_cpu"}


@contextlib.contextmanager
def _host_intrinsics_only() -> Iterator[None]:
    """Import only the host architecture's tensor intrinsics, not tvm.s_tir.tensor_intrin's every
    target (slow TVMScript parsing per tuned compile), under a stand-in package that is taken back
    afterwards so a later import still loads the rest."""
    name = "tvm.s_tir.tensor_intrin"
    module = _HOST_INTRINSICS.get(platform.machine().lower())
    if name in sys.modules or module is None:
        yield
        return
    stand_in = types.ModuleType(name)
    stand_in.__path__ = list(importlib.util.find_spec(name).submodule_search_locations)
    sys.modules[name] = stand_in
    try:
        importlib.import_module(f"{name}.{module}")
        yield
    finally:
        del sys.modules[name]


def _measure_defaults(tasks, target: Target, builder, runner) -> dict[str, dict]:
    """{task hash: {"name", "us"}}: each task's default schedule measured like a trial (those that ran)."""
    candidates = [(task, sch) for task in tasks
                  if (sch := default_schedule(task.dispatched[0]["main"], target)) is not None]
    if not candidates:
        return {}
    built = builder.build([ms.builder.BuilderInput(sch.mod, target) for _, sch in candidates])
    ready = [(task, sch, b) for (task, sch), b in zip(candidates, built) if b.error_msg is None]
    futures = runner.run([ms.runner.RunnerInput(b.artifact_path, "cpu",
                                                ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True))
                          for _, sch, b in ready])
    measured = {}
    for (task, _, b), future in zip(ready, futures):
        result = future.result()
        if result.error_msg is None and result.run_secs:
            measured[_key(task)] = {"name": task.task_name, "us": _us(result.run_secs)}
        Path(b.artifact_path).unlink(missing_ok=True)
    return measured


def _best(database: ms.database.Database, task) -> ms.database.TuningRecord | None:
    """The task's fastest measured trial in the database, or None."""
    mod = task.dispatched[0]
    if not database.has_workload(mod):
        return None
    top = database.get_top_k(database.commit_workload(mod), 1)
    return top[0] if top else None


def _us(run_secs) -> float:
    return float(np.mean([float(x) for x in run_secs])) * 1e6


def _gain(database, tasks, defaults: dict[str, dict]) -> tuple[float | None, float | None]:
    """Summed time per forward (task weight x time) of the tasks' default schedules and of what
    the build uses (the better of best trial and default), in us, over the tasks whose default
    schedule was measured; None when none was."""
    default = best = 0.0
    for task in tasks:
        if _key(task) not in defaults:
            continue
        record = _best(database, task)
        ours = defaults[_key(task)]["us"]
        default += task.weight * ours
        best += task.weight * (min(ours, _us(record.run_secs)) if record is not None else ours)
    return (default, best) if default else (None, None)


def apply(mod: tvm.IRModule, target: Target, database_dir: str | Path) -> tvm.IRModule:
    """Replace each task's function by its best tuned schedule where that beat its default
    schedule (others unchanged: the default schedules fill them in)."""
    database = ms.database.JSONDatabase(work_dir=str(database_dir))
    defaults = _read(Path(database_dir) / DEFAULTS)
    winners = ms.database.MemoryDatabase()
    for task in ms.relax_integration.extract_tasks(mod, target):
        record = _best(database, task)
        default = defaults.get(_key(task))
        if record is not None and (default is None or _us(record.run_secs) < default["us"]):
            winners.commit_tuning_record(ms.database.TuningRecord(
                record.trace, winners.commit_workload(task.dispatched[0]), record.run_secs, record.target,
                record.args_info))
    with target, winners:
        return relax.transform.MetaScheduleApplyDatabase()(mod)


def _check_static(mod: tvm.IRModule) -> None:
    for param in mod["main"].params:
        dims = getattr(param.ty, "shape", None)
        if dims is None or any(not isinstance(d, tvm.tirx.IntImm) for d in dims.values):
            raise ConfigError(f"tuning needs static shapes: input {param.name} is {param.ty}; "
                              "fix its dims with --static-shape NAME:1x128")


@contextlib.contextmanager
def _only_named_handlers(logger: logging.Logger) -> Iterator[None]:
    """Detach the logger's unnamed handlers for the duration: meta_schedule's logging set-up lists
    the handlers by name and fails on an unnamed one (pytest attaches its capture handler to
    every non-propagating logger, and meta_schedule's is one after a first tuning run)."""
    unnamed = [h for h in logger.handlers if h.get_name() is None]
    for handler in unnamed:
        logger.removeHandler(handler)
    try:
        yield
    finally:
        for handler in unnamed:
            logger.addHandler(handler)


def _key(task) -> str:
    return str(tvm_ffi.structural_hash(task.dispatched[0]))


def _read(path: Path) -> dict:
    """A {task hash: ...} file of the database folder (untunable tasks, default-schedule times); {} if absent."""
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _tuned(database: ms.database.Database, task) -> bool:
    """Whether the database holds a measured trial for the task."""
    return _best(database, task) is not None


def _cost_model() -> str:
    """xgb when xgboost is installed, else random (fine for a few trials)."""
    try:
        import xgboost  # noqa: F401
    except ImportError:
        return "random"
    return "xgb"


def _cores(target: Target) -> int:
    return int(target.attrs.get("num-cores", 1))


class BudgetReached(Exception):
    """Raised by the progress callback to end meta_schedule's search at the time budget."""


@derived_object
class _Progress(PyMeasureCallback):
    """One stderr line per measured batch (task i/n, trials done, best time so far); ends the search
    (BudgetReached) once `minutes` have passed and each task has had its first batch (meta_schedule's
    scheduler hands out the first batches round-robin and cannot skip one)."""

    def __init__(self, names: list[str], trials: int, stream: TextIO, minutes: float | None = None):
        self.names, self.trials, self.stream = names, trials, stream
        self.done = [0] * len(names)
        self.best = [float("inf")] * len(names)
        self.total = 0
        self.start = time.monotonic()
        self.deadline = self.start + minutes * 60 if minutes else None
        self.stopped = False

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        if not runner_results:  # the scheduler polls tasks whose search space is used up
            return
        self.done[task_id] += len(runner_results)
        self.total += len(runner_results)
        for result in runner_results:
            if result.error_msg is None and result.run_secs:
                self.best[task_id] = min(self.best[task_id], min(float(s) for s in result.run_secs))
        best = f"best {self.best[task_id] * 1e6:.3g} us" if self.best[task_id] < float("inf") else "no valid run yet"
        of = f"/{self.trials}" if self.trials < UNBOUNDED_TRIALS else ""
        print(f"tune [{task_id + 1}/{len(self.names)}] {self.names[task_id]}: {self.done[task_id]}{of} trials, "
              f"{best} ({time.monotonic() - self.start:.0f} s)", file=self.stream, flush=True)
        if self.deadline and not self.stopped and time.monotonic() > self.deadline and all(self.done):
            # Stop by raising out of the scheduler: terminating its tasks from here raced with it
            # (a task it had already picked, or was about to terminate itself, failed its
            # "!task->is_terminated" check, and the whole tuned build with it). Every measured
            # batch is in the database already: the default callbacks before this one add it.
            self.stopped = True
            print(f"tune: time budget reached after {self.total} trials: stopping", file=self.stream, flush=True)
            raise BudgetReached(f"tuning budget reached after {self.total} trials")
