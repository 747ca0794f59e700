"""The engine's clock: every time it stamps or checks (arrival, first step, first token,
finish, timeouts) is `now()`, monotonic seconds. Read through the module (`clock.now()`),
so that a test can replace it and cross a timeout without waiting."""
from __future__ import annotations

import time

now = time.perf_counter
