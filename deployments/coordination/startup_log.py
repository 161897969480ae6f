"""What the workers are doing while the service starts, on `specdec serve`'s console. Their logs
do not reach the command (`log_to_driver` is off: Ray's prefixed lines would bury the console),
so rank 0 of each worker notes its steps in a small actor that the command creates and prints
from while Serve starts the app. Started another way (`serve run`, `serve deploy`, KubeRay) no
such actor exists, and the notes go to the worker's log only."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import ray

NAME, NAMESPACE = "specdec-startup-log", "specdec"
POLL_S = 0.5
logger = logging.getLogger(__name__)
Result = TypeVar("Result")


@ray.remote(num_cpus=0)
class StartupLog:
    def __init__(self):
        self.lines: list[str] = []

    def note(self, line: str) -> None:
        self.lines.append(line)

    def since(self, index: int) -> list[str]:
        return self.lines[index:]


def note(role: str, step: str) -> None:
    """A worker's step: logged, and noted for `specdec serve`'s console when it is listening."""
    logger.info("%s worker: %s", role, step)
    try:
        log = ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:  # not started by `specdec serve`
        return
    log.note.remote(f"{role} worker: {step}")


def start_with_notes(start: Callable[[], Result], show: Callable[[str], None]) -> Result:
    """`start()` (Serve starting the app), showing each note with the seconds since it began."""
    log = StartupLog.options(name=NAME, namespace=NAMESPACE).remote()
    began, shown = time.perf_counter(), 0
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="serve-start") as pool:
            started = pool.submit(start)
            while True:
                done = started.done()  # read before the last notes, so that none is missed
                for line in ray.get(log.since.remote(shown)):
                    show(f"{time.perf_counter() - began:6.1f}s  {line}")
                    shown += 1
                if done:
                    return started.result()
                time.sleep(POLL_S)
    finally:
        ray.kill(log)
