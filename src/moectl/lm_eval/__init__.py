"""``moectl`` as an lm-eval model name: registration, and lm-eval's command line with it registered.

    python -m moectl.lm_eval --model moectl --model_args pretrained=DIR,policy=FILE --tasks arc_easy ...

runs lm-eval's own command line (every flag of ``lm_eval``) after registering the backend
(:class:`moectl.eval.lm_backend.MoectlLM`; ``__main__.py``). In Python, ``import moectl`` is enough:

- if ``lm_eval`` is already imported, ``import moectl`` registers ``moectl`` at once;
- otherwise it leaves a finder on ``sys.meta_path`` that waits for ``lm_eval.api.registry`` to be
  imported and registers ``moectl`` right after that module has run (and then removes itself).

Registration is lazy (``model_registry.register("moectl", target="moectl.eval.lm_backend:MoectlLM")``):
the backend, torch-heavy, loads when lm-eval first asks for the model. lm-eval's own built-in
models are registered first (``import lm_eval.models``: a table of names), since lm-eval only
fills its registry when it finds it empty. This module imports nothing beyond the standard
library until lm-eval is in use, so ``import moectl`` stays light. Registering from the hook
never breaks lm-eval's own import: a failure there is a warning (``register()`` itself raises).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

MODEL_NAME = "moectl"
TARGET = "moectl.eval.lm_backend:MoectlLM"
_REGISTRY = "lm_eval.api.registry"


def register() -> None:
    """Register ``moectl`` as an lm-eval model (idempotent; imports lm-eval's registry)."""
    import lm_eval.models  # noqa: F401 - lm-eval's built-in names, before the registry is non-empty
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=TARGET)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader of ``lm_eval.api.registry``, then registers moectl."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        sys.modules[module.__name__] = module  # what later imports of it (lm_eval.models) find
        try:
            register()
        except Exception as err:  # an lm-eval without this registry API: lm-eval itself still loads
            warnings.warn(f"moectl could not register itself as an lm-eval model: {err}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self.inner, name)


class RegisterOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder: when ``lm_eval.api.registry`` is imported, wrap its loader."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != _REGISTRY:
            return None
        uninstall()  # once only; the other finders find the real module
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def uninstall() -> None:
    """Remove the finder (if installed)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, RegisterOnImport)]


def install() -> None:
    """Register now if lm-eval's registry is loaded, else when it is imported (``import moectl`` calls this)."""
    if _REGISTRY in sys.modules:
        register()
    elif not any(isinstance(f, RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterOnImport())
