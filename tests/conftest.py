import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(session, config, items):
    """Modules longest first, by their seconds in a recorded full run (``tests/module_seconds.json``,
    ``scripts/module_seconds.py``); tests keep their order inside a module, and modules not on record
    follow in collection order.  With ``--no-loadscope-reorder`` (``scripts/test.sh``) xdist hands
    the modules to its workers in this order: longest processing time first, so no long module
    starts last while the other worker idles (xdist's own reorder is by a module's count of tests)."""
    import json

    try:
        with open(os.path.join(ROOT, "tests", "module_seconds.json")) as fh:
            seconds = json.load(fh)
    except (OSError, ValueError):
        return
    order = {}
    for item in items:
        order.setdefault(item.nodeid.split("::", 1)[0], len(order))
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::", 1)[0], 0.0),
                                 order[item.nodeid.split("::", 1)[0]]))


@pytest.fixture(scope="module")
def model():
    """The tiny random-weight Llama (``tinymodel.tiny_llama(seed=0)``) built whole in float32, once per
    module: the in-process engines' model (a module may define its own ``model`` instead)."""
    import tinymodel
    from mlxcluster.model.tp import build_model

    config, weights = tinymodel.tiny_llama(seed=0)
    return build_model(config, weights, None, "float32")


@pytest.fixture(scope="module")
def executor():
    """The in-process rank's one MLX thread (rank 0's scheduler, and a draft service beside it), once
    per module."""
    from concurrent.futures import ThreadPoolExecutor

    ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
    yield ex
    ex.shutdown(wait=True)


@pytest.fixture(scope="session")
def real_model_path():
    """Path of the embedded SmolLM2-135M-Instruct GGUF (skips if not installed)."""
    from mlxcluster.model.loader import ModelError, default_model_path

    try:
        return default_model_path()
    except ModelError as exc:
        pytest.skip(f"real model unavailable: {exc}")


TEST_SECRET = "test-cluster-secret-0123"


@pytest.fixture(scope="session")
def tls():
    """Mutual-TLS credentials of a test cluster (:mod:`mlxcluster.security`; derived once: scrypt)."""
    from mlxcluster.security import credentials

    return credentials(TEST_SECRET, "local")


@pytest.fixture(scope="session")
def other_tls():
    """Credentials of another secret: every handshake with :func:`tls` peers fails."""
    from mlxcluster.security import credentials

    return credentials("another-secret-4567", "local")


@pytest.fixture(scope="session")
def tp1_reference(real_model_path):
    """TP=1's answers on the real model (float32), one group for the session (:class:`harness.Reference`)."""
    from harness import Reference

    reference = Reference(real_model_path)
    yield reference
    reference.close()


@pytest.fixture(scope="module")
def groups(real_model_path):
    """One rank group at a time on the real model, reused by a module's checks of one topology
    (:class:`harness.Groups`); the last one stops with the module."""
    from harness import Groups

    pool = Groups(real_model_path)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def _plain_groups(real_model_path):
    """``get(n)``: the session's plain TP=``n`` group on the real model (float32; MPI when installed,
    else the ring), started on first use and again only if it failed; all stopped with the session."""
    from mlxcluster.runtime.launcher import LocalCluster, mpirun_path

    running = {}

    def get(n):
        if n in running and running[n].failure:
            running.pop(n).stop()
        if n not in running:
            running[n] = LocalCluster(n, "mpi" if mpirun_path() and n > 1 else "ring", model=real_model_path,
                                      weights="float32", start_timeout_s=300).start()
        return running[n]

    yield get
    for group in running.values():
        group.stop()


@pytest.fixture(scope="module")
def tp1_group(_plain_groups):
    """A plain TP=1 group on the real model (float32), shared by the modules that serve from one and
    never break it (kill, freeze, fault)."""
    return _plain_groups(1)


@pytest.fixture(scope="module")
def tp3_group(_plain_groups):
    """A plain TP=3 group on the real model (float32; MPI when installed, else the ring), shared as
    :func:`tp1_group` is."""
    return _plain_groups(3)


@pytest.fixture(scope="session")
def draft_model(real_model_path, tmp_path_factory):
    """A draft model with the target's tokenizer: the real model's first 6 layers (its embedding, final
    norm and head) exported float32 as an mlx-lm directory (:func:`drafters.export_first_layers`), once
    per session; the ``model:PATH`` drafter's path."""
    from mlxcluster.engine.drafters import export_first_layers

    return export_first_layers(real_model_path, str(tmp_path_factory.mktemp("draft") / "smollm2-6"), 6)


@pytest.fixture(scope="session")
def drafters(draft_model):
    """Each drafter of issue 30 as a request's ``speculative`` ``(draft, draft_tokens)``: n-gram prompt
    lookup, a draft model (:func:`draft_model`) and the target's own first 6 layers (``layers:6``; where
    rank 0 holds a shard or not the first layers, an unsharded copy read from the model's file)."""
    return (("ngram", 4), (f"model:{draft_model}", 4), ("layers:6", 4))


@pytest.fixture
def full_drafts(monkeypatch):
    """Every drafting sequence drafts its bound each plan (not what the measured verify cost says): which
    plans verify then depends on the tokens alone, not on this machine's timings -- for checks of what a
    drafting sequence does, not of when it drafts (by measurement the tiny model's verify step, ~1.8 of
    its host-bound plain step here, soon stops a lone sequence drafting)."""
    from mlxcluster.engine.speculative import AdaptiveK

    monkeypatch.setattr(AdaptiveK, "next_k", lambda self: self.max_k)
