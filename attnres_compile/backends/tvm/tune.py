"""Optional meta_schedule tuning (CPU) of the operators around the kernels, kept in a database folder.

The module is legalized and fused first (the zero pipeline) and reshapes become views, so the
tasks are the fused operators the build will compile. Tasks whose function is already
scheduled (the depth-attention kernels, marked by lower.py) are never tuned, and neither are
tasks the database already holds records for: a second compile of the same model against
the same folder measures nothing. Tasks none of whose trials ran (a gather or take fed the
runner's random indices reads out of bounds) are listed in the folder's untunable.json and not
retried; they keep the default schedule. Tuning measures real runs, so shapes must be static.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import tvm
import tvm_ffi
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
from tvm.target import Target

from ...errors import ConfigError

# Each build batch starts fresh worker processes, and their first build imports
# tvm.s_tir.tensor_intrin (about 15-25 s of TVMScript parsing on a busy 2-core machine): far
# beyond meta_schedule's 30 s default once the machine is loaded, so every build timed out.
BUILD_TIMEOUT_S = 300.0
UNTUNABLE = "untunable.json"  # structural hashes of tasks whose every trial failed


@dataclass
class TuningSummary:
    """What a tuning run did: tasks found, reused from the database, tuned now, trials measured,
    and tasks left at the default schedule because no trial of theirs ever ran."""

    tasks: int
    reused: int
    tuned: int
    measured: int
    untunable: int
    database: str
    cost_model: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def prepare(mod: tvm.IRModule, target: Target) -> tvm.IRModule:
    """Legalize and fuse (the zero pipeline) and turn reshapes into views: the tasks to tune."""
    with target:
        mod = relax.get_pipeline("zero")(mod)
    return relax.transform.RewriteDataflowReshape()(mod)


def tune(mod: tvm.IRModule, target: Target, trials: int, database_dir: str | Path,
         progress: TextIO | None = None) -> TuningSummary:
    """Tune each unscheduled task of a prepared module for `trials` trials into `database_dir`."""
    if target.kind.name != "llvm":
        raise ConfigError(f"tuning measures on this machine: only llvm (CPU) targets, not {target.kind.name}")
    if trials < 1:
        raise ConfigError(f"--trials must be a positive integer, got {trials}")
    _check_static(mod)
    stream = progress or sys.stderr
    database_dir = Path(database_dir)
    database_dir.mkdir(parents=True, exist_ok=True)
    database = ms.database.JSONDatabase(work_dir=str(database_dir))
    tasks = [t for t in ms.relax_integration.extract_tasks(mod, target)
             if not t.dispatched[0]["main"].attrs.get("tirx.is_scheduled", False)]
    untunable = _read_untunable(database_dir)
    todo = [t for t in tasks if not _has_record(database, t.dispatched[0]) and _key(t) not in untunable]
    skipped = sum(_key(t) in untunable for t in tasks)
    reused = len(tasks) - len(todo) - skipped
    cost_model = _cost_model()
    print(f"tune: {len(tasks)} tasks, {reused} already in {database_dir}, {skipped} untunable, "
          f"{len(todo)} to tune x {trials} trials (cost model {cost_model}; logs in {database_dir / 'logs'})",
          file=stream, flush=True)
    callback = _Progress([t.task_name for t in todo], trials, stream)
    if todo:
        logger = logging.getLogger("tvm.s_tir.meta_schedule")
        # the console handler meta_schedule adds takes this logger's level: its tables go to the logs only
        logger.setLevel(logging.WARNING)
        cores = _cores(target)
        with _only_named_handlers(logger):
            contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
                todo, str(database_dir), num_threads=cores)
            ms.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(database_dir),
                          max_trials_global=trials * len(todo), max_trials_per_task=trials,
                          num_trials_per_iter=min(trials, 64), database=database, cost_model=cost_model,
                          builder=ms.builder.LocalBuilder(max_workers=cores, timeout_sec=BUILD_TIMEOUT_S),
                          measure_callbacks=[*ms.MeasureCallback.create("default"), callback])
    failed = [t for t in todo if not _has_record(database, t.dispatched[0])]
    if failed:
        untunable.update({_key(t): t.task_name for t in failed})
        (database_dir / UNTUNABLE).write_text(json.dumps(untunable, indent=1, sort_keys=True) + "\n")
        print(f"tune: no trial ran for {', '.join(t.task_name for t in failed)}: default schedule, "
              f"not retried (listed in {database_dir / UNTUNABLE})", file=stream, flush=True)
    return TuningSummary(len(tasks), reused, len(todo) - len(failed), callback.total, skipped + len(failed),
                         str(database_dir), cost_model)


def apply(mod: tvm.IRModule, target: Target, database_dir: str | Path) -> tvm.IRModule:
    """Replace every task's function by its best schedule in the database (others unchanged)."""
    database = ms.database.JSONDatabase(work_dir=str(database_dir))
    with target, database:
        return relax.transform.MetaScheduleApplyDatabase()(mod)


def _check_static(mod: tvm.IRModule) -> None:
    for param in mod["main"].params:
        dims = getattr(param.ty, "shape", None)
        if dims is None or any(not isinstance(d, tvm.tirx.IntImm) for d in dims.values):
            raise ConfigError(f"tuning needs static shapes: input {param.name} is {param.ty}; "
                              "fix its dims with --input-shape NAME:1x128")


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


def _read_untunable(database_dir: Path) -> dict[str, str]:
    """{task hash: task name} of the tasks no trial ever ran for, from earlier runs on this folder."""
    try:
        return dict(json.loads((database_dir / UNTUNABLE).read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _has_record(database: ms.database.Database, mod: tvm.IRModule) -> bool:
    return database.has_workload(mod) and bool(database.get_top_k(database.commit_workload(mod), 1))


def _cost_model() -> str:
    """xgb when xgboost is installed, else random (fine for a few trials)."""
    try:
        import xgboost  # noqa: F401
    except ImportError:
        return "random"
    return "xgb"


def _cores(target: Target) -> int:
    return int(target.attrs.get("num-cores", 1))


@derived_object
class _Progress(PyMeasureCallback):
    """One stderr line per measured batch: task i/n, trials done, best time so far."""

    def __init__(self, names: list[str], trials: int, stream: TextIO):
        self.names, self.trials, self.stream = names, trials, stream
        self.done = [0] * len(names)
        self.best = [float("inf")] * len(names)
        self.total = 0
        self.start = time.monotonic()

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results) -> None:
        if not runner_results:  # the scheduler polls tasks whose search space is used up
            return
        self.done[task_id] += len(runner_results)
        self.total += len(runner_results)
        for result in runner_results:
            if result.error_msg is None and result.run_secs:
                self.best[task_id] = min(self.best[task_id], min(float(s) for s in result.run_secs))
        best = f"best {self.best[task_id] * 1e6:.3g} us" if self.best[task_id] < float("inf") else "no valid run yet"
        print(f"tune [{task_id + 1}/{len(self.names)}] {self.names[task_id]}: {self.done[task_id]}/{self.trials} trials, "
              f"{best} ({time.monotonic() - self.start:.0f} s)", file=self.stream, flush=True)
