"""Registry: the one list of names of a pluggable family (KV managers, batching policies).

A family's registry lives next to its interface, and each in-tree member is registered
there in one line. The CLI's choices, the settings' validation, the benchmarks and the
docs read the names from it, so a new member is one new file plus one registration.
"""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, setting: str) -> None:
        self.setting = setting  # the setting that names a member, e.g. "kv_manager"
        self._members: dict[str, T] = {}

    def register(self, name: str, member: T | None = None) -> T | Callable[[T], T]:
        """``registry.register("name", cls)``, or ``@registry.register("name")``."""
        if member is None:
            return lambda m: self.register(name, m)
        if name in self._members and self._members[name] is not member:
            raise ValueError(f"{self.setting} {name!r} is already registered")
        self._members[name] = member
        return member

    def unregister(self, name: str) -> None:
        self._members.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._members)

    def check(self, name: object) -> None:
        """Raise ValueError naming the allowed names unless ``name`` is registered."""
        if name not in self._members:
            raise ValueError(f"{self.setting} must be one of {list(self._members)}, "
                             f"got {name!r}")

    def __getitem__(self, name: str) -> T:
        self.check(name)
        return self._members[name]

    def __contains__(self, name: object) -> bool:
        return name in self._members
