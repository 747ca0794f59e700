"""A pass run every few seconds in a daemon thread of a worker's main process, on a ledger
connection pool of its own (never the tasks'): the recovery pass and the webhook pass
(workers.recovery.start_thread starts both). A failed pass (the database away, say) is
logged and tried again at the next interval."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from jobs import ledger
from jobs.settings import Settings

log = logging.getLogger(__name__)


class PeriodicThread:
    """Runs pass_once(Session) every settings.recovery_interval_s seconds until stop()."""

    def __init__(self, settings: Settings, name: str, pass_once: Callable[[sessionmaker[Session]], None]):
        self.settings, self.name, self.pass_once = settings, name, pass_once
        self.Session: sessionmaker[Session] | None = None   # made on first use, in the thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pipeline-{name}", daemon=True)

    def start(self) -> "PeriodicThread":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.settings.recovery_interval_s):
            try:
                if self.Session is None:
                    self.Session = ledger.session_factory(ledger.make_engine(self.settings.database_url))
                self.pass_once(self.Session)
            except Exception:
                log.exception("%s pass failed", self.name)
