"""mlxcluster: tensor-parallel LLM inference over MLX ranks."""

__version__ = "0.1.0"


def _defer_mlx_lm_init() -> None:
    """Let ``import mlx_lm.models.X`` skip ``mlx_lm/__init__.py`` until a name of the package itself is used.

    mlx-lm's ``__init__`` (0.32: ``from .convert import convert``, ``.generate``, ``.utils``) imports
    ``mlx_lm.tokenizer_utils`` and with it ``transformers``: 1.1-1.5 s of every process here, although a
    rank >= 1 only needs ``mlx_lm.models`` (the architectures and ``models.cache``) and never tokenises.
    So ``mlx_lm`` is registered as its package (its ``__path__``: submodules import as usual) whose
    ``__init__`` runs on the first attribute asked of it (PEP 562's module ``__getattr__``):
    ``from mlx_lm import generate`` and ``mlx_lm.load`` behave as always.  mlx-lm's ``__init__`` sets
    ``TRANSFORMERS_NO_ADVISORY_WARNINGS``; it is set here too, for a ``transformers`` imported first
    by ``mlx_lm.utils`` or by this package's tokenizer.  Nothing happens when ``mlx_lm`` is already
    imported or not installed.
    """
    import importlib.util
    import os
    import sys
    import threading

    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    package = importlib.util.module_from_spec(spec)
    lock = threading.RLock()
    loading = []  # [True] while mlx-lm's __init__ runs (on the thread that holds the lock)

    def __getattr__(name: str):
        with lock:
            if "__getattr__" in package.__dict__ and not loading:
                loading.append(True)
                try:
                    spec.loader.exec_module(package)  # mlx-lm's own __init__, once
                finally:
                    loading.clear()
                    package.__dict__.pop("__getattr__", None)
        try:
            return package.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

    package.__getattr__ = __getattr__
    sys.modules["mlx_lm"] = package


_defer_mlx_lm_init()
