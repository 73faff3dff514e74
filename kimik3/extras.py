"""The optional parts of kimik3 and the packages each needs (pyproject.toml's extras).

The core (``pip install kimik3``) trains, generates and inspects; ``[serve]`` adds the HTTP server,
``[plot]`` the training run's ``loss.png``, ``[parquet]`` reading ``.parquet`` corpora and
``[triton]`` the Triton KDA kernels (CUDA builds of torch on Linux bring triton already). Code of
an extra imports its packages where it needs them, after ``require`` (or turning the ImportError of
its imports into ``MissingExtra``, as ``serve/server.py`` does), so that a missing extra is one
clear sentence naming the install command instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib

# The import names each extra provides (tests/test_packaging.py checks them against pyproject.toml).
EXTRAS: dict[str, tuple[str, ...]] = {
    # PIL (Pillow): decoding the PNG/JPEG images of chat requests (kimik3/serve/images.py)
    "serve": ("fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn", "prometheus_client", "jinja2", "PIL"),
    "plot": ("matplotlib",),
    "parquet": ("pyarrow",),
    "triton": ("triton",),
}


class MissingExtra(ImportError):
    """A feature was used whose extra is not installed; the message says what to install."""

    def __init__(self, feature: str, extra: str, module: str) -> None:
        super().__init__(f"{feature} needs the [{extra}] extra: pip install 'kimik3[{extra}]' "
                         f"(no module named {module!r})", name=module)
        self.feature, self.extra = feature, extra


def require(extra: str, feature: str, modules: tuple[str, ...] | None = None) -> None:
    """Import the packages of ``extra`` (or just ``modules`` of it); raise ``MissingExtra`` naming
    ``feature`` and the install command when one is missing."""
    for module in EXTRAS[extra] if modules is None else modules:
        try:
            importlib.import_module(module)
        except ImportError as err:   # err.name: the module missing, maybe one the package itself needs
            raise MissingExtra(feature, extra, err.name or module) from err
