"""A background thread that calls `poll()` every `interval` seconds until `stop()`: the shape of
every watcher in the tests (fake kubelets, pod monitors, health pollers)."""

from __future__ import annotations

import sys
import threading


class Poller:
    interval: float = 0.1

    def start(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def poll(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as e:  # keep watching: one failed round is not the end of the test
                print(f"{type(self).__name__}: {e!r}", file=sys.stderr)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
