"""pipeline.host_memory: threads that allocate after use_one_malloc_arena() share the main
glibc arena (counted with malloc_info in a fresh interpreter), and the entry points of the
processes that run an engine thread (the `pipeline` command, a Celery worker) set it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Four threads allocate at once; malloc_info then lists one <heap> per arena in use.
COUNT_ARENAS = r"""
import ctypes, re, sys, tempfile, threading
from pipeline.host_memory import use_one_malloc_arena
if sys.argv[1] == "one":
    assert use_one_malloc_arena()
elif sys.argv[1] == "cli":   # any `pipeline` command
    from cli import main
    main(["list"], standalone_mode=False)
elif sys.argv[1] == "worker":   # what `celery -A workers.app worker` does first: its modules, as it imports them
    import workers.app
    workers.app.app.loader.import_default_modules()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
start = threading.Barrier(4)
def work():
    start.wait()
    blocks = [libc.malloc(64 << 10) for _ in range(16)]
    start.wait()   # all four hold memory at once
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    print(len(re.findall(r'<heap nr="\d+">', open(f.name).read())))
"""


def arenas_used(mode: str, **env) -> int:
    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    done = subprocess.run([sys.executable, "-c", COUNT_ARENAS, mode], capture_output=True, text=True,
                          timeout=60, env={**environ, **env})
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])   # the last line: whatever the command printed comes first


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc arenas are Linux's")
def test_threads_share_the_main_arena_once_set():
    assert arenas_used("default") >= 4   # glibc's own choice: an arena per allocating thread
    assert arenas_used("one") == 1


def test_a_users_own_choice_is_left_alone(monkeypatch):
    from pipeline.host_memory import use_one_malloc_arena

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert use_one_malloc_arena() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc arenas are Linux's")
def test_the_pipeline_command_and_a_celery_worker_set_it(tmp_path):
    assert arenas_used("cli", PIPELINE_DATA_DIR=str(tmp_path)) == 1
    assert arenas_used("worker") == 1


# A 64 MB block: mapped on its own by glibc's defaults (over its 32 MB ceiling), from the heap once kept.
COUNT_MAPPED = r"""
import ctypes, sys
from pipeline.host_memory import keep_freed_memory
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2().hblks   # what importing mapped already
block = libc.malloc(64 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc is Linux's")
@pytest.mark.parametrize("mode, mapped", [("default", 1), ("keep", 0)])
def test_keep_freed_memory_serves_large_blocks_from_the_heap(mode, mapped):
    done = subprocess.run([sys.executable, "-c", COUNT_MAPPED, mode], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))})
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == mapped
