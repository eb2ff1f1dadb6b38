"""Import-only stand-ins for packages SGLang imports but cannot load on a plain CPU.

- ``sgl_kernel``: the PyPI build is CUDA-only (its import needs libcuda). SGLang imports it at
  module level in many places but, on a CPU without AMX, its CPU paths fall back to PyTorch and
  never call a kernel while serving. The stand-in hands out functions that raise a clear error
  if one ever is called. Submodules that SGLang guards with ``except ImportError`` (for example
  ``scalar_type``) are reported missing so SGLang takes its own fallback.
- ``torchvision``: no PyPI torchvision matches the CPU torch wheel, and installing one pulls a
  CUDA torch. SGLang's multimodal processors import it at module level; text models never use it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

# sgl_kernel submodules SGLang imports under try/except ImportError: report them missing.
MISSING_KERNEL_SUBMODULES = frozenset({"scalar_type"})


class KernelUnavailableError(NotImplementedError):
    """A CUDA kernel was called on the CPU engine."""


def _unavailable(qualname: str) -> Any:
    def call(*_args: Any, **_kwargs: Any) -> Any:
        raise KernelUnavailableError(
            f"{qualname} is a CUDA kernel and is not available on the CPU engine "
            "(omniinfer import shim)"
        )

    call.__name__ = qualname.rsplit(".", 1)[-1]
    call.__qualname__ = qualname
    return call


class _Placeholder:
    """Stands for any torchvision object; fails only when used."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, name: str) -> _Placeholder:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *_args: Any, **_kwargs: Any) -> Any:
        raise KernelUnavailableError(f"{self._qualname} needs torchvision, absent on the CPU engine")

    def __mro_entries__(self, _bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __repr__(self) -> str:
        return f"<omniinfer placeholder {self._qualname}>"


class ShimModule(types.ModuleType):
    """A module whose every unknown public attribute is a placeholder."""

    placeholder_kind = "kernel"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        qualname = f"{self.__name__}.{name}"
        value = _unavailable(qualname) if self.placeholder_kind == "kernel" else _Placeholder(qualname)
        setattr(self, name, value)
        return value


class ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a package and all its submodules as ShimModules."""

    def __init__(self, package: str, kind: str, missing: frozenset[str] = frozenset()) -> None:
        self.package = package
        self.kind = kind
        self.missing = missing

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.package and not fullname.startswith(self.package + "."):
            return None
        tail = fullname[len(self.package) + 1 :]
        if tail and tail.split(".")[0] in self.missing:
            raise ModuleNotFoundError(
                f"{fullname} is not provided on the CPU engine (omniinfer import shim)", name=fullname
            )
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = ShimModule(spec.name)
        module.placeholder_kind = self.kind
        module.__path__ = []
        module.__omniinfer_shim__ = True
        if spec.name == self.package:
            module.__version__ = "0.0.0+omniinfer.cpu.shim"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install(
    meta_path: list[Any] | None = None, *, torchvision: bool | None = None
) -> list[ShimFinder]:
    """Put the stand-ins first on the import path (idempotent).

    The sgl_kernel stand-in always shadows an installed CUDA build (which cannot load here);
    the torchvision one is added only when no torchvision is installed.
    """
    target = sys.meta_path if meta_path is None else meta_path
    if torchvision is None:
        torchvision = importlib.util.find_spec("torchvision") is None
    present = {f.package for f in target if isinstance(f, ShimFinder)}
    wanted = [ShimFinder("sgl_kernel", "kernel", MISSING_KERNEL_SUBMODULES)]
    if torchvision:
        wanted.append(ShimFinder("torchvision", "placeholder"))
    added = []
    for finder in wanted:
        if finder.package not in present:
            target.insert(0, finder)
            added.append(finder)
    return added
