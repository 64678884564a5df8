"""A small name -> callable registry, the one every family of variants uses: advantage
estimators, policy losses and KL estimators (``gpu_jobs.algos``), rollout roles, reward
functions and dataset generators.

Registering a name twice raises; asking for an unknown name raises and lists the valid names
(fsspec ``registry.py``, verl ``register_adv_est``). Keys are plain strings; members of a
``str`` Enum are accepted wherever a name is and are stored by their ``.value``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from enum import Enum
from typing import Generic, TypeVar

__all__ = ["Registry", "UnknownNameError", "DuplicateNameError"]

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """Raised for a name that is not registered; the message lists the valid names.

    It is both a ``KeyError`` (mapping lookup) and a ``ValueError`` (bad config value), so
    either ``except`` clause catches it.
    """

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0])


class DuplicateNameError(ValueError):
    """Raised when a name is registered a second time."""


def _key(name: str | Enum) -> str:
    if isinstance(name, Enum):
        return str(name.value)
    if not isinstance(name, str):
        raise TypeError(f"registry names are str or str Enum members, got {type(name).__name__}")
    return name


class Registry(Mapping[str, T], Generic[T]):
    """A read-mostly mapping from names to implementations.

    >>> losses = Registry("toy loss")
    >>> @losses.register("double")
    ... def double(x):
    ...     return 2 * x
    >>> losses.get_fn("double")(3)
    6
    >>> sorted(losses)
    ['double']
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str | Enum) -> Callable[[T], T]:
        """Decorator: add ``fn`` under ``name``; a name already taken raises ``DuplicateNameError``."""
        key = _key(name)

        def decorator(fn: T) -> T:
            if key in self._items:
                raise DuplicateNameError(
                    f"{self.kind} {key!r} is already registered ({self._items[key]!r}); "
                    "pick another name"
                )
            self._items[key] = fn
            return fn

        return decorator

    def get_fn(self, name: str | Enum) -> T:
        """The implementation registered under ``name``; unknown names raise ``UnknownNameError``."""
        return self[name]

    def __getitem__(self, name: str | Enum) -> T:
        key = _key(name)
        try:
            return self._items[key]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {key!r}; valid names are: {', '.join(sorted(self._items))}"
            ) from None

    def __contains__(self, name: object) -> bool:
        if isinstance(name, Enum):
            name = name.value
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={sorted(self._items)})"
