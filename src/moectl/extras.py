"""Which ``pip install 'moectl[EXTRA]'`` brings which optional module, and the one message that says so.

``pip install moectl`` is the core (routing, traces, policies, masks, switch rate, inspect, export);
the extras in ``pyproject.toml`` bring what one family of verbs needs. :data:`MODULES` maps each
optional module to its extra and to the distribution of that extra that brings it
(``tests/test_extras.py`` checks it against ``pyproject.toml``). A library function that needs an
extra calls :func:`require` (or imports through :func:`optional_import`) and raises
:class:`~moectl.errors.MissingExtraError`; the command line turns any missing optional module into
one line, ``error: moectl VERB needs the EXTRA extra: pip install 'moectl[EXTRA]'``
(``moectl.cli.extras``).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from moectl.errors import MissingExtraError

MODULES: dict[str, tuple[str, str]] = {  # top-level module -> (its extra, the distribution that brings it)
    "fastapi": ("serve", "fastapi"),
    "starlette": ("serve", "fastapi"),
    "uvicorn": ("serve", "uvicorn"),
    "prometheus_client": ("serve", "prometheus-client"),
    "lm_eval": ("eval", "lm-eval"),
    "pyarrow": ("eval", "pyarrow"),
    "peft": ("train", "peft"),
    "optuna": ("train", "optuna"),
    "matplotlib": ("plots", "matplotlib"),
    "rdata": ("corpus", "rdata"),
    "llama_cpp": ("llama", "llama-cpp-python"),
}
ALSO: dict[str, tuple[str, ...]] = {"train": ("matplotlib",)}  # extra -> modules it brings beyond its own


def modules_of(extra: str) -> list[str]:
    """The top-level modules ``extra`` brings (``"train"`` -> peft, optuna, matplotlib)."""
    return [module for module, (name, _) in MODULES.items() if name == extra] + list(ALSO.get(extra, ()))


def extra_of(module: str | None) -> str | None:
    """The extra that brings ``module`` (``"matplotlib.figure"`` -> ``"plots"``), or None for a
    module of the core or of no extra."""
    if not module:
        return None
    entry = MODULES.get(module.split(".")[0])
    return entry[0] if entry else None


def installed(module: str) -> bool:
    """Whether the top-level package of ``module`` can be imported (found, not imported)."""
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):  # a module whose import failed earlier, or a __spec__ of None
        return False


def missing_modules(extra: str) -> list[str]:
    """The modules ``extra`` brings that are not installed (empty: the extra is there)."""
    return [module for module in modules_of(extra) if not installed(module)]


def message(what: str, extra: str) -> str:
    """The one line: ``WHAT needs the EXTRA extra: pip install 'moectl[EXTRA]'``."""
    return f"{what} needs the {extra} extra: pip install 'moectl[{extra}]'"


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` when any module it brings is missing."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(message(what, extra), name=missing[0])


def missing_extra(err: BaseException) -> str | None:
    """The extra whose absence ``err`` (an ``ImportError``) shows, or None: the module it could not
    import is an optional one and is not installed (a module missing inside an installed package is
    a version mismatch, not a missing extra)."""
    if not isinstance(err, ImportError):
        return None
    extra = extra_of(err.name)
    return extra if extra is not None and not installed(err.name or "") else None


def optional_import(module: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``; a missing optional package as :class:`MissingExtraError`."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        extra = missing_extra(err)
        if extra is None:
            raise
        raise MissingExtraError(message(what, extra), name=err.name) from err
