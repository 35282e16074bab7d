"""The runner's compiled steps by bucket, each built once whichever thread needs it first.

A server that compiles its step buckets in the background (`JaxRunner.warmup(background=
True)`) has two threads that may want the same bucket: the background one working down its
list, and the engine's, when a step meets a bucket the list has not reached. Whoever asks
first builds it; the other waits for that build rather than compiling it a second time.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax

log = logging.getLogger(__name__)

Build = Callable[[], jax.stages.Compiled]


def return_freed_memory() -> None:
    """Hand the heap XLA's compiles freed back to the OS. glibc keeps freed pages in its
    arenas, so after compiling the step buckets a server's resident memory stayed about half
    a GiB above what it holds (bench/results/issue42_engine.md). Nothing to do off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


class Executables:
    def __init__(self) -> None:
        self._done: dict[Hashable, jax.stages.Compiled] = {}
        self._building: dict[Hashable, Future[jax.stages.Compiled]] = {}
        self._lock = threading.Lock()
        self._background: list[threading.Thread] = []

    def __contains__(self, shape: Hashable) -> bool:
        return shape in self._done

    def __len__(self) -> int:
        return len(self._done)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._done))

    def values(self) -> list[jax.stages.Compiled]:
        return list(self._done.values())

    def put(self, shape: Hashable, exe: jax.stages.Compiled) -> None:
        with self._lock:
            self._done[shape] = exe

    def get(self, shape: Hashable, build: Build) -> tuple[jax.stages.Compiled, bool]:
        """`shape`'s step, and whether this call built it: already built, being built by
        another thread (waited for), or built now by `build`."""
        with self._lock:
            exe = self._done.get(shape)
            if exe is not None:
                return exe, False
            future = self._building.get(shape)
            mine = future is None
            if mine:
                future = self._building[shape] = Future()
        if not mine:
            return future.result(), False
        try:
            exe = build()
        except BaseException as e:
            with self._lock:
                del self._building[shape]
            future.set_exception(e)
            raise
        with self._lock:
            self._done[shape] = exe
            del self._building[shape]
        future.set_result(exe)
        return exe, True

    def build_in_background(self, jobs: Sequence[tuple[Hashable, Build]], threads: int = 1) -> None:
        """Build `jobs`, taken in order by `threads` threads of their own (XLA compiles a
        program on one core). A failed build is logged and left to its first use, which
        raises it."""
        def one(job: tuple[Hashable, Build]) -> None:
            shape, build = job
            try:
                self.get(shape, build)
            except Exception:
                log.exception("background compile of step bucket %s failed", shape)

        def run() -> None:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads, thread_name_prefix="jserve-background-compile") as pool:
                list(pool.map(one, jobs))
            log.info("compiled %d step buckets in the background in %.1f s", len(jobs),
                     time.perf_counter() - t0)
            return_freed_memory()

        thread = threading.Thread(target=run, name="jserve-background-compile", daemon=True)
        self._background.append(thread)
        thread.start()

    @property
    def building_in_background(self) -> bool:
        return any(t.is_alive() for t in self._background)

    def wait(self) -> None:
        """Until the background builds, if any, have finished."""
        for thread in self._background:
            thread.join()
