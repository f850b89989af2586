"""The one registry type: named entries, in the order they were added.

Every registry of the package is one of these, declared as a table of frozen spec dataclasses in
its package (the rules in :mod:`jaxdecode.rules`, the drafts in :mod:`jaxdecode.speculative.drafts`,
the studies in :mod:`jaxdecode.eval.studies`). An entry is anything with a ``name``. A registry
reads like a dict (``name in R``, ``R[name]``, iteration in order); :meth:`Registry.add`
registers one more entry (a user's own draft, say) and refuses a name that is taken, ``R[name] =
entry`` replaces one on purpose, ``del R[name]`` removes one, and :meth:`Registry.lookup` is the
one place an unknown name becomes a one-line error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "choices"]


def choices(names: Iterable[str]) -> str:
    """``'a', 'b' or 'c'``."""
    names = [repr(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class Registry(MutableMapping, Generic[T]):
    """Entries by ``entry.name``; ``what`` names an entry in messages (``"draft kind"``)."""

    def __init__(self, what: str, entries: Iterable[T] = ()):
        self.what = what
        self._entries: dict[str, T] = {}
        for entry in entries:
            self.add(entry)

    def add(self, entry: T) -> T:
        """Register ``entry``; a name registered already is refused."""
        name = entry.name
        if name in self._entries:
            raise ValueError(f"a {self.what} named {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def lookup(self, name: str) -> T:
        """The entry ``name``, or a :class:`ValueError` that lists the names there are."""
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(f"unknown {self.what} {name!r}: use {choices(self._entries)}")
        return entry

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __setitem__(self, name: str, entry: T) -> None:
        if entry.name != name:
            raise ValueError(f"a {self.what} registered as {name!r} is named {entry.name!r}")
        self._entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._entries)})"
